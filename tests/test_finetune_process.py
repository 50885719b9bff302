"""The learner as its own process, started through `accelerate launch` (CPU, tiny model)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from contract.batch import Sample, batch_file, read_batch, write_batch
from finetune.config import TrainConfig
from finetune.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
ACCELERATE_CPU = ROOT / "finetune" / "accelerate" / "cpu.yaml"
OPTIONS = ["--lr", "1e-3", "--epochs", "2", "--token-budget", "64", "--grpo.clip-eps-high", "0.28"]
CONFIG = TrainConfig(lr=1e-3, epochs=2, token_budget=64, grpo={"clip_eps_high": 0.28})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def batches(tiny, tmp_path_factory):
    """Two batch files, behaviour log-probs from the initial model."""
    from finetune.learner import Learner

    learner = Learner(tiny, CONFIG)
    folder = tmp_path_factory.mktemp("batches")
    g = torch.Generator().manual_seed(0)
    paths = []
    for index in (1, 2):
        samples = []
        for group in range(3):
            prompt = torch.randint(0, 256, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            for k in range(4):
                n = int(torch.randint(1, 10, (1,), generator=g))
                completion = torch.randint(0, 256, (n,), generator=g).tolist()
                samples.append(
                    Sample(
                        prompt_ids=prompt,
                        completion_ids=completion,
                        behaviour_logprobs=[0.0] * n,
                        reward=float(k == group % 4),
                        group_id=f"{index}-{group}",
                        temperature=0.7,
                    )
                )
        samples = [
            s.model_copy(update={"behaviour_logprobs": lp.tolist()})
            for s, lp in zip(samples, learner.logprobs(samples))
        ]
        paths.append(write_batch(folder / f"{index:06d}.jsonl", samples))
    return paths


def launch(model: Path, run: Path, *extra: str, options: list[str] = OPTIONS) -> subprocess.Popen:
    run.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ACCELERATE_CPU),
        "-m",
        "finetune.train",
        "--model",
        str(model),
        "--run-dir",
        str(run),
        "--poll-seconds",
        "0.2",
        *options,
        *extra,
    ]
    out = open(run / "process.out", "ab")
    # Own process group, so the test can kill the launcher and the learner together.
    return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(path: Path, proc: subprocess.Popen, run: Path, timeout: float = 240, text: str | None = None) -> None:
    """Until `path` exists (and holds `text`, when given)."""
    deadline = time.monotonic() + timeout
    while not path.exists() or (text is not None and text not in path.read_text()):
        if proc.poll() is not None:
            pytest.fail(
                f"learner exited ({proc.returncode}) before {path.name}:\n{(run / 'process.out').read_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no {path} after {timeout} s:\n{(run / 'process.out').read_text()[-3000:]}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen, run: Path) -> None:
    (run / "trainer.stop").touch()
    try:
        assert proc.wait(timeout=60) == 0, (run / "process.out").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert json.loads((run / "learner_status.json").read_text())["status"] == "stopped"


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train_metrics.jsonl").read_text().splitlines()]


def test_help_lists_every_option():
    out = subprocess.run(
        [sys.executable, "-m", "finetune.train", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    from finetune.losses import LOSSES

    for name, _field in TrainConfig.model_fields.items():
        if name in LOSSES:  # a loss's own options: --LOSS.OPTION
            for option in LOSSES[name].config.model_fields:
                assert f"--{name}.{option.replace('_', '-')}" in out, (name, option)
            continue
        option = "--" + name.replace("_", "-")
        assert option in out, option
    for option in ("--model", "--run-dir", "--config", "--parent-pid", "--once", "--max-batches"):
        assert option in out
    assert "Dr. GRPO" in " ".join(out.split())  # descriptions, not just names


@pytest.mark.parametrize(
    "args, option",
    [
        (["--grpo.clip-eps-low", "1.5"], "--grpo.clip-eps-low"),
        (["--algorithm", "ppx"], "--algorithm"),
        (["--ppo.critic", "both"], "--ppo.critic"),
        (["--ppo.vf-coef", "0.3"], "ppo"),  # an option of an algorithm not chosen
        (["--lr", "fast"], "--lr"),
        (["--lr-schedule", "cosine"], "total_steps"),
        (["--aggregation", "mean"], "--aggregation"),
    ],
)
def test_bad_value_is_refused_in_one_line(tmp_path, args, option):
    proc = subprocess.run(
        [sys.executable, "-m", "finetune.train", "--model", str(tmp_path), "--run-dir", str(tmp_path / "run"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert option in last and last.startswith("error: ")
    assert not (tmp_path / "run").exists()  # refused before doing anything


@pytest.mark.slow
def test_two_batches_two_checkpoints_then_kill_and_resume(tiny, batches, tmp_path):
    from finetune.learner import Learner

    # The same training in this process, as the reference.
    learner = Learner(tiny, CONFIG)
    for index, path in zip((1, 2), batches):
        learner.train_batch(read_batch(path), index)
    expected = {
        k: v.detach().clone() for k, v in learner.accelerator.unwrap_model(learner.model).lm.state_dict().items()
    }
    initial = weights(tiny)

    # 1. One learner process takes two batches in a row.
    run = tmp_path / "run"
    write_batch(batch_file(run / "batches", 1), read_batch(batches[0]))
    proc = launch(tiny, run)
    wait_for(run / "checkpoints" / "000001", proc, run)
    write_batch(batch_file(run / "batches", 2), read_batch(batches[1]))
    wait_for(run / "checkpoints" / "000002", proc, run)
    stop(proc, run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["000001", "000002"]
    # Optimizer state is kept only with the newest checkpoint.
    assert not (run / "checkpoints" / "000001" / "trainer_state").exists()
    assert (run / "checkpoints" / "000002" / "trainer_state" / "progress.json").is_file()
    lines = metrics(run)
    assert [(m["batch"], m["step"]) for m in lines] == [(1, 1), (1, 2), (2, 3), (2, 4)]
    assert lines[0]["ratio_max"] == pytest.approx(1.0, abs=1e-4)  # behaviour = initial model
    state = json.loads((run / "learner_status.json").read_text())
    assert state["last_batch"] == 2 and state["checkpoint"] == "checkpoints/000002" and state["optimizer_step"] == 4

    second = weights(run / "checkpoints" / "000002")
    first = weights(run / "checkpoints" / "000001")
    name = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(first[name], initial[name]) and not torch.equal(second[name], first[name])
    # published with each checkpoint: what the learner says of its batch (the orchestrator reads it to reload)
    for index in (1, 2):
        record = json.loads((run / "checkpoints" / f"{index:06d}" / "learner.json").read_text())
        assert record == {"batch": index, "samples": len(read_batch(batches[index - 1])), "steps": 2,
                          "weights_changed": True}  # fmt: skip
    for k, v in second.items():
        torch.testing.assert_close(v, expected[k], atol=1e-6, rtol=0, msg=k)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(run / "checkpoints" / "000002")

    # 2. With the full state every 2 batches: killed after batch 3, which has none, the learner starts again
    # from batch 2's full state (weights, optimizer, RNG), removes checkpoint 3 and trains batch 3 again, then
    # batch 4; it ends where one uninterrupted learner ends, and nothing before the full state is trained twice.
    # (Batches 3 and 4 are batches 1 and 2 again.)
    for index, path in zip((3, 4), batches):
        learner.train_batch(read_batch(path), index)
    four = {k: v.detach().clone() for k, v in learner.accelerator.unwrap_model(learner.model).lm.state_dict().items()}
    every = ["--save-state-every", "2"]
    run2 = tmp_path / "run2"
    for index in (1, 2, 3):
        write_batch(batch_file(run2 / "batches", index), read_batch(batches[(index - 1) % 2]))
    proc = launch(tiny, run2, options=OPTIONS + every)
    wait_for(run2 / "checkpoints" / "000003", proc, run2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (run2 / "checkpoints" / "000002" / "trainer_state").is_dir()
    assert not (run2 / "checkpoints" / "000003" / "trainer_state").exists()
    stamp = (run2 / "checkpoints" / "000002" / "model.safetensors").stat().st_mtime_ns
    write_batch(batch_file(run2 / "batches", 4), read_batch(batches[1]))
    proc = launch(tiny, run2, options=OPTIONS + every)
    wait_for(run2 / "checkpoints" / "000004", proc, run2)
    stop(proc, run2)
    # batch 3's first records were dropped with its checkpoint: each published batch has its records once
    assert [(m["batch"], m["step"]) for m in metrics(run2)] == [
        (1, 1), (1, 2), (2, 3), (2, 4), (3, 5), (3, 6), (4, 7), (4, 8)
    ]  # fmt: skip
    log = (run2 / "trainer.log").read_text()
    assert "resumed from" in log and "training them again" in log
    assert (run2 / "checkpoints" / "000002" / "model.safetensors").stat().st_mtime_ns == stamp
    for k, v in weights(run2 / "checkpoints" / "000004").items():
        torch.testing.assert_close(v, four[k], atol=1e-6, rtol=0, msg=k)


@pytest.mark.slow
def test_a_full_state_written_in_the_background_lands_whole_and_resumes(tiny, batches, tmp_path):
    """--async-state on, the full state every 2 batches: batch 2's state is copied to host memory, written by
    a thread while batch 3 trains, and renamed into checkpoint 2 between batches. Killed after that, the
    learner resumes from it, trains batch 3 again, then batches 4 and 5, and a clean stop writes batch 5's
    state (in the background too) before the learner exits; it ends where one uninterrupted learner ends.
    (Batches 3, 4 and 5 are batches 1, 2 and 1 again.)"""
    from finetune.learner import Learner

    learner = Learner(tiny, CONFIG)
    for index, path in zip((1, 2, 3, 4, 5), batches * 3):
        learner.train_batch(read_batch(path), index)
    five = {k: v.detach().clone() for k, v in learner.accelerator.unwrap_model(learner.model).lm.state_dict().items()}
    options = OPTIONS + ["--save-state-every", "2", "--async-state", "on"]
    run = tmp_path / "run"
    for index in (1, 2, 3):
        write_batch(batch_file(run / "batches", index), read_batch(batches[(index - 1) % 2]))
    proc = launch(tiny, run, options=options)
    wait_for(run / "checkpoints" / "000002" / "trainer_state" / "progress.json", proc, run)
    wait_for(run / "checkpoints" / "000003", proc, run)
    # the state lands (renamed into checkpoint 2) after batch 3 is published and is logged just after: a kill
    # between the two would find it whole but not yet logged
    wait_for(run / "trainer.log", proc, run, text="full trainer state of version 2 saved,")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log = (run / "trainer.log").read_text()
    assert "full trainer state of version 2 taken in" in log and "written in the background" in log
    assert "full trainer state of version 2 saved," in log
    assert sorted(p.name for p in (run / "checkpoints" / "000002").iterdir() if p.name.startswith(".")) == []
    write_batch(batch_file(run / "batches", 4), read_batch(batches[1]))
    write_batch(batch_file(run / "batches", 5), read_batch(batches[0]))
    proc = launch(tiny, run, options=options)
    wait_for(run / "checkpoints" / "000005", proc, run)
    stop(proc, run)  # a clean stop writes batch 5's state, in the background too, and waits for it
    assert "resumed from" in (run / "trainer.log").read_text()
    assert [(m["batch"], m["step"]) for m in metrics(run)] == [
        (1, 1), (1, 2), (2, 3), (2, 4), (3, 5), (3, 6), (4, 7), (4, 8), (5, 9), (5, 10)
    ]  # fmt: skip
    assert (run / "checkpoints" / "000005" / "trainer_state" / "progress.json").is_file()
    for index in (2, 4):  # only the newest full state is kept
        assert not (run / "checkpoints" / f"{index:06d}" / "trainer_state").exists()
    assert json.loads((run / "learner_status.json").read_text())["state_writing"] is None
    for k, v in weights(run / "checkpoints" / "000005").items():
        torch.testing.assert_close(v, five[k], atol=1e-6, rtol=0, msg=k)


def test_a_background_state_write_that_fails_fails_the_learner(tiny, batches, tmp_path, monkeypatch):
    """The thread's error is raised in the learner between batches: status failed, naming it; the
    checkpoint gets no trainer state (a resume goes back to the one before)."""
    from finetune import train
    from finetune.learner import Learner

    def stage(self, folder, progress):
        def write():
            raise OSError(28, "No space left on device")

        return write

    monkeypatch.setattr(Learner, "stage_trainer_state", stage)
    run = tmp_path / "run"
    for index in (1, 2):
        write_batch(batch_file(run / "batches", index), read_batch(batches[index - 1]))
    argv = ["--model", str(tiny), "--run-dir", str(run), "--once", "--poll-seconds", "0.05", *OPTIONS,
            "--save-state-every", "1", "--async-state", "on"]  # fmt: skip
    logger = logging.getLogger("finetune")  # main() sets up its process's logging: undone after the test
    before = list(logger.handlers)
    monkeypatch.setattr(logger, "handlers", list(before))
    monkeypatch.setattr(logger, "propagate", logger.propagate)
    monkeypatch.setattr(logger, "level", logger.level)
    try:
        assert train.main(argv) == 1
    finally:
        for handler in set(logger.handlers) - set(before):
            handler.close()
    state = json.loads((run / "learner_status.json").read_text())
    assert state["status"] == "failed" and state["error"] == (
        "RuntimeError: writing the full trainer state of version 1 failed: OSError: [Errno 28] No space left on device"
    )
    assert not (run / "checkpoints" / "000001" / "trainer_state").exists()


@pytest.mark.slow
def test_exits_when_the_orchestrator_dies(tiny, tmp_path):
    orchestrator = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    run = tmp_path / "run"
    proc = launch(tiny, run, "--parent-pid", str(orchestrator.pid))
    try:
        deadline = time.monotonic() + 240
        while (
            json.loads(
                (run / "learner_status.json").read_text() if (run / "learner_status.json").exists() else "{}"
            ).get("status")
            != "waiting"
        ):
            assert proc.poll() is None and time.monotonic() < deadline, (run / "process.out").read_text()[-3000:]
            time.sleep(0.2)
        orchestrator.kill()
        orchestrator.wait()
        proc.wait(timeout=30)  # the launcher goes when its child does
        assert "exited: exiting now" in (run / "trainer.log").read_text()
    finally:
        orchestrator.kill()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["state-at-once", "state-in-background"])
def test_two_processes_give_the_same_weights(tiny, batches, tmp_path, background):
    """Two CPU processes (gloo) split each step's micro-batches; the result is the one-process result. The
    full state holds each process's RNG state; written in the background (a full state every batch), it is
    renamed in once both processes have written their part."""
    from finetune.learner import Learner

    learner = Learner(tiny, CONFIG)
    for index, path in zip((1, 2), batches):
        learner.train_batch(read_batch(path), index)
    expected = learner.accelerator.unwrap_model(learner.model).lm.state_dict()

    run = tmp_path / "run"
    for index, path in zip((1, 2), batches):
        write_batch(batch_file(run / "batches", index), read_batch(path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            "-m",
            "finetune.train",
            "--model",
            str(tiny),
            "--run-dir",
            str(run),
            "--once",
            *[("32" if prev == "--token-budget" else o) for prev, o in zip(["", *OPTIONS], OPTIONS)],
            *(["--async-state", "on", "--save-state-every", "1"] if background else []),
        ],
        # token budget 32: more micro-batches than processes (the result does not depend on it); an option
        # is given once (finetune.train refuses one given twice)
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = metrics(run)
    assert [(m["batch"], m["step"]) for m in lines] == [(1, 1), (1, 2), (2, 3), (2, 4)]
    assert all(m["micro_batches"] > 2 for m in lines)
    for k, v in weights(run / "checkpoints" / "000002").items():
        torch.testing.assert_close(v, expected[k], atol=1e-5, rtol=0, msg=k)
    state = run / "checkpoints" / "000002" / "trainer_state"
    assert {"random_states_0.pkl", "random_states_1.pkl", "optimizer.bin", "progress.json"} <= {
        p.name for p in state.iterdir()
    }
    assert not (run / "checkpoints" / "000001" / "trainer_state").exists()
    log = (run / "trainer.log").read_text()
    assert ("written in the background" in log) == background
    assert ("full trainer state of version 1 saved," in log) == background
