"""Child processes that never outlive the orchestrator, even when it is killed with SIGKILL.

`spawn()` starts a command under a small guard process (`python -m
orchestrate.serving.processes CMD...`). The kernel sends the guard SIGTERM when the
orchestrator dies (PR_SET_PDEATHSIG); the guard then stops the command's
whole process group, SIGTERM first and SIGKILL after a grace period. This
catches what a plain parent-death signal misses: vLLM's engine core outlives
a killed API server, and an API server still starting ignores SIGTERM.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1
GRACE_S = 10.0


def _guard_preexec() -> None:
    os.setsid()  # the guard leads its own group, so stop() can signal guard and command together
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def parse_cpus(text: str) -> list[int]:
    """A core list as taskset and vLLM write it ('0-3,6') -> sorted core ids; ValueError names what is wrong."""
    cores: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{text!r} is not a core list such as '0', '0-3' or '0-3,6'")
        a, b = int(first), int(last or first)
        if b < a:
            raise ValueError(f"{part.strip()!r}: a range goes up")
        cores.update(range(a, b + 1))
    return sorted(cores)


def format_cpus(cores) -> str:
    """Core ids -> '0-1,4' (the form vLLM's VLLM_CPU_OMP_THREADS_BIND takes)."""
    ranges: list[list[int]] = []
    for cpu in sorted(cores):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in ranges)


def spawn(
    command: list[str], log_path, env: dict[str, str] | None = None, cpus: list[int] | None = None
) -> subprocess.Popen:
    """Start `command` under a guard, its output appended to `log_path`, on the cores `cpus` (default: this
    process's); its children inherit them. Call from the main thread (the parent-death signal follows the
    thread that forks)."""

    def preexec() -> None:
        _guard_preexec()
        if cpus:
            os.sched_setaffinity(0, cpus)

    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "orchestrate.serving.processes", *command],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, preexec_fn=preexec,
        )  # fmt: skip


def stop(process: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM the guard (it stops the command's group), then SIGKILL whatever is left."""
    if process.poll() is None:
        try:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=timeout + GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _others_in_my_group() -> list[int]:
    """Pids of this process group other than this process (from /proc)."""
    me, group, out = os.getpid(), os.getpgid(0), []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "pid (name)": state ppid pgrp ...
            except OSError:
                continue
            if int(fields[2]) == group:
                out.append(int(entry))
    return out


def _signal_others(sig: int) -> None:
    for pid in _others_in_my_group():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _guard(command: list[str]) -> int:
    # The command stays in the guard's group: a SIGKILL to the group (from
    # anyone) takes everything down, and the guard can clean up after it.
    child = subprocess.Popen(command)

    stopping: list[float] = []  # [signal, deadline] once asked to stop

    def on_term(signum, frame):
        # Only signal here: the main thread keeps reaping the child below.
        if not stopping:
            stopping.extend([signum, time.monotonic() + GRACE_S])
            _signal_others(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while True:
        try:
            code = child.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            if stopping and time.monotonic() > stopping[1]:
                _signal_others(signal.SIGKILL)
    _signal_others(signal.SIGKILL)  # leftovers such as an orphaned engine core
    if stopping:
        return 128 + int(stopping[0])
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(_guard(sys.argv[1:]))
