"""Offline training (`python -m orchestrate.after.offline`): saved tapes -> re-scored, filtered -> the finetune
process -> a checkpoint under which the rewarded completions are more likely."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from orchestrate.after.offline import main
from tapes.store import read_tapes, write_tapes

pytestmark = pytest.mark.vllm  # the tapes come from the real run of the `tiny_run` fixture

CHOSEN: set[str] = set()


def first_of_group(tape) -> float:
    """A reward for the test: +1 for the chosen attempt of each group, -1 for the others."""
    return 1.0 if tape.metadata.id in CHOSEN else -1.0


def completion_logprobs(model_dir, calls) -> list[float]:
    """Sum of log-probs of each call's completion tokens given its prompt (transformers, fp32, T = 1)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for call in calls:
            ids = torch.tensor([call.prompt_token_ids + call.output_token_ids])
            logits = model(ids).logits[0, len(call.prompt_token_ids) - 1 : -1]
            logp = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(call.output_token_ids)[:, None])
            out.append(logp.sum().item())
    return out


@pytest.fixture
def run_without_reference(tiny_run, tmp_path):
    """A copy of the run's rollout tapes and config, reference log-probs removed."""
    run = tmp_path / "run"
    (run / "tapes").mkdir(parents=True)
    (run / "config.json").write_text((tiny_run / "config.json").read_text())
    for i in (1, 2):
        tapes = list(read_tapes(tiny_run / "tapes" / f"iter_{i:06d}.jsonl"))
        for tape in tapes:
            for call in tape.llm_calls:
                call.ref_logprobs = None
        write_tapes(run / "tapes" / f"iter_{i:06d}.jsonl", tapes)
    return run


def test_offline_training_raises_the_rewarded_completions(tiny_run, run_without_reference, tiny_servers, tmp_path,
                                                         capsys):  # fmt: skip
    """From a run whose reference log-probs are gone: re-score, re-annotate with the reference model (a running
    vLLM server, by URL), train; the rewarded completions are more likely under the new checkpoint, the others
    less. (`--reference MODEL` starts a server of the same class as the loop's reference server.)"""
    tapes = [t for i in (1, 2) for t in read_tapes(tiny_run / "tapes" / f"iter_{i:06d}.jsonl")]
    initial = json.loads((tiny_run / "config.json").read_text())["model"]["policy"]  # also the run's reference
    groups = {}
    for tape in tapes:
        groups.setdefault(tape.metadata.group_id, tape.metadata.id)
    CHOSEN.clear()
    CHOSEN.update(groups.values())
    assert len(CHOSEN) == 4  # 2 tasks x 2 iterations

    reference = tiny_servers[1]  # the tiny model, the run's reference
    key = tmp_path / "key"
    key.write_text(reference.api_key)
    out = tmp_path / "offline"
    code = main(["--tapes", str(run_without_reference), "--iterations", "1-2", "--out", str(out),
                 "--reward", f"{__name__}:first_of_group", "--filter", "all",
                 "--server.reference_url", reference.base_url, "--server.api_key_file", str(key),
                 "--train.lr", "1e-3", "--train.epochs", "2", "--no-progress"])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    assert "16 tapes read, 16 kept" in printed.out and "4 groups with differing returns" in printed.out

    checkpoint = out / "checkpoints" / "000001"
    assert (checkpoint / "config.json").is_file() and (checkpoint / "model.safetensors").is_file()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["tapes_read"] == 16 and metrics[0]["train_steps"] == 2
    assert metrics[0]["reward_mean"] == pytest.approx((4 - 12) / 16)
    assert len((out / "train_metrics.jsonl").read_text().splitlines()) == 2
    kept = list(read_tapes(out / "tapes" / "iter_000001.jsonl"))  # the re-scored tapes, browsable
    assert sorted(t.metadata.id for t in kept if t.metadata.reward == 1.0) == sorted(CHOSEN)
    assert len((out / "batches" / "000001.jsonl").read_text().splitlines()) == 16
    recorded = {t.metadata.id: t.llm_calls[0].ref_logprobs for t in tapes}  # from the run's reference pass
    for tape in kept:
        assert tape.llm_calls[0].ref_logprobs == pytest.approx(recorded[tape.metadata.id], abs=2e-3)
    assert not (out / "logs" / "reference.log").exists()  # no server of its own
    assert json.loads((out / "config.json").read_text())["reference"] == reference.base_url

    rewarded = [t.llm_calls[0] for t in tapes if t.metadata.id in CHOSEN]
    others = [t.llm_calls[0] for t in tapes if t.metadata.id not in CHOSEN]
    before, after = completion_logprobs(initial, rewarded), completion_logprobs(checkpoint, rewarded)
    assert sum(after) / len(after) > sum(before) / len(before) + 0.5, (before, after)
    assert sum(a > b for a, b in zip(after, before)) >= 3  # nearly every rewarded completion rose
    before, after = completion_logprobs(initial, others), completion_logprobs(checkpoint, others)
    assert sum(after) / len(after) < sum(before) / len(before)  # and the others fell

    # reference log-probs are needed for the KL term, and missing: refused before training
    with pytest.raises(SystemExit) as exc:
        main(["--tapes", str(run_without_reference), "--out", str(tmp_path / "refused"),
              "--filter", "all", "--reward", f"{__name__}:first_of_group", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "error: --train.kl_coef: 16 LLM calls have no reference log-probs" in err

    # the same output directory is not trained twice
    with pytest.raises(SystemExit) as exc:
        main(["--tapes", str(tiny_run), "--out", str(out)])
    assert exc.value.code == 2 and "--out" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, option, words",
    [
        (["--tapes", "/nonexistent"], "--tapes", "neither a run directory nor a tape file"),
        (["--iterations", "7-9"], "--tapes", "no rollout tape files"),
        (["--iterations", "x"], "--iterations", "not N or A-B"),
        (["--filter", "reward>>0"], "--filter", "not 'all' or a reward condition"),
        (["--filter", "reward>5"], "--filter", "no tape of 16 passes"),
        (["--rescore"], "--filter", "every group of the 16 kept tapes has equal rewards"),  # the tiny model never wins
        (["--train.lr", "-1"], "--train.lr", "greater than 0"),
        (["--tapes", "EVAL"], "--tapes", "4 tapes were sampled at temperature 0"),
        (["--train.algorithm", "ppx"], "--train.algorithm", "unknown algorithm 'ppx': one of grpo, dr_grpo, dapo"),
        (["--reward", "no_such_module:f"], "--reward", "cannot import"),
        (["--model", "/nonexistent/model"], "--model", "no such folder"),
        (
            ["--reference", "smollm2", "--server.reference_url", "http://127.0.0.1:9"],
            "--server.reference_url",
            "give the reference once",
        ),  # fmt: skip
        (
            ["--server.reference_url", "http://127.0.0.1:9", "--server.api_key_file", "/nonexistent/key"],
            "--server.api_key_file",
            "cannot read /nonexistent/key",
        ),  # fmt: skip
        (
            ["--server.reference_url", "http://127.0.0.1:9", "--server.api_key_file", "KEY"],
            "--server.reference_url",
            "http://127.0.0.1:9",
        ),  # fmt: skip
        (["--server.reference_url", "ftp://x"], "--server.reference_url", "http"),
    ],
)
def test_bad_input_is_refused_naming_the_option(tiny_run, tmp_path, capsys, args, option, words):
    argv = ["--out", str(tmp_path / "out"), "--no-progress"]
    if "--tapes" not in args:
        argv = ["--tapes", str(tiny_run), *argv]
    (tmp_path / "key").write_text("k")
    args = [str(tiny_run / "tapes" / "eval_000002.jsonl") if a == "EVAL" else a for a in args]
    args = [str(tmp_path / "key") if a == "KEY" else a for a in args]
    with pytest.raises(SystemExit) as exc:
        main([*argv, *args])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {option}") and words in err, err
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_an_out_that_holds_the_tapes_it_reads_is_refused(tiny_run, capsys):
    """OUT/tapes/iter_000001.jsonl and OUT/config.json would overwrite the run's own."""
    before = {p: p.read_bytes() for p in sorted(tiny_run.rglob("*.json*")) if p.is_file()}
    for out in (tiny_run, tiny_run.parent):
        with pytest.raises(SystemExit) as exc:
            main(["--tapes", str(tiny_run), "--out", str(out), "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and err.startswith("error: --out:") and "holds the tapes it would read" in err
    assert {p: p.read_bytes() for p in sorted(tiny_run.rglob("*.json*")) if p.is_file()} == before
    other = tiny_run.parent / "other-run"  # another run, killed before its first checkpoint
    (other / "tapes").mkdir(parents=True, exist_ok=True)
    (other / "config.json").write_text((tiny_run / "config.json").read_text())
    with pytest.raises(SystemExit) as exc:
        main(["--tapes", str(tiny_run), "--out", str(other), "--no-progress"])
    assert exc.value.code == 2 and "holds another run" in capsys.readouterr().err


def test_equal_rewards_are_refused_under_a_group_baseline_but_not_with_a_critic():
    """A kept set whose groups all have equal rewards trains nothing under a group baseline (refused), while
    PPO's critic still gives its advantages (kept): the refusal reads the loss, as config_checks does."""
    from finetune.config import TrainConfig
    from orchestrate.after.offline import score_and_filter
    from orchestrate.loop.config_checks import ConfigError
    from tests.test_tapes import make_tape

    tapes = [make_tape(i) for i in range(4)]  # one group, every reward 1.0
    with pytest.raises(ConfigError, match="every group"):
        score_and_filter(tapes, None, lambda t: True, "all", TrainConfig(algorithm="grpo"), progress=False)
    kept = score_and_filter(tapes, None, lambda t: True, "all", TrainConfig(algorithm="ppo"), progress=False)
    assert kept == tapes
    # a failed attempt's reward is not a return: a group whose other attempts are equal has no signal
    failed = make_tape(9)
    failed.metadata.reward, failed.metadata.error = 0.0, "the sandbox died"
    with pytest.raises(ConfigError, match="every group"):
        score_and_filter(tapes + [failed], None, lambda t: True, "all", TrainConfig(algorithm="grpo"), progress=False)


def test_tapes_that_give_no_sample_are_refused_before_anything_starts_and_failed_ones_need_no_scores():
    """No tape trainable (every one failed, or none at all): refused as bad input, not a traceback after the
    trainer started. A failed tape (a fork that did not come back) was never scored by the reference or the
    teacher, and is never trained: its missing log-probs refuse nothing."""
    from finetune.config import TrainConfig
    from orchestrate.after.offline import check_reference, check_teacher_logprobs, check_trainable
    from orchestrate.loop.config_checks import ConfigError
    from tests.test_tapes import make_tape

    failed = [make_tape(i) for i in range(2)]
    for tape in failed:
        tape.metadata.error = "fork at call 2: the prompt differs"
        for call in tape.llm_calls:
            call.ref_logprobs = None
    with pytest.raises(ConfigError, match="--tapes: no episode of 2 can be trained on; the first's: .*prompt differs"):
        check_trainable(failed, False)
    with pytest.raises(ConfigError, match="no tapes"):
        check_trainable([], False)
    good = [make_tape(5)]
    for call in good[0].llm_calls:
        call.teacher_logprobs = [-0.1] * len(call.output_token_ids)
    check_trainable(good + failed, True)
    assert check_reference(good + failed, TrainConfig(kl_coef=0.1), None) is True  # the good tape has them
    assert check_teacher_logprobs(good + failed, TrainConfig(teacher_coef=1.0)) == good + failed
    with pytest.raises(ConfigError, match="--train.kl_coef: 1 LLM calls"):
        check_reference([make_tape(6).model_copy(update={"llm_calls": [c.model_copy(update={"ref_logprobs": None})
                                                                       for c in make_tape(6).llm_calls]})],
                        TrainConfig(kl_coef=0.1), None)  # fmt: skip


def test_the_metrics_line_is_written_before_the_trainer_is_stopped(tmp_path):
    """Stopping the trainer can take seconds (it writes its state); a command stopped then keeps its metrics
    line and its checkpoint line, recorded as soon as the checkpoint is published."""
    from contract.rundir import RunDir
    from finetune.config import TrainConfig
    from orchestrate.after.offline import train_once
    from tests.test_tapes import make_tape

    events = []

    class Trainer:  # the TrainerProcess calls train_once makes
        run, train, started = RunDir(tmp_path / "out"), TrainConfig(kl_coef=0.0), False
        model_dir = tmp_path / "model"

        def start(self):
            events.append("start")
            self.started = True

        def wait_for_checkpoint(self, index, progress, desc):
            events.append("checkpoint")
            return self.run.checkpoint(index)

        def stop(self):
            events.append("stop")

    Trainer.run.create()
    tapes = [make_tape(i) for i in range(2)]
    tapes[0].metadata.reward = 0.0
    out = train_once(Trainer(), tapes, False, None, None, "2 tapes", progress=False,
                     record=lambda checkpoint: events.append(f"record {checkpoint.name}"))  # fmt: skip
    assert out.name == "000001" and events == ["start", "checkpoint", "record 000001", "stop"]
