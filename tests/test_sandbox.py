"""The sandbox against hostile programs, with the real bubblewrap: each is contained and reported as a result,
and the machine (this process, its files, its network, its process table) is unharmed."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from agents.sandbox import Sandbox, SandboxConfig, SandboxUnavailable, check_isolation


@pytest.fixture(scope="module")
def sandbox():
    if shutil.which("bwrap") is None:
        pytest.fail("bwrap is missing: install bubblewrap (`apt-get install bubblewrap`; .ci/run does)")
    return Sandbox(SandboxConfig(timeout_s=5, cpu_s=5, memory_mb=512, processes=32, output_bytes=4096))


def processes_with(marker: str) -> list[int]:
    """PIDs on this machine whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker in open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace"):
                    found.append(int(entry))
            except OSError:
                continue
    return found


def sandbox_processes(uids: set[int]) -> list[int]:
    """PIDs of sandboxed programs still on this machine: as root, those of the user ids in `uids` (this test's
    runs: another process may run sandboxes meanwhile, a run of the python_tool preset, another test session);
    otherwise any, by their command line."""
    found = []
    root = os.geteuid() == 0
    assert uids or not root, "no run of this test took a user id: nothing would be looked for"
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
                uid = os.stat(f"/proc/{entry}").st_uid
            except OSError:
                continue
            if (uid in uids) if root else (b"-I\0-B\0main.py" in cmdline):
                found.append(int(entry))
    return found


@pytest.fixture
def taken_uids(monkeypatch) -> set[int]:
    """The user ids the sandbox hands this test's runs (as root each run has its own)."""
    import agents.sandbox

    taken: set[int] = set()
    take = agents.sandbox._take_uid

    def record() -> int:
        taken.add(uid := take())
        return uid

    monkeypatch.setattr(agents.sandbox, "_take_uid", record)
    return taken


def gone(find, timeout: float = 5.0) -> list[int]:
    """Poll `find()` until it finds nothing or `timeout` passes (a killed namespace takes a moment to empty)."""
    deadline = time.monotonic() + timeout
    while (found := find()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def test_a_plain_program_runs_with_nothing_of_the_host(sandbox):
    r = sandbox.run(
        "import os, sys\nprint(6 * 7)\nprint(sorted(os.listdir('/')))\nprint(sorted(os.environ))\nprint(input())",
        stdin="from stdin",
    )
    assert r.ok and r.infra_error is None, r
    lines = r.stdout.splitlines()
    assert lines[0] == "42"
    assert lines[1] == str(["bin", "dev", "lib", "lib64", "proc", "sbin", "tmp", "usr"])  # no /etc, /home, /root, /work
    assert lines[2] == str(["HOME", "LANG", "PATH", "PWD", "PYTHONIOENCODING"])  # no inherited secrets
    assert lines[3] == "from stdin"
    assert r.observation() == r.stdout


def test_errors_are_observations(sandbox):
    r = sandbox.run("1 / 0")
    assert r.exit_code == 1 and "ZeroDivisionError" in r.stderr and "[exit code 1]" in r.observation()
    r = sandbox.run("import sys; sys.stderr.write('bwrap: pretending'); sys.exit(1)")
    assert r.infra_error is None and r.exit_code == 1  # what the program prints cannot pass for a sandbox failure


def test_infinite_loop_is_stopped_at_the_timeout(sandbox):
    start = time.monotonic()
    r = sandbox.run("while True: pass")
    assert time.monotonic() - start < sandbox.config.timeout_s + 3
    assert r.timed_out or r.exit_code == -9 or r.exit_code == -24  # wall clock or CPU limit, whichever first
    assert "[timed out" in r.observation() or "[killed by" in r.observation()


def test_fork_bomb_is_contained(sandbox, taken_uids):
    start = time.monotonic()
    r = sandbox.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert r.timed_out or r.exit_code != 0
    assert time.monotonic() - start < sandbox.config.timeout_s + 3
    assert gone(lambda: sandbox_processes(taken_uids)) == []  # nothing of it survives
    pid = os.fork()  # this machine can still start processes
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def test_huge_allocation_fails_inside(sandbox):
    r = sandbox.run("x = bytearray(10 * 1024**3)\nprint('allocated')")
    assert r.exit_code != 0 and "allocated" not in r.stdout and "MemoryError" in r.stderr


def test_writes_outside_its_tmp_fail_and_leave_nothing(sandbox, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    name = f"sandbox-{uuid.uuid4().hex}"
    home = Path.home()
    code = (
        f"import os\nfor path in ['/etc/{name}', '{home}/{name}', '{run_dir}/{name}', '/usr/{name}', '/{name}']:\n"
        "    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
        "    except OSError as exc:\n        print('refused', path, type(exc).__name__)\n"
        "open('/tmp/ok', 'w').write('fine'); print('tmp ok')"
    )
    r = sandbox.run(code)
    assert "WROTE" not in r.stdout and r.stdout.count("refused") == 5 and "tmp ok" in r.stdout, r
    for folder in (Path("/etc"), home, run_dir, Path("/usr"), Path("/")):
        assert not (folder / name).exists()


def test_the_run_directory_and_the_cache_are_not_visible(sandbox, tmp_path):
    secret = tmp_path / "run" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("API_KEY=hunter2")
    cache = Path.home() / ".cache"
    r = sandbox.run(
        f"import os\nfor p in ['{secret}', '{cache}', '{Path.home()}']:\n"
        "    print(p, os.path.exists(p))\n"
        f"try:\n    print(open('{secret}').read())\nexcept OSError as exc:\n    print(type(exc).__name__)"
    )
    assert "hunter2" not in r.stdout and r.stdout.count(" False") == 3 and "FileNotFoundError" in r.stdout, r


def test_no_network_not_even_the_hosts_loopback(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(3)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    r = sandbox.run(
        f"import socket\ns = socket.socket()\ns.settimeout(2)\ntry:\n    s.connect(('127.0.0.1', {port}))\n"
        "    print('CONNECTED')\nexcept OSError as exc:\n    print('refused', type(exc).__name__)"
    )
    thread.join()
    server.close()
    assert "CONNECTED" not in r.stdout and "refused" in r.stdout and accepted == []


def test_100_mb_of_output_is_capped(sandbox):
    start = time.monotonic()
    r = sandbox.run("import sys\nchunk = 'x' * 1024 * 1024\nfor _ in range(100):\n    sys.stdout.write(chunk)")
    assert r.output_truncated and len(r.stdout) == sandbox.config.output_bytes
    assert "[output cut" in r.observation() and len(r.observation()) < 2200
    assert time.monotonic() - start < sandbox.config.timeout_s + 3


def test_children_left_sleeping_do_not_survive(sandbox, taken_uids):
    marker = f"sleeper-{uuid.uuid4().hex}"
    r = sandbox.run(
        f"import os, subprocess\nfor _ in range(3):\n"
        f"    subprocess.Popen(['/bin/sh', '-c', 'sleep 300; : {marker}'], start_new_session=True)\n"
        f"if os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sh', ['/bin/sh', '-c', 'sleep 300; : {marker}'])\n"
        "print('left them')"
    )
    assert r.ok and "left them" in r.stdout, r
    assert gone(lambda: processes_with(marker) + sandbox_processes(taken_uids)) == []


def test_a_signal_to_the_parents_pid_does_not_reach_it(sandbox):
    r = sandbox.run(
        f"import os, signal\ntry:\n    os.kill({os.getpid()}, signal.SIGKILL)\n    print('sent')\n"
        "except OSError as exc:\n    print(type(exc).__name__)\nos.kill(os.getppid(), signal.SIGKILL)"
    )
    assert "ProcessLookupError" in r.stdout  # its PID namespace holds no such process
    assert r.infra_error is None


def test_concurrent_programs_each_get_a_slot(sandbox):
    sandbox = Sandbox(SandboxConfig(timeout_s=10), slots=4)
    results = [None] * 8
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, sandbox.run(f"print({i} * 2)"))) for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout.strip() for r in results] == [str(i * 2) for i in range(8)]


def test_without_bwrap_it_refuses_unless_the_weaker_mode_is_chosen(monkeypatch):
    import sys

    outside = os.path.realpath(sys.executable)  # this interpreter, not under /usr
    if not outside.startswith("/usr/"):
        with pytest.raises(SandboxUnavailable, match="only /usr is visible"):
            check_isolation(SandboxConfig(python=outside))
    with pytest.raises(SandboxUnavailable, match="not an executable"):
        check_isolation(SandboxConfig(python="/usr/bin/no-such-python"))

    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "bwrap" else "/usr/bin/" + name)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap.*unsafe_subprocess"):
        Sandbox(SandboxConfig())
    weak = Sandbox(SandboxConfig(isolation="unsafe_subprocess", timeout_s=5))
    r = weak.run("import os\nprint(6 * 7, sorted(os.environ))")
    assert r.ok and r.stdout.split()[0] == "42" and "HOME" in r.stdout


def test_many_quick_runs_in_a_row_all_start(sandbox):
    """The kernel frees a finished run's process count late: reusing one user id at once made bwrap fail
    ("Can't fork for pid 1") after ~30 quick runs. Each run now has an id of its own."""
    results = [sandbox.run("print(1)") for _ in range(80)]
    failed = [r.stderr.strip() for r in results if not (r.ok and r.stdout == "1\n")]
    assert not failed, f"{len(failed)} of 80 runs failed: {failed[0]}"


# ---- outliving the sandbox: ptrace and relatives are refused; the timeout and the caller's death end all of it

HOSTILE_PREFIX = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.ptrace(16, 1, None, None)  # PTRACE_ATTACH to the sandbox's init, to clear its parent-death signal
libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0 for itself
"""


def double_fork_sleeper(marker: str) -> str:
    """Code that leaves a grandchild in a session of its own, sleeping with `marker` on its command line."""
    return (
        f"if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execv('/bin/sh', ['/bin/sh', '-c', 'sleep 300; : {marker}'])\n    os._exit(0)\n"
    )


def test_ptrace_and_its_relatives_fail_with_eperm(sandbox):
    code = """import ctypes, errno, os, threading, subprocess
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(name, *args):
    ctypes.set_errno(0)
    result = libc.syscall(*args)
    print(name, result, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))
call('ptrace_attach', 101, 16, 1, 0, 0)           # PTRACE_ATTACH, PID 1 (bwrap's init)
call('ptrace_seize', 101, 0x4206, 1, 0, 0)        # PTRACE_SEIZE
call('ptrace_traceme', 101, 0, 0, 0, 0)
call('process_vm_readv', 310, 1, 0, 0, 0, 0, 0)
call('process_vm_writev', 311, 1, 0, 0, 0, 0, 0)
call('personality', 135, 0x0040000)               # ADDR_NO_RANDOMIZE
call('keyctl', 250, 0, 0, 0, 0, 0)
call('bpf', 321, 0, 0, 0)
call('userfaultfd', 323, 0)
call('perf_event_open', 298, 0, 0, -1, -1, 0)
call('mount', 165, 0, 0, 0, 0, 0)
call('unshare', 272, 0x00020000)                  # CLONE_NEWNS
call('setns', 308, 0, 0)
call('clone_newuser', 56, 0x10000000 | 17, 0, 0, 0, 0)  # clone(CLONE_NEWUSER | SIGCHLD)
t = threading.Thread(target=lambda: print('thread ok')); t.start(); t.join()   # clone3 falls back to clone
print(subprocess.run(['/bin/echo', 'child ok'], capture_output=True, text=True).stdout.strip())
"""
    r = sandbox.run(code)
    assert r.ok, r
    lines = r.stdout.splitlines()
    calls = [line.split() for line in lines if line.split()[0] not in ("thread", "child")]
    assert len(calls) == 14 and all(result == "-1" and err == "EPERM" for _, result, err in calls), r.stdout
    assert "thread ok" in lines and "child ok" in lines


def test_the_timeout_ends_every_process_of_the_sandbox():
    sandbox = Sandbox(SandboxConfig(timeout_s=2, cpu_s=30))
    marker = f"outlive-{uuid.uuid4().hex}"
    r = sandbox.run(HOSTILE_PREFIX + double_fork_sleeper(marker) + "while True:\n    pass\n")
    assert r.timed_out, r
    assert gone(lambda: processes_with(marker), timeout=1.0) == []  # within a second of the timeout


def test_killing_the_caller_ends_every_process_of_the_sandbox(tmp_path):
    import signal
    import subprocess
    import sys

    marker = f"orphan-{uuid.uuid4().hex}"
    script = tmp_path / "caller.py"
    script.write_text(
        "from agents.sandbox import Sandbox, SandboxConfig\n"
        f"Sandbox(SandboxConfig(timeout_s=120, cpu_s=120)).run({HOSTILE_PREFIX + double_fork_sleeper(marker) + 'import time; time.sleep(300)'!r})\n"
    )
    caller = subprocess.Popen(
        [sys.executable, str(script)], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    )
    try:
        deadline = time.monotonic() + 30
        while not processes_with(marker) and time.monotonic() < deadline and caller.poll() is None:
            time.sleep(0.05)  # waiting for the sleeper to exist, not for time to pass
        assert processes_with(marker), "the sandboxed program never started its sleeper"
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    assert gone(lambda: processes_with(marker), timeout=1.0) == []  # within a second of the caller's death
    cgroups = Sandbox(SandboxConfig()).cgroups
    for parent in cgroups.parents if cgroups else []:  # the caller could not remove its run's cgroup: empty, so
        for name in os.listdir(parent):  # removable (a later Sandbox removes such after a minute)
            if name.startswith(f"tapeloop-sandbox-{caller.pid}-"):  # its last processes may still be exiting
                path = os.path.join(parent, name)
                assert gone(lambda path=path: _busy_rmdir(path)) == [], f"{path} stays busy"


def _busy_rmdir(path: str) -> list[str]:
    """Remove an empty cgroup: [] once removed, [path] while processes are still leaving it (EBUSY)."""
    try:
        os.rmdir(path)
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        return [path]
    return []


# ---- every writable place is bounded


def test_every_writable_mount_is_read_only_or_sized_within_the_temp_cap(sandbox):
    code = (
        "import os, stat\nfor line in open('/proc/self/mountinfo'):\n"
        "    left, right = line.split(' - ')\n    point, options = left.split()[4], left.split()[5]\n"
        "    fstype, _, super_options = right.split()\n"
        "    if 'rw' not in options.split(','):\n        continue\n"
        "    if fstype == 'proc' or stat.S_ISCHR(os.stat(point).st_mode):\n        continue  # no storage\n"
        "    size = [o for o in super_options.split(',') if o.startswith('size=')]\n"
        "    print('WRITABLE', point, fstype, size[0] if size else 'no-size')\n"
    )
    r = sandbox.run(code)
    assert r.ok, r
    writable = [line.split() for line in r.stdout.splitlines()]
    assert writable == [["WRITABLE", "/tmp", "tmpfs", f"size={sandbox.config.tmp_mb * 1024}k"]], r.stdout


def test_writing_past_the_temp_cap_fails_in_dev_shm_and_dev():
    sandbox = Sandbox(SandboxConfig(tmp_mb=8, file_size_mb=64, timeout_s=10))
    code = (
        "import os\nchunk = b'x' * 2**20\n"
        "for path in ['/dev/a', '/dev/shm/a', '/tmp/a', '/dev/shm/b', '/tmp/c']:\n"
        "    written = 0\n    try:\n        with open(path, 'wb') as f:\n"
        "            for _ in range(16):\n                f.write(chunk); f.flush(); written += 1\n"
        "    except OSError as exc:\n        pass\n    print(path, written)\n"
        "    if path.endswith('a'):\n        try:\n            os.unlink(path)\n        except OSError:\n            pass\n"
    )
    r = sandbox.run(code)
    written = {line.split()[0]: int(line.split()[1]) for line in r.stdout.splitlines()}
    assert written["/dev/a"] == 0, r  # /dev is read-only
    for path in ("/dev/shm/a", "/tmp/a"):
        assert written[path] < 8, r  # 16 MiB asked, the cap is 8 MiB
    assert written["/dev/shm/b"] + written["/tmp/c"] < 8, r  # /dev/shm and /tmp share one cap


# ---- memory and processes per run, not per process

ALLOCATORS = """import subprocess, sys
n = int(0.4 * {memory_mb} * 2**20)
kids = [subprocess.Popen([sys.executable, '-c', f'x = b"\\\\1" * {{n}}; print("held", flush=True); input()'],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(3)]
said = [k.stdout.readline().strip() for k in kids]  # each holds its 40 % until told to stop
# one that said "held" may be the out-of-memory victim of a later one: held means still alive now
alive = []
for k in kids:
    try:
        k.wait(timeout=1.0)  # a killed one is reaped at once; a live one waits for its input
        alive.append(False)
    except subprocess.TimeoutExpired:
        alive.append(True)
held = [s for s, a in zip(said, alive) if s == "held" and a]
for k in kids:
    try:
        k.stdin.close()
    except OSError:
        pass
print(len(held), [k.wait() for k in kids])
"""


def test_three_processes_of_40_percent_each_exceed_the_runs_memory(sandbox):
    print("sandbox memory mode:", sandbox.memory_mode)
    if sandbox.cgroups is None:
        pytest.skip(f"no cgroup can be created here, so memory is bounded per process only: {sandbox.memory_mode}")
    r = sandbox.run(ALLOCATORS.format(memory_mb=sandbox.config.memory_mb))
    held = int(r.stdout.split()[0]) if r.stdout else 0
    assert held < 3, (sandbox.memory_mode, r)  # 120 % of the cap never held at once


def test_the_fallback_bounds_each_process(monkeypatch):
    from agents import sandbox as module

    monkeypatch.setattr(module._Cgroups, "find", classmethod(lambda cls: (None, "forced by the test")))
    fallback = Sandbox(SandboxConfig(memory_mb=256, processes=8, timeout_s=10))
    assert fallback.cgroups is None and fallback.memory_mode.startswith("rlimit")
    r = fallback.run(ALLOCATORS.format(memory_mb=256))
    assert r.stdout.split()[0] == "3", r  # the stated bound: per process, so three of 40 % are all held
    r = fallback.run("x = b'1' * (300 * 2**20)\nprint('allocated')")
    assert "allocated" not in r.stdout and "MemoryError" in r.stderr, r  # one process past memory_mb fails
    r = fallback.run(
        "import os\nn = 0\ntry:\n    for _ in range(20):\n        if os.fork() == 0:\n"
        "            import time; time.sleep(5); os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)"
    )
    assert int(r.stdout.split()[-1]) < 8, r  # RLIMIT_NPROC: at most `processes` at once
