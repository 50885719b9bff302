"""Children never outlive the orchestrator: the guard takes its whole group down."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from orchestrate.serving.processes import spawn, stop


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(predicate, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


# A command that starts a grandchild which ignores SIGTERM (like an engine core
# that outlives its server), writes both pids, then sleeps.
TREE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    with open(sys.argv[1], "w") as f:
        f.write(f"{os.getpid()} {grandchild.pid}")
    time.sleep(600)
""")


def read_pids(path):
    assert wait_for(lambda: path.exists() and path.read_text().strip())
    return [int(x) for x in path.read_text().split()]


def test_stop_takes_down_the_whole_tree(tmp_path):
    pids_file = tmp_path / "pids"
    proc = spawn([sys.executable, "-c", TREE, str(pids_file)], tmp_path / "log")
    pids = read_pids(pids_file)
    stop(proc, timeout=1)
    assert wait_for(lambda: not any(alive(p) for p in pids))


def test_children_die_when_the_orchestrator_is_killed(tmp_path):
    pids_file = tmp_path / "pids"
    # a stand-in orchestrator that spawns the tree, then is SIGKILLed
    orchestrator = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        from orchestrate.serving.processes import spawn
        spawn([sys.executable, "-c", {TREE!r}, {str(pids_file)!r}], {str(tmp_path / "log")!r})
        time.sleep(600)
    """),
        ]
    )
    pids = read_pids(pids_file)
    orchestrator.send_signal(signal.SIGKILL)
    orchestrator.wait()
    assert wait_for(lambda: not any(alive(p) for p in pids), timeout=30)


def test_a_dead_command_leaves_nothing_behind(tmp_path):
    pids_file = tmp_path / "pids"
    proc = spawn([sys.executable, "-c", TREE, str(pids_file)], tmp_path / "log")
    command_pid, grandchild = read_pids(pids_file)
    os.kill(command_pid, signal.SIGKILL)  # the server crashes
    assert proc.wait(timeout=20) != 0
    assert wait_for(lambda: not alive(grandchild))


def test_spawn_pins_the_command_and_its_children_to_the_given_cores(tmp_path):
    """--server.cpus / --trainer.cpus end here: the command (and what it starts) may run on those cores only."""
    core = min(os.sched_getaffinity(0))
    pids = tmp_path / "pids"
    proc = spawn([sys.executable, "-c", TREE, str(pids)], tmp_path / "log", cpus=[core])
    try:
        assert wait_for(lambda: pids.exists() and pids.read_text().strip())
        for pid in map(int, pids.read_text().split()):
            assert os.sched_getaffinity(pid) == {core}
    finally:
        stop(proc)


def test_core_lists_parse_and_print_back():
    from orchestrate.serving.processes import format_cpus, parse_cpus

    assert parse_cpus("0-3,6, 8") == [0, 1, 2, 3, 6, 8] and format_cpus([0, 1, 2, 3, 6, 8]) == "0-3,6,8"
    for bad in ("", "a", "3-1", "1-", "-2", "0,,1"):
        try:
            parse_cpus(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")
