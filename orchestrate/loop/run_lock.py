"""One orchestrator per run directory: an flock on the directory itself.

The lock is held on an open file description of the run directory, so it
dies with the process that holds it (kill -9 included): nothing is left
behind to clean up, and no file is written to take it. The descriptor is
not inherited by child processes (Python opens it close-on-exec), so a vLLM
server or trainer still shutting down does not keep the run locked.

A second orchestrator is refused with the PID of the holder, found in
/proc/locks.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class RunDirInUse(RuntimeError):
    """Another process holds the run directory; the message is one line naming its PID."""


def lock_holder(path: str | os.PathLike) -> int | None:
    """PID of the process holding an flock on `path`, from /proc/locks (None if unknown)."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 12345 08:01:131090 0 EOF" (device numbers in hex)
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or "->" in fields:  # "->": a waiter, not the holder
            continue
        try:
            major, minor, inode = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino):
                return int(fields[4])
        except ValueError:
            continue
    return None


class RunLock:
    """`with RunLock(run_dir, what="orchestrate.rl"):` hold the run directory (it must exist)."""

    def __init__(self, root: str | os.PathLike, what: str = "an orchestrator"):
        self.root = Path(root)
        self.what = what
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = lock_holder(self.root)
            holder = f"process {pid}" if pid else "another process"
            raise RunDirInUse(
                f"{self.root} is in use by {holder} (another orchestrate.rl or orchestrate.after.offline on it); "
                "wait for it to end or stop it, or pass another directory"
            ) from None
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
