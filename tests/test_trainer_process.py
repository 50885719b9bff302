"""The orchestrator's handle on the finetune process: a crash stops the run with the log tail
and the command that resumes."""

import pytest

from contract.rundir import RunDir
from finetune.config import TrainConfig
from orchestrate.loop.config import TrainerSection
from orchestrate.loop.trainer import TrainerError, TrainerProcess


def test_crashing_trainer_reports_log_tail_and_resume_command(tmp_path, tiny_model_dir):
    run = RunDir(tmp_path / "run")
    run.create()
    bad = tmp_path / "broken.yaml"
    bad.write_text("this is: [not a valid accelerate config\n")
    trainer = TrainerProcess(
        run, tiny_model_dir, TrainConfig(), TrainerSection(accelerate_config=str(bad), timeout_s=120)
    )
    trainer.start()
    try:
        with pytest.raises(TrainerError) as err:
            trainer.wait_for_checkpoint(1)
    finally:
        trainer.stop()
    message = str(err.value)
    assert "exited with code" in message
    assert "uv run -m orchestrate.rl --run-dir" in message and str(run.root) in message
    # the log tail is in the message: the YAML parser's complaint about this very file
    assert "yaml.parser.ParserError" in message and str(bad) in message, message


def test_trainer_metrics_are_averaged_per_iteration(tmp_path, tiny_model_dir):
    import json

    run = RunDir(tmp_path / "run")
    run.create()
    step = {"epoch": 0, "step_in_batch": 0, "step": 1, "weights_changed": True, "time": 1e9, "lag_mean": 0.5}
    lines = [
        {**step, "batch": 1, "samples": 4, "loss": 1.0, "kl": 0.5, "drift": 1.0, "seconds": 2.0},
        {**step, "batch": 1, "samples": 4, "loss": 3.0, "kl": 0.25, "seconds": 1.0},
        {"batch": 1, "samples": 0, "seconds": 0.0},  # no step (every sample cut or stale): not a step
        {"batch": 2, "samples": 4, "loss": 9.0, "seconds": 5.0},
    ]
    run.train_metrics.write_text("\n".join(json.dumps(x) for x in lines) + "\n{torn")
    m = TrainerProcess(run, tiny_model_dir, TrainConfig()).iteration_metrics(1)
    assert m["train_loss"] == 2.0 and m["train_kl"] == 0.375 and m["train_steps"] == 2 and m["train_seconds"] == 3.0
    # a figure no list names (a new loss's term) is averaged over the steps that report it; which step a
    # record is, and the batch's own figures, are not step figures
    assert m["train_drift"] == 1.0 and m["lag_mean"] == 0.5
    assert set(m) == {"train_steps", "train_seconds", "train_loss", "train_kl", "train_drift", "lag_mean"}


@pytest.mark.parametrize("status, waits", [("stopping", True), ("saving", True), ("training", False)])
def test_a_stop_waits_for_a_trainer_writing_its_full_state(tmp_path, status, waits):
    """Asked to stop, a trainer between batches writes its last full state (about 15 GB at 1B): it gets the
    time to, past the stop's first wait; one mid-batch is stopped then (it resumes)."""
    import subprocess
    import sys
    import time

    from contract.durable import atomic_write_json

    run = RunDir(tmp_path / "run")
    run.create()
    trainer = TrainerProcess(run, tmp_path, TrainConfig())
    atomic_write_json(run.learner_status, {"status": status})
    trainer.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])  # its last write
    start = time.monotonic()
    trainer.stop(timeout=0.3)
    took = time.monotonic() - start
    assert run.trainer_stop.exists()
    assert (trainer.process.returncode == 0 and took >= 1.4) if waits else took < 1.4
