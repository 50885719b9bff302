"""The sandbox against hostile programs, with the real bubblewrap: each is contained and reported as a result,
and the machine (this process, its files, its network, its process table) is unharmed."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from agents.sandbox import SANDBOX_UID_BASE, Sandbox, SandboxConfig, SandboxUnavailable, check_isolation


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


def sandbox_processes() -> list[int]:
    """PIDs of sandboxed programs still on this machine (by their command line, and as root by their user id)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
                uid = os.stat(f"/proc/{entry}").st_uid
            except OSError:
                continue
            if b"-I\0-B\0main.py" in cmdline or uid >= SANDBOX_UID_BASE:
                found.append(int(entry))
    return found


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


def test_fork_bomb_is_contained(sandbox):
    start = time.monotonic()
    r = sandbox.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert r.timed_out or r.exit_code != 0
    assert time.monotonic() - start < sandbox.config.timeout_s + 3
    assert gone(sandbox_processes) == []  # nothing of it survives
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


def test_children_left_sleeping_do_not_survive(sandbox):
    marker = f"sleeper-{uuid.uuid4().hex}"
    r = sandbox.run(
        f"import os, subprocess\nfor _ in range(3):\n"
        f"    subprocess.Popen(['/bin/sh', '-c', 'sleep 300; : {marker}'], start_new_session=True)\n"
        f"if os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sh', ['/bin/sh', '-c', 'sleep 300; : {marker}'])\n"
        "print('left them')"
    )
    assert r.ok and "left them" in r.stdout, r
    assert gone(lambda: processes_with(marker) + sandbox_processes()) == []


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
