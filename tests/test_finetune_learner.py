"""The learner in one process, on a tiny Llama built from a config."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from contract.batch import Sample, Turn
from finetune.algorithms import ALGORITHMS
from finetune.config import TrainConfig
from finetune.learner import Learner
from finetune.logprobs import PolicyLogProbs
from finetune.microbatch import micro_batches
from finetune.tiny_model import make_tiny_model

PROMPT = [40, 41, 42, 43, 44]
GOOD = [10, 11, 12, 13]
BAD = [20, 21, 22]
OTHER = [[30, 31], [50, 51, 52, 53, 54]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def with_behaviour(learner: Learner, samples: list[Sample]) -> list[Sample]:
    """Behaviour log-probs as the sampling policy (the current weights) would report them."""
    return [
        s.model_copy(update={"behaviour_logprobs": lp.tolist()}) for s, lp in zip(samples, learner.logprobs(samples))
    ]


def group(completions, rewards, temperature=1.0, group_id="g") -> list[Sample]:
    return [
        Sample(
            prompt_ids=PROMPT,
            completion_ids=c,
            behaviour_logprobs=[0.0] * len(c),
            reward=r,
            group_id=group_id,
            temperature=temperature,
        )
        for c, r in zip(completions, rewards)
    ]


def params(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.accelerator.unwrap_model(learner.model).lm.state_dict().items()}


# ---- log-probs -----------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["fused", "full"])
@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prefix"])
def test_micro_batched_logprobs_equal_one_sequence_at_a_time(tiny, impl, layout):
    lm = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 10))] for _ in range(7)]
    prompts[1] = prompts[0]  # groups: attempts of one task share the prompt
    prompts[4] = prompts[3] = prompts[2]
    completions = [[rng.randrange(256) for _ in range(rng.randint(1, 9))] for _ in range(7)]
    temps = [1.0, 0.7, 1.0, 0.5, 1.3, 1.0, 0.7]
    expected, expected_raw = [], []
    with torch.no_grad():
        for p, c, t in zip(prompts, completions, temps):
            logits = lm(torch.tensor([p + c])).logits[0, len(p) - 1 : len(p) - 1 + len(c)]
            expected.append(torch.log_softmax(logits / t, -1).gather(1, torch.tensor(c)[:, None]).squeeze(1))
            expected_raw.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None]).squeeze(1))
    policy = PolicyLogProbs(lm, impl, chunk=3)  # chunks smaller than a micro-batch
    got, got_raw = {}, {}
    for mb in micro_batches(prompts, completions, 24, layout):
        inv_temp = torch.tensor([1 / temps[i] for i in mb.indices for _ in completions[i]])
        logp, raw_logp, entropy, *_ = policy(
            mb.input_ids,
            mb.position_ids,
            mb.rows,
            mb.cols,
            mb.targets,
            inv_temp,
            with_raw=True,
            attention_mask=mb.attention_mask,
        )
        assert (entropy > 0).all()
        got.update(zip(mb.indices, logp.split(mb.completion_lengths)))
        got_raw.update(zip(mb.indices, raw_logp.split(mb.completion_lengths)))
        assert (
            policy(
                mb.input_ids, mb.position_ids, mb.rows, mb.cols, mb.targets, inv_temp, attention_mask=mb.attention_mask
            )[1]
            is None
        )
    assert len(got) == 7
    if layout == "shared_prefix":  # a shared prompt is computed once per row
        from finetune.microbatch import prefix_units

        units = prefix_units(prompts, completions, 4096)
        assert any(len(u) > 1 for u in units)
        n = sum(mb.n_tokens for mb in micro_batches(prompts, completions, 4096, layout))
        assert n == sum(map(len, completions)) + sum(len(prompts[u[0]]) for u in units)
        assert n < sum(len(p) + len(c) for p, c in zip(prompts, completions))
    for i in range(7):
        torch.testing.assert_close(got[i].detach(), expected[i], atol=1e-5, rtol=0)
        torch.testing.assert_close(got_raw[i].detach(), expected_raw[i], atol=1e-5, rtol=0)
    assert not torch.allclose(got[1], got_raw[1])  # T = 0.7: tempered and untempered differ


def test_fused_head_gradient_equals_plain_autograd(tiny):
    torch.manual_seed(0)
    hidden = torch.randn(11, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (11,))
    inv_temp = torch.rand(11, dtype=torch.float64) + 0.5
    coef = torch.randn(11, dtype=torch.float64)
    raw_coef = torch.randn(11, dtype=torch.float64)
    from finetune.logprobs import head_logprobs

    # The tempered log-probs and the untempered ones (as the KL term uses them), both with gradients.
    logp, raw_logp, entropy = head_logprobs(hidden, weight, targets, inv_temp, chunk=4, with_raw=True)
    g_fused = torch.autograd.grad((logp * coef).sum() + (raw_logp * raw_coef).sum(), (hidden, weight))
    logits = hidden @ weight.T
    logps = torch.log_softmax(logits * inv_temp[:, None], -1)
    ref = logps.gather(1, targets[:, None]).squeeze(1)
    raw_ref = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    g_ref = torch.autograd.grad((ref * coef).sum() + (raw_ref * raw_coef).sum(), (hidden, weight))
    torch.testing.assert_close(logp.double(), ref.detach(), atol=2e-5, rtol=0)  # outputs are fp32
    torch.testing.assert_close(raw_logp.double(), raw_ref.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), -(logps.exp() * logps).sum(-1).detach(), atol=2e-5, rtol=0)
    for a, b in zip(g_fused, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # the head works in fp32


def test_a_compiled_learner_takes_the_same_step(tiny, monkeypatch):
    """compile on (the default with CUDA): the decoder layers and the head's softmax arithmetic through
    torch.compile give the eager learner's step: its metrics and its weights (KL, entropy bonus and a
    temperature, so every term of the head's backward runs). The head's arithmetic (ours: in-place ops,
    scatter_add, dynamic chunk sizes) through inductor; the model's own layers through dynamo and AOT
    autograd without inductor's code generation (aot_eager: the capture is what could break; inductor's CPU
    build of them takes most of a minute here, and its GPU build ran on an H200: docs/training.md)."""
    import functools

    from finetune import logprobs, models

    monkeypatch.setattr(models, "compile_layers", functools.partial(logprobs.compile_layers, backend="aot_eager"))
    monkeypatch.setattr(logprobs, "_COMPILED", {})  # compiled afresh, not taken from an earlier test
    rng = random.Random(5)
    batch = []
    for g in range(3):
        completions = [[rng.randrange(256) for _ in range(rng.randint(2, 9))] for _ in range(3)]
        batch += group(completions, [rng.random() for _ in range(3)], temperature=0.7, group_id=g)
    for s in batch:
        s.ref_logprobs = [-1.0] * len(s.completion_ids)
    results = []
    for mode in ("off", "on"):
        cfg = TrainConfig(lr=1e-3, kl_coef=0.1, entropy_coef=0.01, token_budget=64, compile=mode)
        learner = Learner(tiny, cfg)
        layers = [m for m in learner.model.lm.modules() if type(m).__name__ == "LlamaDecoderLayer"]
        assert layers and all((m._compiled_call_impl is not None) == (mode == "on") for m in layers)
        (m,) = learner.train_batch(with_behaviour(learner, batch))
        results.append((m, params(learner)))
    (eager, w_eager), (compiled, w_compiled) = results
    assert eager["micro_batches"] > 1
    for key in ("loss", "pg_loss", "kl", "grad_norm", "entropy"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-4, abs=1e-6), key
    for name in w_eager:
        torch.testing.assert_close(w_compiled[name], w_eager[name], atol=1e-5, rtol=0)


# ---- training ------------------------------------------------------------------------------


def test_rewarded_completion_goes_up_punished_goes_down(tiny):
    learner = Learner(tiny, TrainConfig(lr=3e-3, epochs=4))
    batch = with_behaviour(learner, group([GOOD, BAD] + OTHER, [1.0, -1.0, 0.0, 0.0]))
    before = [lp.sum().item() for lp in learner.logprobs(batch)]
    metrics = learner.train_batch(batch, batch_index=0)
    assert len(metrics) == 4 and metrics[-1]["step"] == 4
    after = [lp.sum().item() for lp in learner.logprobs(batch)]
    assert after[0] > before[0] + 0.1, (before, after)
    assert after[1] < before[1] - 0.1, (before, after)


def test_positive_advantage_raises_its_tokens_after_one_step(tiny):
    learner = Learner(tiny, TrainConfig(lr=1e-3))
    batch = with_behaviour(learner, group([GOOD, BAD], [1.0, 0.0]))
    before = learner.logprobs(batch)[0]
    (m,) = learner.train_batch(batch)
    assert m["adv_max"] > 0 and m["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    after = learner.logprobs(batch)[0]
    assert (after > before).all(), (before, after)


@pytest.mark.parametrize("name", list(ALGORITHMS))  # the registry's: a new one is trained here with no edit
def test_every_registered_algorithm_trains_as_the_command_line_resolves_it(tiny, name):
    """`--train.algorithm NAME` as orchestrate.rl resolves it (the registry's loss, estimator, aggregation and
    settings) trains a batch of two groups: the better completion of each group becomes more likely."""
    from orchestrate.loop.command_line import resolve

    resolved = resolve("embedded", {"train.algorithm": name, "train.lr": "1e-2"}).train
    learner = Learner(tiny, resolved.model_copy(update={"token_budget": 256}))
    samples = group([GOOD, BAD], [1.0, 0.0]) + group([OTHER[0], OTHER[1]], [1.0, 0.0], group_id="h")
    # as the orchestrator writes them: one turn, its finish and its sampling limit (DAPO's overlong shaping)
    batch = with_behaviour(learner, [s.model_copy(update={"turns": [Turn(
        index=0, start=0, length=len(s.completion_ids), reward=s.reward, truncated=False, max_tokens=32)]})
        for s in samples])  # fmt: skip
    before = [lp.sum().item() for lp in learner.logprobs(batch)]
    steps = learner.train_batch(batch)
    assert steps and all(math.isfinite(m["loss"]) and m["weights_changed"] for m in steps), steps
    after = [lp.sum().item() for lp in learner.logprobs(batch)]
    assert after[0] > before[0] and after[2] > before[2], (name, before, after)  # the rewarded ones rose
    if ALGORITHMS[name].estimator != "none":  # with a baseline the unrewarded ones fall
        assert after[1] < before[1] and after[3] < before[3], (name, before, after)


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])  # the grpo and the reinforce loss, group-relative
def test_equal_rewards_leave_the_weights_unchanged(tiny, algorithm):
    learner = Learner(tiny, TrainConfig(lr=1e-2, algorithm=algorithm))
    batch = with_behaviour(learner, group([GOOD, BAD] + OTHER, [0.3] * 4))
    start = params(learner)
    (m,) = learner.train_batch(batch)
    assert m["grad_norm"] == 0.0 and m["zero_adv_frac"] == 1.0
    for name, value in params(learner).items():
        assert torch.equal(value, start[name]), name


def test_no_baseline_trains_on_the_rewards_themselves(tiny):
    # Rejection-sampling fine-tuning: only rewarded samples kept, all with reward 1. With the group
    # baseline they would train nothing; with baseline "none" their log-probs rise.
    learner = Learner(tiny, TrainConfig(lr=1e-3, algorithm="reinforce"))  # estimator none
    batch = with_behaviour(learner, group([GOOD, BAD], [1.0, 1.0]))
    before = [lp.sum().item() for lp in learner.logprobs(batch)]
    (m,) = learner.train_batch(batch)
    assert m["adv_mean"] == 1.0 and m["zero_adv_frac"] == 0.0 and m["grad_norm"] > 0
    after = [lp.sum().item() for lp in learner.logprobs(batch)]
    assert all(a > b for a, b in zip(after, before)), (before, after)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batching_does_not_change_the_step(tiny, aggregation):
    rng = random.Random(3)
    batch = []
    for g in range(4):
        completions = [[rng.randrange(256) for _ in range(rng.randint(1, 12))] for _ in range(4)]
        batch += group(completions, [rng.random() for _ in range(4)], temperature=0.7, group_id=g)
    results = []
    for budget, layout in ((16, "shared_prefix"), (4096, "shared_prefix"), (4096, "padded")):
        learner = Learner(
            tiny, TrainConfig(lr=1e-3, token_budget=budget, aggregation=aggregation, kl_coef=0.0, layout=layout)
        )
        (m,) = learner.train_batch(with_behaviour(learner, batch))
        results.append((m, params(learner)))
    (small, w_small), (large, w_large), (padded, w_padded) = results
    assert small["micro_batches"] > 4 and large["micro_batches"] == 1
    assert large["tokens"] < padded["tokens"]  # the shared prompt was computed once
    for other in (large, padded):
        for key in ("loss", "pg_loss", "grad_norm", "entropy", "ratio_mean"):
            assert small[key] == pytest.approx(other[key], rel=1e-5, abs=1e-7), key
    for name in w_small:  # the same update, whatever the micro-batches and the layout (Adam: ~lr * sign(g))
        torch.testing.assert_close(w_small[name], w_padded[name], atol=1e-5, rtol=0)
        torch.testing.assert_close(w_large[name], w_padded[name], atol=1e-5, rtol=0)


def test_step_metrics(tiny):
    cfg = TrainConfig(lr=1e-3, epochs=2, steps_per_epoch=2, warmup_steps=2, kl_coef=0.05)
    learner = Learner(tiny, cfg)
    batch = with_behaviour(learner, group([GOOD, BAD] + OTHER, [1.0, 0.0, 0.0, 0.5]))
    batch = [s.model_copy(update={"ref_logprobs": [x - 0.1 for x in s.behaviour_logprobs]}) for s in batch]
    metrics = learner.train_batch(batch, batch_index=7)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["epoch"] for m in metrics] == [0, 0, 1, 1]
    assert [m["lr"] for m in metrics] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3])
    for key in (
        "loss",
        "pg_loss",
        "kl",
        "entropy",
        "clip_frac",
        "ratio_mean",
        "ratio_max",
        "adv_mean",
        "adv_std",
        "grad_norm",
        "lr",
        "tokens_per_s",
    ):
        assert all(isinstance(m[key], float) for m in metrics), key
    assert all(m["batch"] == 7 and m["kl"] > 0 for m in metrics)
    assert metrics[0]["ratio_max"] == pytest.approx(1.0, abs=1e-5)  # nothing trained yet
    assert sum(m["samples"] for m in metrics) == 2 * len(batch)
    for m in metrics:
        assert m["loss"] == pytest.approx(m["pg_loss"] + 0.05 * m["kl"], abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        learner.train_batch(group([GOOD], [1.0]))


def test_progress_counts_completion_tokens_up_to_the_total(tiny):
    learner = Learner(tiny, TrainConfig(lr=1e-3, epochs=2, steps_per_epoch=2, token_budget=16))
    batch = with_behaviour(learner, group([GOOD, BAD] + OTHER, [1.0, 0.0, 0.0, 0.5]))
    seen = []
    learner.train_batch(batch, on_progress=lambda done, total: seen.append((done, total)))
    total = 2 * sum(len(s.completion_ids) for s in batch)
    assert len(seen) >= 4 and all(t == total for _, t in seen)  # 4 steps, each one micro-batch or more
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1][0] == total


def test_a_model_that_scales_its_logits_is_scored_by_its_own_forward(tiny, tmp_path):
    """Granite divides its logits by logits_scaling in its forward; the fused head (hidden state x embedding)
    would give other log-probs than the sampler's, so the learner takes the model's forward for it."""
    from transformers import GraniteConfig, GraniteForCausalLM

    from finetune.logprobs import head_is_plain

    config = GraniteConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, logits_scaling=8.0)  # fmt: skip
    torch.manual_seed(0)
    GraniteForCausalLM(config).save_pretrained(tmp_path / "granite")
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "granite", dtype=torch.float32)
    assert not head_is_plain(lm) and lm.training is False  # from_pretrained gives eval mode; kept
    assert head_is_plain(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32))
    learner = Learner(tmp_path / "granite", TrainConfig(lr=1e-3))
    assert learner.accelerator.unwrap_model(learner.model).impl == "full"
    sample = group([[5, 6, 7]], [1.0])[0].model_copy(update={"prompt_ids": [1, 2, 3]})
    (got,) = learner.logprobs([sample])
    with torch.no_grad():
        logits = lm(input_ids=torch.tensor([[1, 2, 3, 5, 6, 7]])).logits[0, 2:5]
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor([[5], [6], [7]])).squeeze(1)
    torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=0)


def test_kl_at_temperature_compares_untempered_logprobs_with_the_reference(tiny):
    # Sampled at T = 0.7, reference scored at T = 1 with the same weights: the KL is 0, not
    # the gap between the tempered and untempered distributions.
    learner = Learner(tiny, TrainConfig(lr=1e-3, kl_coef=0.1))
    batch = with_behaviour(learner, group([GOOD, BAD] + OTHER, [1.0, 0.0, 0.0, 0.5], temperature=0.7))
    untempered = learner.logprobs([s.model_copy(update={"temperature": 1.0}) for s in batch])
    batch = [s.model_copy(update={"ref_logprobs": lp.tolist()}) for s, lp in zip(batch, untempered)]
    assert any(abs(a - b) > 0.05 for s in batch for a, b in zip(s.behaviour_logprobs, s.ref_logprobs))
    (m,) = learner.train_batch(batch)
    assert m["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert m["kl"] == pytest.approx(0.0, abs=1e-6)


def test_checkpoint_reloads_and_resumes_exactly(tiny, tmp_path):
    cfg = TrainConfig(lr=1e-3)
    learner = Learner(tiny, cfg)
    batch = with_behaviour(learner, group([GOOD, BAD] + OTHER, [1.0, 0.0, 0.0, 0.5]))
    learner.train_batch(batch, 0)
    learner.save_checkpoint(tmp_path / "ck", {"batch": 0})
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ck", dtype=torch.float32)
    # written untied (for vLLM's reload_weights), the same function as the tied model trained
    assert (
        reloaded.config.tie_word_embeddings is False
        and learner.accelerator.unwrap_model(learner.model).lm.config.tie_word_embeddings
    )
    assert reloaded.lm_head.weight.data_ptr() != reloaded.model.embed_tokens.weight.data_ptr()
    trained = params(learner)
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, trained[name]), name
    assert not torch.equal(
        trained["model.layers.0.mlp.up_proj.weight"],
        AutoModelForCausalLM.from_pretrained(tiny).state_dict()["model.layers.0.mlp.up_proj.weight"],
    )
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "ck").decode([104, 105]) == AutoTokenizer.from_pretrained(
        tiny
    ).decode([104, 105])

    # A second step from the restored optimizer state equals a second step in memory.
    resumed = Learner(tiny, cfg)
    assert resumed.load_trainer_state(tmp_path / "ck")["batch"] == 0 and resumed.step == 1
    learner.train_batch(batch, 1)
    resumed.train_batch(batch, 1)
    a, b = params(learner), params(resumed)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-7, rtol=0)
    lm = resumed.accelerator.unwrap_model(resumed.model).lm
    assert lm.lm_head.weight is lm.model.embed_tokens.weight  # still the tied model


def test_shared_prefix_rows_stop_growing_when_attention_would_cost_more():
    """Long completions (multi-turn episodes) are not all packed behind one prompt: a row grows while its
    width squared stays within the sum of its sequences' squared lengths."""
    from finetune.microbatch import prefix_units

    prompt = list(range(300))
    short = [[1] * 25 for _ in range(4)]  # one-turn answers: all four share the prompt
    assert prefix_units([prompt] * 4, short, 4096) == [[0, 1, 2, 3]]
    long = [[1] * 140 for _ in range(16)]  # episodes: (300 + 140k)^2 <= k (440)^2 holds up to k = 4
    units = prefix_units([prompt] * 16, long, 4096)
    assert [len(u) for u in units] == [4] * 4


def test_a_trees_shared_prefix_is_computed_once_with_the_same_logprobs_and_gradient(tiny):
    """Tree rollouts: forks start as their parents do (prompt, then the parent's turns up to the branch point).
    In the shared_prefix layout with `parents` each shared token is computed once, and every trained token's
    log-prob and the gradient of a loss on them are those of computing each sequence alone (the unshared
    batch), within float tolerance."""
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    rng = random.Random(1)
    prompt = [rng.randrange(256) for _ in range(12)]
    root = [rng.randrange(256) for _ in range(30)]
    fork = root[:18] + [rng.randrange(256) for _ in range(9)]  # branched after 18 tokens
    fork_of_fork = fork[:24] + [rng.randrange(256) for _ in range(5)]
    other_root = [rng.randrange(256) for _ in range(20)]
    late = root[:25] + [rng.randrange(256) for _ in range(3)]  # a second fork of the root, later
    completions = [root, fork, fork_of_fork, other_root, late]
    parents = [None, 0, 1, None, 0]
    prompts = [prompt] * 5
    trained = [list(range(30)), list(range(18, 27)), list(range(24, 29)), list(range(20)), list(range(25, 28))]
    coef = [torch.randn(len(t)) for t in trained]

    def loss_and_grads(batches):
        lm.zero_grad()
        policy = PolicyLogProbs(lm, "full", chunk=64)
        got, total = {}, 0.0
        for mb in batches:
            logp = policy(mb.input_ids, mb.position_ids, mb.rows, mb.cols, mb.targets,
                          torch.ones(len(mb.targets)), attention_mask=mb.attention_mask)[0]  # fmt: skip
            for i, part in zip(mb.indices, logp.split(mb.completion_lengths)):
                got[i] = part.detach()
                total = total + (part * coef[i]).sum()
        total.backward()
        return got, {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}

    tree = micro_batches(prompts, completions, 4096, "shared_prefix", trained=trained, parents=parents)
    alone = micro_batches(prompts, completions, 4096, "padded", trained=trained)
    tree_logp, tree_grads = loss_and_grads(tree)
    alone_logp, alone_grads = loss_and_grads(alone)
    for i in range(5):
        torch.testing.assert_close(tree_logp[i], alone_logp[i], atol=1e-5, rtol=0)
    for name, grad in alone_grads.items():
        torch.testing.assert_close(tree_grads[name], grad, atol=1e-5, rtol=1e-4)
    # computed once: the prompt, the root, each fork's own tokens, the other root
    computed = sum(mb.n_tokens for mb in tree)
    assert computed == 12 + 30 + 9 + 5 + 20 + 3
    logical = sum(len(prompt) + len(c) for c in completions)
    assert computed / logical < 0.6
    # without parents each fork's completion is computed whole (behind a shared prompt where rows allow)
    flat = micro_batches(prompts, completions, 4096, "shared_prefix", trained=trained)
    assert sum(mb.n_tokens for mb in flat) >= 12 + sum(map(len, completions)) > computed


# ---- staleness and off-policy correction (the asynchronous pipeline) -----------------------


def test_lag_is_the_trainers_version_minus_the_generating_one_and_max_lag_drops(tiny):
    """Batch 5 trains version 4: samples of versions 4, 3, 2 have lags 0, 1, 2; max_lag 1 drops the last.
    The version-3 sample had version 4 swapped in under it from its second token: the token lag counts it."""
    learner = Learner(tiny, TrainConfig(lr=1e-3, max_lag=1))
    samples = group([GOOD, BAD, GOOD, BAD], [1.0, 0.0, 1.0, 0.0])
    samples = [s.model_copy(update={"policy_version": v}) for s, v in zip(samples, [4, 3, 2, None])]
    samples[1] = samples[1].model_copy(update={"version_changes": [(1, 4)]})
    assert samples[1].token_versions() == [3] + [4] * (samples[1].n_trained - 1)
    metrics = learner.train_batch(with_behaviour(learner, samples), batch_index=5)
    m = metrics[0]
    assert m["lag_mean"] == pytest.approx((0 + 1 + 2) / 3) and m["lag_max"] == 2  # by each sample's oldest token
    lags = [0] * samples[0].n_trained + [1] + [0] * (samples[1].n_trained - 1) + [2] * samples[2].n_trained
    assert m["lag_token_mean"] == pytest.approx(sum(lags) / len(lags))
    assert m["stale_dropped"] == 1 and m["samples"] == 3  # the unknown version is kept
    assert len(learner.turn_records) == 3


def test_a_batch_that_is_all_stale_takes_no_step(tiny):
    learner = Learner(tiny, TrainConfig(lr=1e-3, max_lag=0))
    samples = [s.model_copy(update={"policy_version": 0}) for s in group([GOOD, BAD], [1.0, 0.0])]
    before = params(learner)
    metrics = learner.train_batch(with_behaviour(learner, samples), batch_index=3)
    assert [m["stale_dropped"] for m in metrics] == [2] and "loss" not in metrics[0] and learner.step == 0
    assert all(torch.equal(before[k], v) for k, v in params(learner).items())


def test_tis_weight_is_the_capped_probability_ratio():
    from finetune.losses import tis_weights

    trainer = torch.log(torch.tensor([0.5, 0.2, 0.9, 0.3]))
    vllm = torch.log(torch.tensor([0.25, 0.4, 0.3, 0.3]))
    # p_trainer / p_vllm = 2, 0.5, 3, 1; capped at 2.5
    assert torch.allclose(tis_weights(trainer, vllm, 2.5), torch.tensor([2.0, 0.5, 2.5, 1.0]))


def test_mismatch_is_measured_on_the_first_step_over_lag_0_samples(tiny):
    """Behaviour log-probs 0.1 below the trainer's on lag-0 samples: |gap| 0.1, ratio e^0.1. A lag-1 sample
    with a wild gap is left out."""
    learner = Learner(tiny, TrainConfig(lr=1e-3, steps_per_epoch=1))
    samples = with_behaviour(learner, group([GOOD, BAD, [30, 31]], [1.0, 0.0, 1.0]))
    shifted = [
        s.model_copy(update={"behaviour_logprobs": [x - 0.1 for x in s.behaviour_logprobs], "policy_version": 2})
        for s in samples[:2]
    ]
    wild = samples[2].model_copy(
        update={"behaviour_logprobs": [x - 3 for x in samples[2].behaviour_logprobs], "policy_version": 1}
    )
    m = learner.train_batch(shifted + [wild], batch_index=3)[0]
    assert m["mismatch_abs_logp"] == pytest.approx(0.1, abs=1e-4)
    assert m["tis_ratio_mean"] == pytest.approx(torch.e**0.1, abs=1e-4)
    assert m["tis_ratio_max"] == pytest.approx(torch.e**0.1, abs=1e-4)


def test_tis_with_equal_logprobs_is_the_plain_step_and_a_cap_bounds_a_large_ratio(tiny):
    """Where vLLM and the trainer agree, every weight is 1: TIS changes nothing. Where vLLM gave the tokens
    far lower probability (ratio e^3), the ratio is taken against the trainer (1 at the first step) and the
    weight is the cap: the policy-gradient term is exactly twice the plain one."""
    base = Learner(tiny, TrainConfig(lr=1e-3, seed=1))
    tis = Learner(tiny, TrainConfig(lr=1e-3, seed=1, tis_cap=2.0))
    samples = with_behaviour(base, group([GOOD, BAD], [1.0, 0.0]))
    plain = base.train_batch(samples, 1)[0]
    assert tis.train_batch(samples, 1)[0]["pg_loss"] == pytest.approx(plain["pg_loss"], abs=1e-6)
    for k, v in params(base).items():
        assert torch.allclose(v, params(tis)[k], atol=1e-6), k
    far = [s.model_copy(update={"behaviour_logprobs": [x - 3 for x in s.behaviour_logprobs]}) for s in samples]
    capped = Learner(tiny, TrainConfig(lr=1e-3, seed=1, tis_cap=2.0))
    m = capped.train_batch(far, 1)[0]
    assert m["tis_ratio_max"] == pytest.approx(torch.e**3, rel=1e-3)  # the measured ratio, before the cap
    assert plain["pg_loss"] != 0 and m["pg_loss"] == pytest.approx(2.0 * plain["pg_loss"], rel=1e-4)


def test_loss_metrics_report_the_mismatch_only_where_measured_and_per_token_means_per_token():
    from finetune.tally import StepSums, loss_metrics

    def sums(**mismatch) -> StepSums:
        return StepSums(base={"loss": 2.0, "entropy": 8.0, "tokens": 9.0, "slots": 12.0}, terms={"pg_loss": 1.5},
                        token_sums={"clip_frac": 2.0}, extremes={"ratio": (1.5, 0.5), "tis_ratio": (3.0, math.inf)},
                        **({"mismatch": mismatch} if mismatch else {}))  # fmt: skip

    later = loss_metrics(sums(), n_completion=4)  # not the batch's first step: nothing measured
    assert later == {"loss": 2.0, "entropy": 2.0, "clip_frac": 0.5, "pg_loss": 1.5, "ratio_max": 1.5, "ratio_min": 0.5}
    first = loss_metrics(sums(abs=0.4, ratio=5.0, n=4.0), n_completion=4)
    assert first["mismatch_abs_logp"] == 0.1 and first["tis_ratio_mean"] == 1.25 and first["tis_ratio_max"] == 3.0
    assert "tis_ratio_min" not in first


def test_the_step_line_shows_the_terms_a_loss_reports():
    """finetune.train's line per step: grpo's terms as before (the known ones, in their order and format);
    a term it does not know (PPO's value_loss) follows them; one a loss does not report is not asked for."""
    from finetune.train import _step_line

    m = {"batch": 3, "step": 7, "epoch": 1, "loss": 0.25, "pg_loss": 0.2, "kl": 0.01, "entropy": 2.5,
         "clip_frac": 0.125, "ratio_mean": 1.0, "ratio_min": 0.9, "ratio_max": 1.1, "value_loss": 0.5,
         "vf_clip_frac": 0.0, "grad_norm": 1.5, "lr": 1e-6, "tokens_per_s": 1234.4, "micro_batches": 2,
         "seconds": 0.75}  # fmt: skip
    grpo = ["kl", "pg_loss", "clip_frac", "ratio_mean", "ratio_max", "ratio_min"]  # as loss_terms names them
    tail = "grad_norm 1.500 lr 1e-06 1234 tok/s (2 micro-batches, 0.8 s)"
    assert _step_line(m, grpo) == (
        "batch 3 step 7 (epoch 1): loss 0.2500 pg 0.2000 kl 0.0100 entropy 2.500 clip 0.125 ratio 1.0000 "
        f"[0.9000, 1.1000] {tail}"
    )
    assert _step_line(m, [*grpo, "value_loss", "vf_clip_frac"]).endswith(
        f"ratio 1.0000 [0.9000, 1.1000] value_loss 0.5 vf_clip_frac 0 {tail}"
    )
    assert _step_line(m, ["pg_loss"]) == f"batch 3 step 7 (epoch 1): loss 0.2500 pg 0.2000 entropy 2.500 {tail}"


# ---- LoRA ---------------------------------------------------------------------------------------


def test_lora_trains_only_the_adapters_and_publishes_the_merged_policy(tiny, tmp_path):
    """--train.lora.rank: peft's adapters on every linear layer but the head; the base stays frozen, the
    optimizer holds only the adapters, and the published model folder (what vLLM loads) is the merged
    policy: transformers scores a sample on it exactly as the learner does."""
    cfg = TrainConfig(lr=1e-2, lora={"rank": 4})
    learner = Learner(tiny, cfg)
    lm = learner.accelerator.unwrap_model(learner.model).lm
    trainable = {n for n, p in lm.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimized = sum(p.numel() for g in learner.optimizer.param_groups for p in g["params"])
    assert optimized == sum(p.numel() for n, p in lm.named_parameters() if n in trainable)
    assert optimized < sum(p.numel() for p in lm.parameters()) / 10

    frozen = {n: p.detach().clone() for n, p in lm.named_parameters() if not p.requires_grad}
    batch = with_behaviour(learner, group([GOOD, BAD] + OTHER, [1.0, 0.0, 0.0, 0.5]))
    before = learner.logprobs(batch)
    learner.train_batch(batch, 0)
    assert all(torch.equal(p, frozen[n]) for n, p in lm.named_parameters() if not p.requires_grad)
    after = learner.logprobs(batch)
    assert not torch.allclose(before[0], after[0]), "the adapters did not move the policy"

    # the adapter folder the servers load: peft puts it on the base model and scores as the learner does
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = learner.save_adapter(tmp_path / "adapter", learner.adapter_weights())
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), folder)
    peft_learner = Learner(tiny, TrainConfig())
    peft_learner.accelerator.unwrap_model(peft_learner.model).lm = on_base.merge_and_unload()
    for a, b in zip(after, peft_learner.logprobs(batch)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)

    weights = learner.policy_weights()  # merged: what `orchestrate.after.merge` writes
    assert not any("lora" in k or "base_layer" in k for k in weights)
    learner.save_weights(tmp_path / "merged", weights)
    merged = Learner(tmp_path / "merged", TrainConfig())
    for a, b in zip(after, merged.logprobs(batch)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_lora_refuses_modules_the_model_does_not_have(tiny):
    with pytest.raises(ValueError, match="lora.target_modules: qkv_proj is not a linear module inside the model's "
                       "layers; those are down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"):  # fmt: skip
        Learner(tiny, TrainConfig(lora={"rank": 2, "target_modules": ["q_proj", "qkv_proj"]}))
    with pytest.raises(ValueError, match="lm_head is not a linear module inside the model's layers"):
        Learner(tiny, TrainConfig(lora={"rank": 2, "target_modules": ["lm_head"]}))


def test_lora_resumes_exactly_from_its_trainer_state(tiny, tmp_path):
    """A LoRA learner restored from its trainer state takes the same next step as the one that saved it."""
    cfg = TrainConfig(lr=1e-2, lora={"rank": 2, "alpha": 4, "target_modules": "q_proj,v_proj"})
    learner = Learner(tiny, cfg)
    batch = with_behaviour(learner, group([GOOD, BAD] + OTHER, [1.0, 0.0, 0.0, 0.5]))
    learner.train_batch(batch, 0)
    learner.save_trainer_state(tmp_path / "ck", {"batch": 0})
    # the state holds the adapters and their optimizer state, not the frozen base
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ck" / "trainer_state" / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved) and len(saved) == 2 * 2 * 2  # 2 layers
    with pytest.raises(ValueError, match="holds other trainable weights than this learner's LoRA options"):
        Learner(tiny, TrainConfig(lr=1e-2, lora={"rank": 4, "target_modules": "q_proj,v_proj"})).load_trainer_state(
            tmp_path / "ck"
        )
    resumed = Learner(tiny, cfg)
    assert resumed.load_trainer_state(tmp_path / "ck")["batch"] == 0 and resumed.step == 1
    learner.train_batch(batch, 1)
    resumed.train_batch(batch, 1)
    a, b = params(learner), params(resumed)
    assert any("lora_A" in name for name in a)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-7, rtol=0)


def test_an_adapter_that_does_not_fit_the_base_is_refused(tiny, tmp_path, capsys):
    """orchestrate.after.merge checks the adapter's layers and shapes against the base before it writes anything."""
    from finetune.learner import Learner
    from finetune.tiny_model import make_tiny_model
    from orchestrate.after import merge

    learner = Learner(tiny, TrainConfig(lora={"rank": 2}))
    adapter = learner.save_adapter(tmp_path / "adapter", learner.adapter_weights())
    wider = make_tiny_model(tmp_path / "wider", hidden_size=128, num_layers=2)
    capsys.readouterr()  # the building's progress bars
    assert merge.main([str(adapter), "--model", str(wider), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the adapter does not fit the base model: the adapter's base_model.model.model.") and (
        "does not fit model.layers.0." in err
    ), err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_lora_starts_from_an_adapter_folder_and_refuses_one_of_another_rank(tiny, tmp_path):
    """lora.start_from (orchestrate.after.offline --model ADAPTER): the adapters start as the folder's, so the
    learner scores as the one that wrote it; a folder of another rank is refused, naming what differs."""
    from contract.adapters import adapter_options

    cfg = TrainConfig(lr=1e-2, lora={"rank": 2, "alpha": 8, "target_modules": "q_proj,v_proj"})
    learner = Learner(tiny, cfg)
    batch = with_behaviour(learner, group([GOOD, BAD] + OTHER, [1.0, 0.0, 0.0, 0.5]))
    learner.train_batch(batch, 0)
    folder = learner.save_adapter(tmp_path / "adapter", learner.adapter_weights())
    options = adapter_options(folder)
    assert options == {"rank": 2, "alpha": 8.0, "dropout": 0.0, "start_from": str(folder.resolve()),
                       "target_modules": ["q_proj", "v_proj"]}  # fmt: skip
    fresh = Learner(tiny, TrainConfig(lr=1e-2, lora={"rank": 2, "alpha": 8, "target_modules": "q_proj,v_proj"}))
    continued = Learner(tiny, TrainConfig(lr=1e-2, lora=options))
    trained, before, after = learner.logprobs(batch), fresh.logprobs(batch), continued.logprobs(batch)
    assert not torch.allclose(trained[0], before[0])
    for a, b in zip(trained, after):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"lora.start_from: .*adapter's base_model.model.model.layers.0.self_attn."
                       r"q_proj.lora_A.weight is \[2, 64\], these lora options make it \[4, 64\]"):  # fmt: skip
        Learner(tiny, TrainConfig(lora={**options, "rank": 4}))
    with pytest.raises(ValueError, match=r"lora.start_from: .* does not fit .*k_proj.* is only in these lora options"):
        Learner(tiny, TrainConfig(lora={**options, "target_modules": ["q_proj", "k_proj", "v_proj"]}))


@pytest.mark.parametrize(
    "options",
    [{}, {"lora": {"rank": 2, "target_modules": "q_proj,v_proj"}}, {"algorithm": "ppo", "ppo": {"critic_lr": 1e-3}}],
    ids=["full", "lora", "ppo-critic-model"],
)
def test_a_state_written_in_the_background_is_the_state_taken(tiny, tmp_path, options):
    """stage_trainer_state (TrainConfig.async_state): what a thread writes while the learner trains on is what
    save_trainer_state writes at the moment of the copy, file for file, and a learner restored from it takes
    the same next step. The PPO learner has two models and two optimizers; the tiny model a tied head."""
    import threading

    from safetensors.torch import load_file

    cfg = TrainConfig(lr=1e-3, async_state="on", **options)
    learner = Learner(tiny, cfg)
    batch = with_behaviour(learner, group([GOOD, BAD] + OTHER, [1.0, 0.0, 0.0, 0.5]))
    learner.train_batch(batch, 0)
    learner.save_trainer_state(tmp_path / "now", {"batch": 0})
    write = learner.stage_trainer_state(tmp_path / "later", {"batch": 0})
    learner.train_batch(batch, 1)  # the live weights and AdamW moments move on before the copy is written
    thread = threading.Thread(target=write)
    thread.start()
    thread.join()
    now, later = tmp_path / "now" / "trainer_state", tmp_path / "later" / "trainer_state"
    assert sorted(p.name for p in later.iterdir()) == sorted(p.name for p in now.iterdir())
    assert [p.name for p in (tmp_path / "later").iterdir()] == ["trainer_state"]  # nothing else left behind
    for file in now.iterdir():
        if file.suffix == ".safetensors":
            a, b = load_file(file), load_file(later / file.name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), file.name
        elif file.suffix in (".bin", ".pkl"):
            a, b = torch.load(file, weights_only=False), torch.load(later / file.name, weights_only=False)
            assert repr(a) == repr(b), file.name  # tensors, RNG states and step counts alike
        else:
            assert file.read_bytes() == (later / file.name).read_bytes(), file.name
    resumed = Learner(tiny, cfg)
    assert resumed.load_trainer_state(tmp_path / "later")["batch"] == 0 and resumed.step == learner.step // 2
    resumed.train_batch(batch, 1)
    a, b = params(learner), params(resumed)
    assert not all(torch.equal(a[k], params(Learner(tiny, cfg))[k]) for k in a)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-7, rtol=0)


def test_auto_writes_the_state_in_the_background_on_cuda_when_its_copy_fits(tiny, monkeypatch):
    """TrainConfig.async_state auto: off on CPU; on CUDA, on while the copy (trained weights and AdamW's two
    moments, 3 x 4 bytes a parameter) takes at most half the host memory available; on and off as asked."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    import finetune.trainer_state

    learner = Learner(tiny, TrainConfig())
    assert learner.writes_state_in_background is False and "not on CUDA" in learner.background_state_why
    assert Learner(tiny, TrainConfig(async_state="on")).writes_state_in_background is True
    copy = 3 * 4 * sum(p.numel() for p in learner.model.parameters())
    monkeypatch.setattr(learner.models, "accelerator", SimpleNamespace(device=torch.device("cuda"),
                                                                       distributed_type=DistributedType.NO))  # fmt: skip
    monkeypatch.setattr(finetune.trainer_state, "host_memory_available", lambda: 2 * copy)
    assert learner.background_state_choice()[0] is True
    monkeypatch.setattr(finetune.trainer_state, "host_memory_available", lambda: 2 * copy - 1)
    on, why = learner.background_state_choice()
    assert on is False and "more than half the host memory available" in why
    learner.accelerator.distributed_type = DistributedType.FSDP
    assert learner.background_state_choice() == (False, "auto: FSDP saves its sharded state itself")
