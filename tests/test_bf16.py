"""The learner in bf16 on CPU: which processors have the instructions, the note for one that emulates them, and
the default that stays float32 on CPU (bench/bench_bf16.py measures both on the same batch)."""

import pytest

from contract.processor import cpu_bf16
from finetune.config import TrainConfig
from finetune.models import mixed_precision_for


@pytest.mark.parametrize(
    ("flags", "found"),
    [("fpu avx2 fma", None), ("avx512f avx512_bf16 avx2", "avx512_bf16"), ("amx_bf16 avx512_bf16", "amx_bf16")],
)
def test_the_processors_bf16_instructions_are_read_from_its_flags(tmp_path, flags, found):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert cpu_bf16(str(info)) == found
    assert cpu_bf16(str(tmp_path / "absent")) is None


def test_auto_stays_float32_on_cpu_and_bfloat16_is_asked_for(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert mixed_precision_for(TrainConfig()) == "no"
    assert mixed_precision_for(TrainConfig(dtype="bfloat16")) == "bf16"


def test_bfloat16_on_a_cpu_that_emulates_it_is_noted_and_nowhere_else():
    from orchestrate.loop.command_line import resolve
    from orchestrate.loop.preflight import emulated_bf16_note

    asked = resolve("embedded", {"train.dtype": "bfloat16"})
    note = emulated_bf16_note(asked, gpus=0, cpu_bf16=None)
    assert "--train.dtype bfloat16" in note and "emulates" in note
    assert emulated_bf16_note(asked, gpus=0, cpu_bf16="avx512_bf16") is None
    assert emulated_bf16_note(asked, gpus=1, cpu_bf16=None) is None
    assert emulated_bf16_note(resolve("embedded", {}), gpus=0, cpu_bf16=None) is None


def test_the_learners_log_probs_under_bf16_autocast_stay_near_float32s(tmp_path):
    """On a tiny model: the same weights, the same tokens; bf16 autocast moves each log-prob by little (the
    importance ratio the loss sees at the first epoch)."""
    import torch

    from finetune.learner import Learner
    from finetune.tiny_model import make_tiny_model
    from tests.test_finetune_learner import BAD, GOOD, OTHER, group

    learner = Learner(make_tiny_model(tmp_path / "model"), TrainConfig(dtype="float32"))
    samples = group([GOOD, BAD, *OTHER], [1.0, 0.0, 0.0, 1.0])
    fp32 = torch.cat(learner.logprobs(samples))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = torch.cat(learner.logprobs(samples))
    assert not torch.equal(fp32, bf16)  # autocast did reach the learner's matmuls
    assert (bf16 - fp32).exp().sub(1).abs().max() < 0.05
