"""The batch file format (contract/batch.py) and the micro-batching (finetune/microbatch.py)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from contract.batch import BatchFormatError, Sample, batch_file, list_batches, read_batch, write_batch
from finetune.microbatch import micro_batches, plan


def sample(**overrides) -> dict:
    s = dict(
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5],
        behaviour_logprobs=[-0.5, -1.5],
        ref_logprobs=[-0.4, -1.6],
        reward=1.0,
        group_id="task-1",
        temperature=0.7,
    )
    s.update(overrides)
    return s


def test_round_trip_and_names(tmp_path):
    path = write_batch(batch_file(tmp_path / "batches", 3), [sample(), sample(reward=0.0, ref_logprobs=None)])
    assert path.name == "000003.jsonl"
    back = read_batch(path)
    assert back[0] == Sample(**sample())
    assert back[1].ref_logprobs is None and back[1].reward == 0.0
    # no temp file left; temp names are never taken for batches
    (tmp_path / "batches" / ".000004.jsonl.x.tmp").write_text("{")
    assert list(list_batches(tmp_path / "batches")) == [3]


@pytest.mark.parametrize(
    "bad, message",
    [
        (sample(behaviour_logprobs=[-0.5]), "behaviour_logprobs has 1 values for 2 sampled tokens"),
        (sample(ref_logprobs=[-0.5, -1, -2]), "ref_logprobs has 3 values"),
        (sample(completion_ids=[]), "completion_ids"),
        (sample(temperature=0), "temperature"),
        (sample(reward=float("nan")), "reward"),
        ({**sample(), "advantage": 1.0}, "advantage"),
    ],
)
def test_bad_line_names_file_line_and_field(tmp_path, bad, message):
    path = tmp_path / "000001.jsonl"
    path.write_text(json.dumps(sample()) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(BatchFormatError) as err:
        read_batch(path)
    text = str(err.value)
    assert text.startswith(f"{path}:2: ") and message in text


def test_writer_refuses_bad_samples_before_writing(tmp_path):
    with pytest.raises(ValueError):
        write_batch(tmp_path / "000001.jsonl", [sample(behaviour_logprobs=[])])
    assert list(tmp_path.iterdir()) == []


def test_not_json_and_empty(tmp_path):
    path = tmp_path / "000001.jsonl"
    path.write_text('{"prompt_ids": [1]\n')
    with pytest.raises(BatchFormatError, match=":1: "):
        read_batch(path)
    path.write_text("\n")
    with pytest.raises(BatchFormatError, match="no samples"):
        read_batch(path)


# ---- micro-batches ---------------------------------------------------------------------------


def random_sequences(n, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(250) for _ in range(rng.randint(2, 12))] for _ in range(n)]
    completions = [[rng.randrange(250) for _ in range(rng.randint(1, 20))] for _ in range(n)]
    return prompts, completions


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_plan_covers_everything_once_within_budget(layout):
    prompts, completions = random_sequences(50)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    budget = 64
    groups = plan(lengths, budget, layout)
    assert sorted(i for g in groups for i in g) == list(range(50))
    for g in groups:
        cost = len(g) * max(lengths[i] for i in g) if layout == "padded" else sum(lengths[i] for i in g)
        assert cost <= budget
        assert [lengths[i] for i in g] == sorted((lengths[i] for i in g), reverse=True)
    # longest first across micro-batches too
    firsts = [lengths[g[0]] for g in groups]
    assert firsts == sorted(firsts, reverse=True)
    # sorting keeps padding small
    mbs = micro_batches(prompts, completions, budget, layout)
    slots = sum(mb.n_slots for mb in mbs)
    assert sum(mb.n_tokens for mb in mbs) == sum(lengths)
    assert slots <= 1.15 * sum(lengths)


def test_sequence_longer_than_budget_gets_its_own_micro_batch():
    groups = plan([100, 5, 5], token_budget=20, layout="padded")
    assert groups == [[0], [1, 2]]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_micro_batch_positions_point_at_the_completion(layout):
    """The hidden state at (row, col) predicts input_ids[row, col + 1], which must be the completion token."""
    prompts, completions = random_sequences(9, seed=1)
    for mb in micro_batches(prompts, completions, 40, layout):
        assert torch.equal(mb.input_ids[mb.rows, mb.cols + 1], mb.targets)
        assert mb.targets.tolist() == [t for i in mb.indices for t in completions[i]]
        if layout == "packed":
            assert mb.input_ids.shape[0] == 1 and mb.n_slots == mb.n_tokens
            starts = (mb.position_ids[0] == 0).nonzero().flatten().tolist()
            assert len(starts) == len(mb.indices)


def test_shared_prefix_without_sharing_is_a_padded_micro_batch_without_a_mask():
    """Every prompt different (or completions too long to share one): the shared_prefix micro-batch is the
    padded one, with no 4-D mask (attention kernels run plain causal attention faster: flash on GPUs); a
    micro-batch where a prompt is shared keeps its mask."""
    prompts, completions = random_sequences(9, seed=2)
    shared = micro_batches(prompts, completions, 40, "shared_prefix")
    padded = micro_batches(prompts, completions, 40, "padded")
    assert len(shared) == len(padded)
    for a, b in zip(shared, padded):
        assert a.attention_mask is None and a.position_ids is None
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.targets, b.targets)
        assert torch.equal(a.rows, b.rows) and torch.equal(a.cols, b.cols) and a.indices == b.indices
    both = micro_batches([prompts[0]] * 2 + prompts[1:3], [[5, 6], [7]] + completions[1:3], 4096, "shared_prefix")
    assert len(both) == 1 and both[0].attention_mask is not None  # one row holds two completions
