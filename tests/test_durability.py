"""Nothing torn, nothing duplicated, renames made durable (issue 13, item 4)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from orchestrate.loop.metrics import append_metrics, read_metrics, repair_metrics

TORN_WRITE = r"""
import json, os, resource, signal, sys
from orchestrate.loop.metrics import append_metrics
path = sys.argv[1]
append_metrics(path, {"iteration": 1, "reward_mean": 0.5})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG instead of killing us
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 20, hard))  # "disk full" 20 bytes on
try:
    append_metrics(path, {"iteration": 2, "padding": "x" * 200})
    print("no error")
except OSError as exc:
    print("failed:", exc.errno)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space again
append_metrics(path, {"iteration": 3, "reward_mean": 1.0})
"""


def test_a_failed_write_leaves_no_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    out = subprocess.run([sys.executable, "-c", TORN_WRITE, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("failed"), out.stdout
    lines = path.read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 3], lines  # every line whole, none glued


def test_a_torn_tail_is_cut_before_the_next_append(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1}\n{"iteration": 2, "rew')  # kill -9 in the middle of a write
    append_metrics(path, {"iteration": 2, "reward": 1})
    assert path.read_text().splitlines() == ['{"iteration": 1}', '{"iteration": 2, "reward": 1}']


def test_resume_repairs_torn_tail_and_uncounted_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 0, "eval_success_rate": 0.3}\n{"iteration": 1}\n{"iteration": 2}\n'
                    '{"iteration": 3}\n{"iteration": 4, "tor')  # fmt: skip
    # state.json says iteration 2 is the last complete one: 3 was appended before a crash
    assert repair_metrics(path, 2, [0]) == 2
    assert [r["iteration"] for r in read_metrics(path)] == [0, 1, 2]
    assert path.read_text().endswith("}\n")
    # the eval before training was appended, but the crash came before state.json counted it
    assert repair_metrics(path, 2, []) == 1
    assert [r["iteration"] for r in read_metrics(path)] == [1, 2]


def test_rl_resume_writes_each_iteration_once(tmp_path, monkeypatch, folder_model):
    """A crash between the metrics append and state.json: the resumed run does not duplicate the record."""
    from contract.rundir import RunDir, RunState
    from orchestrate import rl
    from orchestrate.loop import iteration as loop

    seen = []

    class FakeLoop:
        def __init__(self, config, run_dir, models=None):
            self.run = run_dir

        def __call__(self):
            seen.append(read_metrics(self.run.metrics_path))
            state = self.run.load_state()
            for i in range(state.completed_iteration + 1, 4):
                append_metrics(self.run.metrics_path, {"iteration": i})
                self.run.save_state(RunState(completed_iteration=i))
            return 0

    monkeypatch.setattr(loop, "Loop", FakeLoop)
    argv = ["--run-dir", str(tmp_path / "run"), "--model.policy", str(folder_model), "--iterations", "3",
            "--eval.every", "0"]  # fmt: skip
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    assert rl.main(argv) == 0
    # as if killed after iteration 3's metrics line but before its state.json, mid-way through a 4th line
    run.save_state(RunState(completed_iteration=2))
    with open(run.metrics_path, "a") as f:
        f.write('{"iteration": 4, "tor')
    assert rl.main(argv) == 0
    assert [r["iteration"] for r in seen[1]] == [1, 2]  # repaired before the loop resumed
    assert [json.loads(line)["iteration"] for line in run.metrics_path.read_text().splitlines()] == [1, 2, 3]


@pytest.fixture
def synced(monkeypatch):
    """Record the paths fsync is called on (directories included)."""
    calls = []
    real = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        calls.append((path, stat.S_ISDIR(os.fstat(fd).st_mode)))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_directory_synced_after_every_rename(tmp_path, synced):
    from contract.batch import write_batch
    from contract.durable import atomic_write_text
    from contract.rundir import RunDir, RunState
    from contract.rundir import RunDir as TrainerRunDir
    from orchestrate.loop.samples import save_tapes
    from tests.test_tapes import make_tape

    run = RunDir(tmp_path / "run")
    run.create()
    for write in (
        lambda: atomic_write_text(run.root / "x.json", "{}"),
        lambda: run.save_state(RunState(completed_iteration=1)),
        lambda: run.save_config({"a": 1}),
        lambda: run.write_phase(1, "training"),
        lambda: write_batch(
            run.batch(1),
            [{"prompt_ids": [1], "completion_ids": [2], "behaviour_logprobs": [0.0], "reward": 1.0, "group_id": "g"}],
        ),
        lambda: TrainerRunDir(run.root).write_state(status="waiting"),
        lambda: TrainerRunDir(run.root).write_advantages(1, []),
    ):
        synced.clear()
        write()
        assert synced and synced[-1][1], synced  # the last fsync is of a directory, after the rename
    synced.clear()
    save_tapes(run.iteration_tapes(1), [make_tape()])
    assert synced[-1] == (str(run.tapes), True), synced
    synced.clear()
    append_metrics(run.metrics_path, {"iteration": 1})  # a new file: its directory entry too
    assert (str(run.root), True) in synced


def test_train_config_is_written_atomically(tmp_path, monkeypatch):
    from contract.rundir import RunDir
    from finetune.config import TrainConfig
    from orchestrate.loop import trainer as trainer_module

    run = RunDir(tmp_path / "run")
    run.create()
    path = run.root / "train_config.json"
    path.write_text("old")
    before = os.stat(path).st_ino
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: renames.append(str(b)) or real_replace(a, b))
    monkeypatch.setattr(trainer_module, "spawn", lambda *a, **k: None)
    trainer_module.TrainerProcess(run, tmp_path, TrainConfig(lr=3e-5)).start()
    assert str(path) in renames  # written under a temp name and renamed into place
    assert os.stat(path).st_ino != before and json.loads(path.read_text())["lr"] == 3e-5


def test_a_resumed_learner_keeps_the_step_records_of_its_published_batches_once(tmp_path):
    """Records are appended before the checkpoint is published; a learner resumed from batch 1 drops the
    records of the batches after it (trained again, or killed between records and checkpoint) and a torn
    tail, so each published batch keeps its records once."""
    from contract.durable import read_jsonl
    from contract.rundir import RunDir

    run = RunDir(tmp_path)
    for batch in (1, 1, 2, 2, 3):
        run.append_metrics({"batch": batch, "loss": 0.1 * batch})
    with open(run.train_metrics, "a") as f:
        f.write('{"batch": 3, "lo')  # killed here
    assert run.drop_metrics_after(1) == 3
    assert [json.loads(line)["batch"] for line in run.train_metrics.read_text().splitlines()] == [1, 1]
    before = os.stat(run.train_metrics).st_ino
    assert run.drop_metrics_after(1) == 0 and os.stat(run.train_metrics).st_ino == before  # nothing to drop
    run.append_metrics({"batch": 2, "loss": 0.25})
    assert [r["batch"] for r in read_jsonl(run.train_metrics)] == [1, 1, 2]
    assert run.drop_metrics_after(0) == 3 and run.train_metrics.read_text() == ""
    assert RunDir(tmp_path / "new").drop_metrics_after(0) == 0  # no file yet: nothing written
    assert not (tmp_path / "new" / "train_metrics.jsonl").exists()


def test_a_full_state_killed_before_its_rename_leaves_the_previous_one_to_resume_from(tmp_path):
    """The full state is written after its checkpoint is published, aside (N/.tmp-state) and renamed in:
    killed before the rename, the newest resumable checkpoint is the previous one, and the next start
    removes the half-written folder (and a half-built checkpoint)."""
    from contract.durable import atomic_write_json
    from contract.rundir import LEARNER_RECORD, STATE_ASIDE, TRAINER_PROGRESS, TRAINER_STATE_DIR, RunDir

    run = RunDir(tmp_path)
    for index in (2, 3):
        folder = run.checkpoint(index)
        folder.mkdir(parents=True)
        atomic_write_json(folder / LEARNER_RECORD, {"batch": index})
    (run.checkpoint(2) / TRAINER_STATE_DIR).mkdir()
    atomic_write_json(run.checkpoint(2) / TRAINER_STATE_DIR / TRAINER_PROGRESS, {"batch": 2})
    half = run.checkpoint(3) / STATE_ASIDE / TRAINER_STATE_DIR
    half.mkdir(parents=True)
    (half / "optimizer.bin").write_bytes(b"half")  # killed here: no progress.json, not renamed
    (run.checkpoints / ".tmp-000004").mkdir()
    assert run.published() == [2, 3] and run.latest_checkpoint() == (2, run.checkpoint(2))
    run.clean_temp()
    assert not (run.checkpoint(3) / STATE_ASIDE).exists() and not (run.checkpoints / ".tmp-000004").exists()
    assert run.drop_checkpoints_after(2) == [3] and run.published() == [2]


def test_a_checkpoint_whose_full_state_is_being_written_is_not_pruned(tmp_path):
    """With the state written in the background (--train.async_state), checkpoints go on being published
    while checkpoint 2's state is written into 2/.tmp-state: the orchestrator keeps 2 (and the newest full
    state, 1, until 2's lands) however many newer ones it prunes."""
    from contract.durable import atomic_write_json
    from contract.rundir import LEARNER_RECORD, STATE_ASIDE, TRAINER_PROGRESS, TRAINER_STATE_DIR, RunDir

    run = RunDir(tmp_path)
    for index in (1, 2, 3, 4, 5):
        run.checkpoint(index).mkdir(parents=True)
        atomic_write_json(run.checkpoint(index) / LEARNER_RECORD, {"batch": index})
    atomic_write_json(run.checkpoint(1) / TRAINER_STATE_DIR / TRAINER_PROGRESS, {"batch": 1})
    (run.checkpoint(2) / STATE_ASIDE / TRAINER_STATE_DIR).mkdir(parents=True)
    run.prune_checkpoints(2)
    assert run.published() == [1, 2, 4, 5]
    os.rename(run.checkpoint(2) / STATE_ASIDE / TRAINER_STATE_DIR, run.checkpoint(2) / TRAINER_STATE_DIR)
    (run.checkpoint(2) / STATE_ASIDE).rmdir()
    atomic_write_json(run.checkpoint(2) / TRAINER_STATE_DIR / TRAINER_PROGRESS, {"batch": 2})
    run.drop_old_trainer_states(keep=2)
    run.prune_checkpoints(2)
    assert run.published() == [2, 4, 5]


def test_the_trainers_step_metrics_survive_a_torn_tail(tmp_path):
    """train_metrics.jsonl torn by a kill mid-write: the reader skips the half line, a resumed trainer's next
    record starts on a line of its own (the same append as metrics.jsonl: contract.durable.append_line)."""
    from contract.rundir import RunDir
    from contract.rundir import RunDir as TrainerRunDir
    from finetune.config import TrainConfig
    from orchestrate.loop.trainer import TrainerProcess

    run = TrainerRunDir(tmp_path)
    run.append_metrics({"batch": 1, "loss": 0.5, "seconds": 1.0})
    with open(run.train_metrics, "a") as f:
        f.write('{"batch": 2, "loss": 0.2, "sec')  # killed here
    trainer = TrainerProcess(RunDir(tmp_path), tmp_path, TrainConfig())
    assert trainer.iteration_metrics(1)["train_loss"] == 0.5 and trainer.iteration_metrics(2) == {}
    run.append_metrics({"batch": 2, "loss": 0.25, "seconds": 2.0})  # the resumed trainer redoes batch 2
    lines = run.train_metrics.read_text().splitlines()
    assert [json.loads(line)["batch"] for line in lines] == [1, 2]
    assert trainer.iteration_metrics(2)["train_loss"] == 0.25
