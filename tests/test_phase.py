"""phase.json (what the loop is doing now) and the kill test hook bench/bench_kill.py uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_phase_file_is_one_whole_record_replaced_at_each_phase(tmp_path):
    from contract.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.create()
    assert run.read_phase() is None
    run.write_phase(3, "rollouts")
    first = run.read_phase()
    run.write_phase(3, "training")
    record = json.loads(run.phase_path.read_text())  # plain JSON, for scripts watching a run
    assert record["iteration"] == 3 and record["phase"] == "training" and record["pid"] == os.getpid()
    assert record["since"] >= first["since"]
    assert first["phase"] == "rollouts"
    assert [p.name for p in run.root.iterdir() if "phase" in p.name] == ["phase.json"]  # no temp file left


def run_hook(env_value: str | None, code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TAPELOOP_KILL_AT"}
    if env_value is not None:
        env["TAPELOOP_KILL_AT"] = env_value
    env["PYTHONPATH"] = str(ROOT)
    script = "import time\nfrom orchestrate.loop.phase import kill_hook\n" + code + "\nprint('alive', flush=True)\n"
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)


def test_kill_hook_kills_the_process_on_entering_its_phase():
    done = run_hook("samples", "kill_hook('rollouts'); print('past rollouts', flush=True); kill_hook('samples')")
    assert done.returncode == -9, done.stderr
    assert done.stdout == "past rollouts\n"  # killed at the entry of samples, not before


def test_kill_hook_with_a_delay_kills_while_still_in_the_phase():
    done = run_hook("training:0.2", "kill_hook('training', still_in=lambda: True); time.sleep(60)")
    assert done.returncode == -9, done.stderr
    assert done.stdout == ""


def test_kill_hook_with_a_delay_spares_a_process_that_left_the_phase():
    done = run_hook("training:0.1", "kill_hook('training', still_in=lambda: False); time.sleep(1)")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "alive\n"


def test_kill_hook_does_nothing_when_unset(monkeypatch):
    from orchestrate.loop.phase import kill_hook

    monkeypatch.delenv("TAPELOOP_KILL_AT", raising=False)
    for phase in ("rollouts", "samples", "metrics_state"):
        kill_hook(phase)  # still here
    done = run_hook(None, "kill_hook('samples')")
    assert done.returncode == 0 and done.stdout == "alive\n"
