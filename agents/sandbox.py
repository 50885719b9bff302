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
- cannot make the system calls that reach outside it or let it outlive its
  caller (`DENIED_SYSCALLS`: ptrace, process_vm_*, bpf, keyctl, mount,
  unshare, setns, ...): a seccomp filter built with libseccomp, installed by
  bwrap (`--seccomp`);
- writes only to its /tmp: the root, /usr and a minimal /dev are read-only,
  and /dev/shm is /tmp, so one size cap (`tmp_mb`) covers every writable place;
- runs under resource limits set by `prlimit` before bwrap starts: address
  space, CPU seconds, processes, file size, open files; as root, the sandbox
  also runs as a user id of its own (a fresh one per run), so the process
  limit counts its processes only;
- has its memory and process count bounded for the whole run, not per
  process, by a cgroup of its own (`memory_mode` says which: cgroup v2
  memory.max + pids.max, else v1 memory.limit_in_bytes + pids.max) where this
  machine lets us create one; else only per process (RLIMIT_AS,
  RLIMIT_NPROC): a run may then hold up to `processes` x `memory_mb`;
- is ended whole on timeout and when its caller dies: the sandbox's PID 1
  (from bwrap's `--info-fd`; its death kills the PID namespace), bwrap's
  process group, and the run's cgroup are killed; `--die-with-parent` does
  the same when the caller is killed, and ptrace cannot undo it;
- has its output capped (stdout and stderr each): past the cap the rest is
  dropped and the program stopped.

A timeout, a crash, a limit reached or output past the cap is a result: the
stdout and stderr so far, the exit code, `timed_out`, `output_truncated`. A
sandbox that could not start (bwrap refused to run, no Python inside) is an
infrastructure failure: `infra_error` says why, and the caller flags the
episode instead of scoring it.

Without bwrap the sandbox refuses to be built (`SandboxUnavailable`), unless
the configuration opts into `isolation = "unsafe_subprocess"`: the same
limits, cgroup, session and environment, but no namespaces and no seccomp
filter: the code sees the host's files and network, and what it leaves
running may outlive a caller that is killed (a timeout still ends it when a
cgroup holds the run). The name says what it is.
"""

from __future__ import annotations

import itertools
import json
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

# System calls the program may not make (seccomp, EPERM): with these it could reach outside the sandbox or
# outlive it (ptrace of the sandbox's PID 1 clears the parent-death signal that ends the sandbox with its
# caller; process_vm_* read and write other processes), load code into the kernel (bpf, modules), or change
# its own namespaces and mounts. Built with libseccomp (a filter for this machine's architecture; a system
# call through another ABI, e.g. 32-bit int 0x80, kills the process), never as a hand-written BPF program.
DENIED_SYSCALLS = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "personality",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "userfaultfd",
    "perf_event_open",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "mount_setattr",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "open_by_handle_at",
    "name_to_handle_at",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
    "iopl",
    "ioperm",
    "lookup_dcookie",
    "io_uring_setup",
)
NAMESPACE_FLAGS = (0x10000000, 0x04000000, 0x08000000, 0x20000000, 0x40000000, 0x00020000, 0x02000000)
# CLONE_NEWUSER NEWUTS NEWIPC NEWPID NEWNET NEWNS NEWCGROUP: clone() with any of them fails (EPERM)


def seccomp_filter() -> bytes:
    """The seccomp filter (BPF) bwrap installs before it starts the program (`--seccomp FD`).

    clone3 answers ENOSYS (its flags live in memory a filter cannot read): the C library then falls back to
    clone(), whose flags the filter checks."""
    try:
        import seccomp  # libseccomp's own binding (Debian: python3-seccomp), when this Python sees it
    except ImportError:
        import pyseccomp as seccomp  # the same API over ctypes (PyPI: pyseccomp), needs libseccomp.so.2
    import errno

    filt = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        filt.add_rule(seccomp.ERRNO(errno.EPERM), name)
    for flag in NAMESPACE_FLAGS:
        filt.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    filt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as f:
        filt.export_bpf(f)
        f.seek(0)
        return f.read()


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
    memory_mb: int = Field(
        1024,
        ge=64,
        description="memory of the whole run, MiB (cgroup memory.max; without "
        "cgroups only per process: address space, RLIMIT_AS), and the address space of each process",
    )
    processes: int = Field(
        32, ge=4, description="processes and threads of the run at once (cgroup pids.max and RLIMIT_NPROC)"
    )
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
        try:
            seccomp_filter()
        except Exception as exc:  # ImportError, or OSError / RuntimeError from a missing libseccomp.so.2
            raise SandboxUnavailable(
                f"the sandbox's seccomp filter cannot be built ({type(exc).__name__}: {exc}): install the Python "
                "package pyseccomp (`uv sync`) and libseccomp2 (`apt-get install libseccomp2`)"
            ) from exc
    if not shutil.which("prlimit"):
        raise SandboxUnavailable("prlimit (util-linux) is not installed: the sandbox's resource limits need it")


class Sandbox:
    """Runs code under `config`; thread-safe, at most `slots` programs at once (more wait for a slot)."""

    def __init__(self, config: SandboxConfig | None = None, slots: int = 16):
        self.config = config or SandboxConfig()
        check_isolation(self.config)
        self.prlimit = shutil.which("prlimit")  # absolute paths: the child's PATH is a minimal one
        self.bwrap = shutil.which("bwrap") if self.config.isolation == "bwrap" else None
        self.seccomp = seccomp_filter() if self.bwrap else b""
        self._free = list(range(slots))
        self._cond = threading.Condition()
        self.root = os.geteuid() == 0
        # memory and processes of the whole run: a cgroup when this machine lets us create one, else only the
        # per-process limits (a run may then hold up to processes x memory_mb)
        self.cgroups, self.memory_mode = _Cgroups.find()
        if self.cgroups is None:
            self.memory_mode = f"rlimit (per process; {self.memory_mode})"

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

    def _command(self, code_fd: int, info_fd: int, seccomp_fd: int) -> list[str]:
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
            "--seccomp", str(seccomp_fd),
            "--proc", "/proc",
            # a minimal /dev on the read-only root, not bwrap's --dev (a writable tmpfs without a size): the
            # usual devices, and /dev/shm (POSIX shared memory, semaphores) is /tmp, counted in its cap
            *[arg for dev in ("null", "zero", "full", "random", "urandom") for arg in ("--dev-bind", f"/dev/{dev}", f"/dev/{dev}")],
            "--symlink", "/proc/self/fd", "/dev/fd", "--symlink", "/proc/self/fd/0", "/dev/stdin",
            "--symlink", "/proc/self/fd/1", "/dev/stdout", "--symlink", "/proc/self/fd/2", "/dev/stderr",
            "--size", str(c.tmp_mb * 2**20), "--tmpfs", "/tmp",
            "--symlink", "/tmp", "/dev/shm",
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
            seccomp_r, seccomp_w = os.pipe()
            os.write(seccomp_w, self.seccomp)  # a few hundred bytes: fits the pipe's buffer, bwrap reads to EOF
            os.close(seccomp_w)
            gate_r, gate_w = os.pipe() if self.cgroups else (None, None)
            command = self._command(code_file.fileno(), info_w, seccomp_r)
            if gate_r is not None:  # wait until this process has put the child in the run's cgroup, then start
                command = [
                    "/bin/bash",
                    "-c",
                    f'read -r _ <&{gate_r} && exec {gate_r}<&- && exec "$@"',
                    "gate",
                    *command,
                ]
            cgroup = None
            try:
                try:
                    cgroup = self.cgroups.create(c) if self.cgroups else None
                    proc = subprocess.Popen(
                        command,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        env=env,
                        start_new_session=True,
                        close_fds=True,
                        pass_fds=tuple(fd for fd in (code_file.fileno(), info_w, seccomp_r, gate_r) if fd is not None),
                        **kwargs,
                    )
                except OSError as exc:
                    return SandboxResult("", "", None, infra_error=f"could not start: {exc}")
                finally:
                    for fd in (info_w, seccomp_r, gate_r):
                        if fd is not None:
                            os.close(fd)
                run = _Running(proc, info_r, cgroup)
                try:
                    if cgroup is not None:
                        try:
                            cgroup.add(proc.pid)
                        except OSError as exc:
                            return SandboxResult("", "", None, infra_error=f"could not limit the run: {exc}")
                        os.write(gate_w, b"go\n")
                    out, err, truncated, timed_out = self._communicate(run, stdin.encode("utf-8", "replace"))
                finally:
                    run.kill()
                    proc.wait()
                    run.kill()  # what was left of the namespace or the cgroup, now that bwrap is gone
                started = c.isolation != "bwrap" or run.info() != b""
            finally:
                os.close(info_r)
                if gate_w is not None:
                    os.close(gate_w)
                if cgroup is not None:
                    cgroup.remove()
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

    def _communicate(self, run: _Running, data: bytes) -> tuple[bytes, bytes, bool, bool]:
        """Feed stdin, read stdout / stderr up to the cap, stop the program past the cap or the timeout."""
        proc = run.proc
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
            run.kill()
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()) + 2.0)
        except subprocess.TimeoutExpired:  # closed its output but kept running
            timed_out = True
            run.kill()
        return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), truncated, timed_out


class _Running:
    """One started run, and how to end all of it: bwrap's process group, the sandbox's PID 1 (its PID on this
    machine comes from bwrap's --info-fd; killing a PID namespace's init kills every process in it, whatever
    session or parent they have), and the run's cgroup when there is one."""

    def __init__(self, proc: subprocess.Popen, info_r: int, cgroup: _Cgroup | None):
        self.proc, self.info_r, self.cgroup = proc, info_r, cgroup
        self._info = b""
        os.set_blocking(info_r, False)

    def info(self) -> bytes:
        """What bwrap wrote on --info-fd so far ({"child-pid": N} once the program has started)."""
        try:
            while chunk := os.read(self.info_r, 65536):
                self._info += chunk
        except BlockingIOError:
            pass
        return self._info

    def kill(self) -> None:
        # the init first, while bwrap (its parent) is unreaped: its PID cannot have been reused yet
        if self.proc.returncode is None and self.proc.poll() is None:
            try:
                child = int(json.loads(self.info()).get("child-pid", 0))
            except (ValueError, AttributeError):  # nothing written yet: the namespace does not exist
                child = 0
            if child > 1:
                try:
                    os.kill(child, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.cgroup is not None:
            self.cgroup.kill()


# ---- the run's cgroup: memory and processes of the whole run ---------------------------------------------


class _Cgroup:
    """One run's cgroup (v2: one directory; v1: one in the memory and one in the pids hierarchy)."""

    def __init__(self, dirs: list[str], version: int):
        self.dirs, self.version = dirs, version

    def add(self, pid: int) -> None:
        for d in self.dirs:
            _write(d, "cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        found = set()
        for d in self.dirs:
            try:
                found.update(int(x) for x in _read(d, "cgroup.procs").split())
            except OSError:
                pass
        return sorted(found)

    def kill(self) -> None:
        if self.version == 2 and os.path.exists(os.path.join(self.dirs[0], "cgroup.kill")):
            try:
                _write(self.dirs[0], "cgroup.kill", "1")  # the kernel kills all of it, forks in flight included
                return
            except OSError:
                pass
        for _ in range(100):  # v1: one at a time; pids.max bounds how many can appear meanwhile
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def remove(self) -> None:
        """Kill what is left and remove the directories (a cgroup goes once its last process is reaped)."""
        deadline = time.monotonic() + 5.0
        for d in self.dirs:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: processes still exiting
                    if time.monotonic() > deadline:
                        break
                    self.kill()
                    time.sleep(0.01)


class _Cgroups:
    """Where this process may create the runs' cgroups, found once (`Sandbox.memory_mode` says which).

    cgroup v2 (memory.max, memory.swap.max 0, pids.max, memory.oom.group: an out-of-memory run is stopped
    whole) under this process's own cgroup, when its memory and pids controllers can be handed to children;
    else cgroup v1's memory and pids hierarchies (memory.limit_in_bytes, memsw, pids.max) where writable."""

    _numbers = itertools.count(1)  # one count per process: two Sandboxes in one process never share a name

    def __init__(self, parents: list[str], version: int):
        self.parents, self.version = parents, version
        self.prefix = f"tapeloop-sandbox-{os.getpid()}-"
        for parent in parents:  # runs of earlier processes that died before removing their cgroups
            for name in os.listdir(parent):
                path = os.path.join(parent, name)
                try:  # a minute old: not one another PID namespace's process has just made
                    if (
                        name.startswith("tapeloop-sandbox-")
                        and not _alive(name.split("-")[2])
                        and time.time() - os.stat(path).st_mtime > 60
                    ):
                        os.rmdir(path)  # fails while processes are in it
                except OSError:
                    pass

    @classmethod
    def find(cls) -> tuple[_Cgroups | None, str]:
        """(cgroups, the mode in words); (None, why not) when runs can only be limited per process."""
        if not os.access("/bin/bash", os.X_OK):  # the gate that holds a run until it is in its cgroup
            return None, "no /bin/bash to start runs inside a cgroup"
        mine = {}  # hierarchy ("" for v2, else its controllers) -> this process's path in it
        for line in _read("/proc/self", "cgroup").splitlines():
            _, controllers, path = line.split(":", 2)
            mine[controllers] = path
        mounts = {}  # "" (v2) or controller -> mount point
        for line in _read("/proc/self", "mountinfo").splitlines():
            fields = line.split(" - ", 1)
            point = fields[0].split()[4]
            fstype, _, options = fields[1].split()[:3]
            if fstype == "cgroup2":
                mounts.setdefault("", point)
            elif fstype == "cgroup":
                for option in options.split(","):
                    mounts.setdefault(option, point)
        reasons = []
        if "" in mounts and "" in mine:
            parent = mounts[""] + mine[""]
            try:
                available = _read(parent, "cgroup.controllers").split()
                if not {"memory", "pids"} <= set(available):
                    raise OSError(f"its controllers are {available or 'none'}, without memory and pids")
                enabled = _read(parent, "cgroup.subtree_control").split()
                if not {"memory", "pids"} <= set(enabled):
                    _write(parent, "cgroup.subtree_control", "+memory +pids")
                return cls._probe([parent], 2), f"cgroup2 ({parent}: memory.max, pids.max per run)"
            except OSError as exc:
                reasons.append(f"cgroup v2 at {parent}: {exc}")
        else:
            reasons.append("no cgroup v2 hierarchy")
        paths = {c: p for k, p in mine.items() for c in k.split(",") if c}
        if "memory" in mounts and "pids" in mounts and "memory" in paths and "pids" in paths:
            parents = [mounts["memory"] + paths["memory"], mounts["pids"] + paths["pids"]]
            try:
                return cls._probe(parents, 1), f"cgroup1 ({parents[0]}: memory.limit_in_bytes, pids.max per run)"
            except OSError as exc:
                reasons.append(f"cgroup v1: {exc}")
        else:
            reasons.append("no cgroup v1 memory and pids hierarchies")
        return None, "; ".join(reasons)

    @classmethod
    def _probe(cls, parents: list[str], version: int) -> _Cgroups:
        """These cgroups, once one run's cgroup was created with its limits and removed (OSError if not)."""
        cgroups = cls(parents, version)
        cgroups.create(SandboxConfig()).remove()
        return cgroups

    def create(self, c: SandboxConfig) -> _Cgroup:
        name = f"{self.prefix}{next(_Cgroups._numbers)}"  # itertools.count is atomic under the GIL
        dirs = [os.path.join(parent, name) for parent in self.parents]
        cgroup = _Cgroup([], self.version)
        memory = str(c.memory_mb * 2**20)
        try:
            for d in dirs:
                os.mkdir(d)
                cgroup.dirs.append(d)
            if self.version == 2:
                _write(dirs[0], "memory.max", memory)
                _write(dirs[0], "pids.max", str(c.processes))
                _write(dirs[0], "memory.oom.group", "1")
                if os.path.exists(os.path.join(dirs[0], "memory.swap.max")):
                    _write(dirs[0], "memory.swap.max", "0")
            else:
                _write(dirs[0], "memory.limit_in_bytes", memory)
                if os.path.exists(os.path.join(dirs[0], "memory.memsw.limit_in_bytes")):
                    _write(dirs[0], "memory.memsw.limit_in_bytes", memory)  # no escape into swap
                _write(dirs[1], "pids.max", str(c.processes))
        except OSError:
            cgroup.remove()
            raise
        return cgroup


def _write(directory: str, name: str, value: str) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(value)


def _read(directory: str, name: str) -> str:
    with open(os.path.join(directory, name)) as f:
        return f.read()


def _alive(pid: str) -> bool:
    return pid.isdigit() and os.path.exists(f"/proc/{pid}")


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
