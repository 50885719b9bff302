"""Run model-written code: isolated, limited, and reported as an observation, never as an exception.

Model-written code is untrusted input. `Sandbox.run(code)` runs it with the
system's Python in a child process that:
- lives under bubblewrap (`bwrap`): its own user, PID, network, IPC, UTS and
  cgroup namespaces (no network at all: not even the host's 127.0.0.1), the
  system's /usr read-only and nothing else of the host's file system (no home
  directory, no run directory, no ~/.cache, no /etc), a fresh size-capped
  tmpfs as /tmp and working directory, a cleared environment (no inherited
  secrets or API keys), no further user namespaces, and it dies with its
  parent (`--die-with-parent`: bwrap's PID 1 takes every process of the
  sandbox with it);
- runs under resource limits set by `prlimit` before bwrap starts: address
  space, CPU seconds, processes, file size, open files; as root, the sandbox
  also runs as a user id of its own (a fresh one per run), so the process
  limit counts its processes only;
- is in its own session and process group, killed whole on timeout;
- has its output capped (stdout and stderr each): past the cap the rest is
  dropped and the program stopped.

A timeout, a crash, a limit reached or output past the cap is a result: the
stdout and stderr so far, the exit code, `timed_out`, `output_truncated`. A
sandbox that could not start (bwrap refused to run, no Python inside) is an
infrastructure failure: `infra_error` says why, and the caller flags the
episode instead of scoring it.

Without bwrap the sandbox refuses to be built (`SandboxUnavailable`), unless
the configuration opts into `isolation = "unsafe_subprocess"`: the same
limits, session and environment, but no namespaces: the code sees the host's
files and network. The name says what it is.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Isolation = Literal["bwrap", "unsafe_subprocess"]
SANDBOX_UID_BASE = 2_000_000_000  # as root: each run gets a uid (and gid) from BASE on, ids no account uses
SANDBOX_UID_POOL = 1 << 20  # ids handed out in turn: one is used again only ~10^6 runs later
_uid_lock = threading.Lock()
_uid_next = (os.getpid() * 7919) % SANDBOX_UID_POOL  # two processes on one machine start apart
_uids_in_use: set[int] = set()


def _take_uid() -> int:
    """A user id for one run, none in use by another run of this process.

    Each run gets a fresh id rather than one per slot: the kernel releases a finished run's count
    of processes for its id asynchronously (its user namespace is freed later; measured: ~30 quick
    runs in a row on one id reach RLIMIT_NPROC 32, and it recovers within 2 s), so reusing ids at
    once made bwrap fail with "Can't fork for pid 1"."""
    global _uid_next
    with _uid_lock:
        while True:
            uid = SANDBOX_UID_BASE + _uid_next
            _uid_next = (_uid_next + 1) % SANDBOX_UID_POOL
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid


def _give_uid(uid: int) -> None:
    with _uid_lock:
        _uids_in_use.discard(uid)


PATH_INSIDE = "/usr/local/bin:/usr/bin:/bin"


class SandboxConfig(BaseModel):
    """How model-written code runs (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    isolation: Isolation = Field(
        "bwrap",
        description="bwrap: namespaces, no network, only /usr visible (read-only); unsafe_subprocess: "
        "the same limits without isolation (the code sees this machine's files and network)",
    )
    timeout_s: float = Field(10.0, gt=0, le=3600, description="wall-clock seconds before the whole sandbox is killed")
    cpu_s: int = Field(10, ge=1, description="CPU seconds per process (RLIMIT_CPU)")
    memory_mb: int = Field(1024, ge=64, description="address space per process, MiB (RLIMIT_AS)")
    processes: int = Field(32, ge=4, description="processes and threads at once (RLIMIT_NPROC)")
    file_size_mb: int = Field(16, ge=1, description="largest file the code may write, MiB (RLIMIT_FSIZE)")
    tmp_mb: int = Field(64, ge=1, description="size of the sandbox's /tmp (its working directory), MiB")
    open_files: int = Field(64, ge=16, description="open file descriptors (RLIMIT_NOFILE)")
    output_bytes: int = Field(16_384, ge=256, description="stdout and stderr kept, each; past it the program stops")
    python: str = Field("/usr/bin/python3", description="the Python that runs the code (must live under /usr)")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None: it never ran (infra_error) ; negative: killed by that signal
    timed_out: bool = False
    output_truncated: bool = False
    seconds: float = 0.0
    infra_error: str | None = None  # the sandbox itself failed: not the code's fault

    @property
    def ok(self) -> bool:
        return self.infra_error is None and not self.timed_out and self.exit_code == 0

    def observation(self, limit: int = 2000) -> str:
        """What the agent is told: output, errors, and how the program ended."""
        if self.infra_error:
            return f"[sandbox error: {self.infra_error}]"
        parts = []
        if self.stdout:
            parts.append(_tail(self.stdout, limit))
        if self.stderr:
            parts.append(("stderr:\n" if self.stdout else "") + _tail(self.stderr, limit))
        if self.timed_out:
            parts.append(f"[timed out: the program was stopped after {self.seconds:.0f} s]")
        elif self.output_truncated:
            parts.append("[output cut: the program printed too much and was stopped]")
        elif self.exit_code not in (0, None):
            name = _signal_name(-self.exit_code) if self.exit_code < 0 else None
            parts.append(f"[killed by {name}]" if name else f"[exit code {self.exit_code}]")
        return "\n".join(parts) if parts else "[no output]"


class SandboxInfraError(RuntimeError):
    """The sandbox could not run the code (`SandboxResult.infra_error`): the episode is an infrastructure
    failure, flagged on its tape and left out of training, never scored as a wrong answer."""


class SandboxUnavailable(RuntimeError):
    """The configured isolation cannot run on this machine (checked before anything starts); `field` names
    the SandboxConfig field to change."""

    def __init__(self, message: str, field: str = "isolation"):
        super().__init__(message)
        self.field = field


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def check_isolation(config: SandboxConfig) -> None:
    """Raise SandboxUnavailable, with one line saying what to do, when `config` cannot run here."""
    if not os.path.isfile(config.python) or not os.access(config.python, os.X_OK):
        raise SandboxUnavailable(f"{config.python} is not an executable file", "python")
    if config.isolation == "bwrap":
        if not shutil.which("bwrap"):
            raise SandboxUnavailable(
                "bubblewrap (bwrap) is not installed: `apt-get install bubblewrap` (Debian / Ubuntu), or opt into "
                "the weaker isolation = unsafe_subprocess (the code then sees this machine's files and network)"
            )
        if not config.python.startswith("/usr/"):
            raise SandboxUnavailable(
                f"{config.python}: under bwrap only /usr is visible; use a Python installed "
                "under /usr (e.g. /usr/bin/python3)",
                "python",
            )
    if not shutil.which("prlimit"):
        raise SandboxUnavailable("prlimit (util-linux) is not installed: the sandbox's resource limits need it")


class Sandbox:
    """Runs code under `config`; thread-safe, at most `slots` programs at once (more wait for a slot)."""

    def __init__(self, config: SandboxConfig | None = None, slots: int = 16):
        self.config = config or SandboxConfig()
        check_isolation(self.config)
        self.prlimit = shutil.which("prlimit")  # absolute paths: the child's PATH is a minimal one
        self.bwrap = shutil.which("bwrap") if self.config.isolation == "bwrap" else None
        self._free = list(range(slots))
        self._cond = threading.Condition()
        self.root = os.geteuid() == 0

    # ---- the command ---------------------------------------------------------------------------

    def _limits(self) -> list[str]:
        c = self.config
        nproc = c.processes
        if not self.root:  # the limit counts every process of this user: leave room for those already running
            nproc += _tasks_of_uid(os.getuid())
        return [
            self.prlimit,
            f"--as={c.memory_mb * 2**20}",
            f"--cpu={c.cpu_s}",
            f"--nproc={nproc}",
            f"--fsize={c.file_size_mb * 2**20}",
            f"--nofile={c.open_files}",
            "--core=0",
            "--",
        ]

    def _command(self, code_fd: int, info_fd: int) -> list[str]:
        c = self.config
        run = [c.python, "-I", "-B", "main.py"]
        if c.isolation == "unsafe_subprocess":
            return [*self._limits(), *run]
        return [
            *self._limits(), self.bwrap,
            "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--disable-userns",
            "--info-fd", str(info_fd),  # bwrap writes here once the program has started
            "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--symlink", "usr/sbin", "/sbin",
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(c.tmp_mb * 2**20), "--tmpfs", "/tmp",
            "--file", str(code_fd), "/tmp/main.py",
            "--remount-ro", "/",
            "--chdir", "/tmp",
            "--clearenv", "--setenv", "PATH", PATH_INSIDE, "--setenv", "HOME", "/tmp",
            "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONIOENCODING", "utf-8",
            *run,
        ]  # fmt: skip

    # ---- running ------------------------------------------------------------------------------

    def run(self, code: str, stdin: str = "") -> SandboxResult:
        """Run `code` as a Python program (main.py in a fresh working directory), `stdin` as its input."""
        with self._cond:
            while not self._free:
                self._cond.wait()
            slot = self._free.pop()
        try:
            return self._run(code, stdin, slot)
        finally:
            with self._cond:
                self._free.append(slot)
                self._cond.notify()

    def _run(self, code: str, stdin: str, slot: int) -> SandboxResult:
        c = self.config
        start = time.monotonic()
        workdir = None
        with tempfile.TemporaryFile() as code_file:
            code_file.write(code.encode("utf-8", "replace"))
            code_file.flush()
            code_file.seek(0)
            env = {"PATH": "/usr/bin:/bin"}
            kwargs: dict = {}
            if c.isolation == "unsafe_subprocess":
                workdir = tempfile.mkdtemp(prefix="tapeloop-sandbox-")
                with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="replace") as f:
                    f.write(code)
                env.update({"HOME": workdir, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"})
                kwargs["cwd"] = workdir
            uid = _take_uid() if self.root else None
            if uid is not None:  # a user id of its own: RLIMIT_NPROC then counts this run's processes only
                kwargs.update(user=uid, group=uid, extra_groups=[])
                if workdir:
                    os.chown(workdir, uid, uid)
            info_r, info_w = os.pipe()
            try:
                try:
                    proc = subprocess.Popen(
                        self._command(code_file.fileno(), info_w),
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        env=env,
                        start_new_session=True,
                        close_fds=True,
                        pass_fds=(code_file.fileno(), info_w),
                        **kwargs,
                    )
                except OSError as exc:
                    return SandboxResult("", "", None, infra_error=f"could not start: {exc}")
                finally:
                    os.close(info_w)
                try:
                    out, err, truncated, timed_out = self._communicate(proc, stdin.encode("utf-8", "replace"))
                finally:
                    _kill_group(proc)
                    proc.wait()
                started = c.isolation != "bwrap" or _read_all(info_r) != b""
            finally:
                os.close(info_r)
                if uid is not None:
                    _give_uid(uid)
                if workdir:
                    shutil.rmtree(workdir, ignore_errors=True)
        seconds = time.monotonic() - start
        result = SandboxResult(
            out.decode("utf-8", "replace"),
            err.decode("utf-8", "replace"),
            proc.returncode,
            timed_out=timed_out,
            output_truncated=truncated,
            seconds=seconds,
        )
        if not started:  # bwrap failed before the program started (what the program prints cannot fake this)
            result.infra_error = (result.stderr.strip().splitlines() or ["bwrap did not start"])[0]
        return result

    def _communicate(self, proc: subprocess.Popen, data: bytes) -> tuple[bytes, bytes, bool, bool]:
        """Feed stdin, read stdout / stderr up to the cap, stop the program past the cap or the timeout."""
        cap = self.config.output_bytes
        deadline = time.monotonic() + self.config.timeout_s
        buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
        truncated = timed_out = False
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        pending = memoryview(data)
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        open_streams = 2
        while open_streams:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                if key.fileobj is proc.stdin:
                    try:
                        n = os.write(proc.stdin.fileno(), pending[:65536])
                        pending = pending[n:]
                    except (BrokenPipeError, OSError):
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                buf = buffers[key.fileobj]
                room = cap - len(buf)
                buf += chunk[: max(room, 0)]
                if len(chunk) > room:
                    truncated = True
            if truncated:
                break
        sel.close()
        if truncated or timed_out:
            _kill_group(proc)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()) + 2.0)
        except subprocess.TimeoutExpired:  # closed its output but kept running
            timed_out = True
            _kill_group(proc)
        return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), truncated, timed_out


def _read_all(fd: int) -> bytes:
    """What is in a pipe whose writers are all gone."""
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox's process group (bwrap's PID 1 then takes the whole PID namespace with it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tasks_of_uid(uid: int) -> int:
    """Processes and threads this user runs now (what RLIMIT_NPROC counts)."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid == uid:
                count += len(os.listdir(f"/proc/{entry}/task"))
        except OSError:
            continue
    return count
