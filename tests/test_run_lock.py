"""One orchestrator per run directory; the lock dies with its holder (issue 13, item 3)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from orchestrate.loop.run_lock import RunDirInUse, RunLock, lock_holder

HOLD = """
import subprocess, sys, time
from orchestrate.loop.run_lock import RunLock
lock = RunLock(sys.argv[1]).acquire()
child = subprocess.Popen(["sleep", "300"])  # a child such as a vLLM server must not inherit the lock
print(child.pid, flush=True)
time.sleep(300)
"""


@pytest.fixture
def holder(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    yield run, proc, child
    for pid in (proc.pid, child):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def test_second_holder_is_refused_naming_the_pid(holder):
    run, proc, _ = holder
    assert lock_holder(run) == proc.pid
    with pytest.raises(RunDirInUse, match=f"process {proc.pid}"):
        RunLock(run).acquire()


def test_lock_dies_with_its_holder_even_with_kill_9(holder):
    run, proc, child = holder
    proc.kill()
    proc.wait()
    os.kill(child, 0)  # its child lives on, and does not hold the lock
    lock = RunLock(run).acquire()
    lock.release()
    assert sorted(p.name for p in run.iterdir()) == []  # nothing was written to take the lock


def test_rl_on_a_run_dir_in_use_is_refused(holder, tmp_path, folder_model):
    run, proc, _ = holder
    out = subprocess.run([sys.executable, "-m", "orchestrate.rl", "--run-dir", str(run), "--model.policy",
                          str(folder_model)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert "in use" in line and str(proc.pid) in line, line
    assert list(run.iterdir()) == []


def test_offline_on_an_out_dir_in_use_is_refused(holder, tmp_path, folder_model):
    from tapes.store import write_tapes
    from tests.test_tapes import make_tape

    run, proc, _ = holder
    tapes = []
    for i in range(4):
        tape = make_tape(i)
        tape.metadata.reward = float(i % 2)
        tape.metadata.group_id = "g0"
        tapes.append(tape)
    path = write_tapes(tmp_path / "iter_000001.jsonl", tapes)
    out = subprocess.run([sys.executable, "-m", "orchestrate.after.offline", "--tapes", str(path), "--out", str(run),
                          "--model", str(folder_model), "--no-progress"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert "--out" in line and "in use" in line and str(proc.pid) in line, line


def test_lock_is_taken_while_the_loop_runs(tmp_path, monkeypatch, folder_model):
    """rl.main holds the lock around the loop: a second acquire from this process's view fails meanwhile."""
    from orchestrate import rl
    from orchestrate.loop import iteration as loop

    seen = []

    class FakeLoop:
        def __init__(self, config, run_dir, models=None):
            self.run_dir = run_dir

        def __call__(self):
            # a second process would be refused now
            probe = subprocess.run([sys.executable, "-c", "import sys\nfrom orchestrate.loop.run_lock import RunLock\n"
                                    "try:\n RunLock(sys.argv[1]).acquire()\nexcept Exception as e:\n print(e)",
                                    str(self.run_dir.root)], capture_output=True, text=True, timeout=60)  # fmt: skip
            seen.append(probe.stdout)
            return 0

    monkeypatch.setattr(loop, "Loop", FakeLoop)
    code = rl.main(["--run-dir", str(tmp_path / "run"), "--model.policy", str(folder_model)])
    assert code == 0
    assert "in use by process" in seen[0] and str(os.getpid()) in seen[0]
    RunLock(tmp_path / "run").acquire().release()  # released after
