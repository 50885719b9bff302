"""The advantage estimators (finetune/estimators.py) and the newer losses and loss options (gspo, the entropy
bonus, DAPO's overlong shaping and filtering) against numbers worked out by hand; every registered name in
--help, an unknown one refused."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.config import TrainConfig
from finetune.estimators import ESTIMATORS, overlong_penalty, turn_advantages
from finetune.losses import LOSSES, LossInputs, token_weights

ROOT = Path(__file__).resolve().parent.parent

# two groups of one-turn episodes: a = [1, 0], b = [2, -1, -1] (as tests/test_finetune_losses.py)
TURNS = [[(0, 1.0)], [(0, 0.0)], [(0, 2.0)], [(0, -1.0)], [(0, -1.0)]]
EPISODES = ["e0", "e1", "e2", "e3", "e4"]
GROUPS = ["a", "a", "b", "b", "b"]


def test_every_name_is_registered_once_with_a_paper():
    assert {"group", "batch", "none", "rloo", "reinforce_pp"} <= set(ESTIMATORS)  # and any registered since
    assert {"grpo", "reinforce", "gspo", "ppo"} <= set(LOSSES)
    for spec in [*ESTIMATORS.values(), *LOSSES.values()]:
        assert spec.doc and spec.paper, spec.name


def test_rloo_subtracts_the_mean_of_the_others_by_hand():
    # a: 1 - 0 = 1, 0 - 1 = -1
    # b: 2 - (-1 + -1) / 2 = 3;  -1 - (2 + -1) / 2 = -1.5 (twice)
    # a lone episode (group c) has no others: 0
    _, adv = turn_advantages(TURNS + [[(0, 5.0)]], EPISODES + ["e5"], GROUPS + ["c"], "rloo")
    assert adv == [[1.0], [-1.0], [3.0], [-1.5], [-1.5], [0.0]]
    # RLOO is n / (n - 1) x the mean-only (Dr. GRPO) group advantage, and ignores normalize_std
    _, drgrpo = turn_advantages(TURNS, EPISODES, GROUPS, "group", normalize_std=False)
    n = [2, 2, 3, 3, 3]
    assert [a[0] for a in adv[:5]] == pytest.approx([k / (k - 1) * d[0] for k, d in zip(n, drgrpo)], abs=1e-6)
    assert turn_advantages(TURNS, EPISODES, GROUPS, "rloo", normalize_std=True)[1] == adv[:5]


def test_rloo_gives_every_turn_of_an_episode_its_advantage():
    # episode x: rewards 0, 1 with gamma 0.5 -> G_0 = 0.5; episode y: G_0 = 0 -> A_x = 0.5, A_y = -0.5
    _, adv = turn_advantages([[(0, 0.0), (1, 1.0)], [(0, 0.0)]], ["x", "y"], ["g", "g"], "rloo", gamma=0.5)
    assert adv == [[0.5, 0.5], [-0.5]]


def test_reinforce_pp_normalises_over_the_batchs_tokens_by_hand():
    # returns [1, 0] over 3 and 1 tokens: token mean (3 x 1 + 0) / 4 = 0.75
    # token std (n - 1 = 3): sqrt((3 x 0.25^2 + 0.75^2) / 3) = sqrt(0.75 / 3) = 0.5
    # -> (1 - 0.75) / 0.5 = 0.5, (0 - 0.75) / 0.5 = -1.5  (batch, over turns, would give +-0.70711)
    turns, episodes, groups = [[(0, 1.0)], [(0, 0.0)]], ["p", "q"], ["g1", "g2"]
    _, adv = turn_advantages(turns, episodes, groups, "reinforce_pp", lengths=[[3], [1]])
    assert adv == [[pytest.approx(0.5, abs=1e-5)], [pytest.approx(-1.5, abs=1e-5)]]
    _, batch = turn_advantages(turns, episodes, groups, "batch")
    assert batch == [[pytest.approx(0.70711, abs=1e-5)], [pytest.approx(-0.70711, abs=1e-5)]]
    # mean only: 0.25, -0.75
    _, mean_only = turn_advantages(turns, episodes, groups, "reinforce_pp", normalize_std=False, lengths=[[3], [1]])
    assert mean_only == [[0.25], [-0.75]]
    with pytest.raises(ValueError, match="token counts"):
        turn_advantages(turns, episodes, groups, "reinforce_pp")


def test_an_unknown_estimator_is_refused():
    with pytest.raises(ValueError, match="rloo"):
        turn_advantages(TURNS, EPISODES, GROUPS, "loo")
    with pytest.raises(ValueError, match="unknown advantage estimator 'loo'"):
        TrainConfig(estimator="loo")


def test_overlong_penalty_is_dapos_eq_13_by_hand():
    # max_tokens 100, buffer 20: no penalty up to 80 tokens, then (80 - L) / 20, -1 at 100
    assert overlong_penalty(80, 100, 20) == 0.0
    assert overlong_penalty(90, 100, 20) == -0.5
    assert overlong_penalty(100, 100, 20) == -1.0
    assert overlong_penalty(101, 100, 20) == -1.0  # an end-of-turn token appended after the limit
    assert overlong_penalty(95, 100, 20, penalty=0.4) == pytest.approx(-0.3)  # 0.75 x 0.4
    assert overlong_penalty(100, 100, 0) == 0.0  # buffer 0: off


def test_the_sampling_limit_has_one_owner_recorded_on_every_turn(rl_cli, tmp_path):
    """rollouts.max_tokens is the limit; each turn of a batch carries it and whether its output was cut (the
    call's finish reason), so the learner reads them; the learner has no option of its own for it."""
    from orchestrate.loop.command_line import resolve
    from orchestrate.loop.config_checks import ConfigError
    from orchestrate.loop.samples import tape_samples
    from tapes.tape import EnvAction, EnvObservation, LLMCall, SamplingParams, Tape

    tape = Tape()
    for turn, finish in ((1, "length"), (2, "stop")):
        call = LLMCall(prompt_token_ids=[1, 2] if turn == 1 else [1, 2, 3, 4, 5, 6], output_token_ids=[3, 4],
                       logprobs=[-1.0, -1.0], turn=turn, finish_reason=finish, sampling=SamplingParams(max_tokens=2))  # fmt: skip
        tape.append(EnvAction(text="x", turn=turn), llm_call=call)
        tape.append(EnvObservation(text="y", turn=turn, reward=float(turn - 1), terminated=turn == 2))
    tape.metadata.reward, tape.metadata.turns = 1.0, 2
    (sample,) = tape_samples(tape, require_ref=False)
    assert [(t["truncated"], t["max_tokens"]) for t in sample["turns"]] == [(True, 2), (False, 2)]
    assert resolve("embedded", {"train.overlong_buffer": "8"}).train.overlong_buffer == 8
    with pytest.raises(
        ConfigError, match="^--train.overlong_buffer: 200 tokens is more than --rollouts.max_tokens 128"
    ):
        resolve("embedded", {"train.overlong_buffer": "200"})
    code, line = rl_cli(["--run-dir", tmp_path / "r", "--train.max_tokens", "96"])
    assert code == 2 and "unrecognized arguments: --train.max_tokens" in line, line
    # a turn that records no limit (a one-turn sample without turns) cannot be shaped: refused, naming the field
    with pytest.raises(ValueError, match=r"turns\[\]\.max_tokens"):
        TrainConfig(overlong_buffer=4).shaped_reward(1.0, 10, None)


# ---- gspo ------------------------------------------------------------------------------------


def test_gspo_clips_the_length_normalised_sequence_ratio_by_hand():
    # two sequences, 2 and 1 tokens; logp - behaviour per token: [0.2, 0.0] and [-0.5]
    #   s0 = exp((0.2 + 0.0) / 2) = exp(0.1) = 1.10517, inside [0.8, 1.28]: loss per token -1 x 1.10517
    #   s1 = exp(-0.5) = 0.60653 < 0.8 with A = -1: min(-0.60653, -0.8) = -0.8, clipped: loss +0.8
    # sequence aggregation: weights 1 / (2 x 2) on s0's tokens, 1 / (2 x 1) on s1's
    #   loss = 2 x 0.25 x (-1.10517) + 0.5 x 0.8 = -0.55259 + 0.4 = -0.15259
    # gradient: s0's tokens 0.25 x (-1) x s0 = -0.27629 each (d s_it / d logp_t = s0); s1 clipped: 0
    behaviour = torch.tensor([-1.0, -2.0, -0.3], dtype=torch.float64)
    logp = (behaviour + torch.tensor([0.2, 0.0, -0.5], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    spec = LOSSES["gspo"]
    x = LossInputs(
        logp=logp,
        behaviour_logp=behaviour,
        advantages=adv,
        weights=token_weights([2, 1], "sequence").double(),
        lengths=[2, 1],
    )
    out = spec.fn(x, spec.config(clip_eps_low=0.2, clip_eps_high=0.28))
    assert out.loss.item() == pytest.approx(-0.15259, abs=1e-5)
    assert out.token_means["clip_frac"].tolist() == [0.0, 0.0, 1.0]
    assert out.token_extremes["ratio"].tolist() == pytest.approx([math.exp(0.1)] * 2 + [math.exp(-0.5)], abs=1e-9)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert grad.tolist() == pytest.approx([-0.25 * math.exp(0.1)] * 2 + [0.0], abs=1e-9)


def test_gspo_defaults_are_the_papers_clip_range():
    options = TrainConfig(algorithm="gspo").loss_options
    assert (options.clip_eps_low, options.clip_eps_high) == (3e-4, 4e-4)


# ---- entropy bonus ---------------------------------------------------------------------------


def test_entropy_bonus_is_subtracted_from_the_loss_by_hand():
    # zero advantages: the policy term is 0; entropy [1, 2], token weights 0.5 each, coef 0.1
    #   loss = -0.1 x (0.5 x 1 + 0.5 x 2) = -0.15; d loss / d entropy = -0.1 x 0.5 = -0.05 per token
    entropy = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    for name in ("grpo", "reinforce", "gspo"):
        spec = LOSSES[name]
        x = LossInputs(
            logp=logp,
            behaviour_logp=logp.detach(),
            advantages=torch.zeros(2, dtype=torch.float64),
            weights=torch.tensor([0.5, 0.5], dtype=torch.float64),
            lengths=[1, 1],
            entropy=entropy,
            entropy_coef=0.1,
        )
        out = spec.fn(x, spec.config())
        assert out.loss.item() == pytest.approx(-0.15), name
        (grad,) = torch.autograd.grad(out.loss, entropy)
        assert grad.tolist() == pytest.approx([-0.05, -0.05]), name


def test_fused_entropy_gradient_equals_plain_autograd():
    from finetune.logprobs import head_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 40, (9,))
    inv_temp = torch.rand(9, dtype=torch.float64) + 0.5
    coef, ent_coef = torch.randn(9, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    logp, _, entropy = head_logprobs(hidden, weight, targets, inv_temp, chunk=4, entropy_grad=True)
    g_fused = torch.autograd.grad((logp * coef).sum() + (entropy * ent_coef).sum(), (hidden, weight))
    logps = torch.log_softmax((hidden @ weight.T) * inv_temp[:, None], -1)
    ref = logps.gather(1, targets[:, None]).squeeze(1)
    ref_entropy = -(logps.exp() * logps).sum(-1)
    g_ref = torch.autograd.grad((ref * coef).sum() + (ref_entropy * ent_coef).sum(), (hidden, weight))
    for a, b in zip(g_fused, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # the head works in fp32
    # without entropy_grad the entropy stays out of the graph
    assert not head_logprobs(hidden, weight, targets, inv_temp, chunk=4)[2].requires_grad


# ---- through the learner ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from finetune.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _samples(learner, completions, rewards, limit=4):
    """One-turn samples sampled with `limit` new tokens: an output of `limit` tokens was cut by it."""
    from contract.batch import Sample, Turn

    samples = [
        Sample(prompt_ids=[40, 41, 42], completion_ids=c, behaviour_logprobs=[0.0] * len(c), reward=r, group_id="g",
               turns=[Turn(index=0, start=0, length=len(c), reward=r, truncated=len(c) == limit, max_tokens=limit)])
        for c, r in zip(completions, rewards)
    ]  # fmt: skip
    return [
        s.model_copy(update={"behaviour_logprobs": lp.tolist()}) for s, lp in zip(samples, learner.logprobs(samples))
    ]


def test_overlong_shaping_and_filtering_in_the_learner(tiny):
    from finetune.learner import Learner

    # the calls' limit 4, buffer 2: outputs of 2, 3, 4 tokens lose 0, 0.5, 1 of their reward 1 -> 1, 0.5, 0
    # (group mean 0.5: advantages (+0.5, 0, -0.5) / sample std 0.5 = +1, 0, -1)
    learner = Learner(tiny, TrainConfig(lr=1e-3, estimator="group", overlong_buffer=2))
    batch = _samples(learner, [[10, 11], [12, 13, 14], [15, 16, 17, 18]], [1.0, 1.0, 1.0])
    (m,) = learner.train_batch(batch)
    turns = [c["turns"][0] for c in learner.turn_records]
    assert [t["overlong_penalty"] for t in turns] == [0.0, -0.5, -1.0]
    assert [t["return"] for t in turns] == [1.0, 0.5, 0.0]
    assert [t["advantage"] for t in turns] == pytest.approx([1.0, 0.0, -1.0], abs=1e-5)
    # filtering: the 4-token output (cut by the limit: its finish reason) counts in the baseline, is not trained on
    learner = Learner(tiny, TrainConfig(lr=1e-3, overlong_filter=True))
    batch = _samples(learner, [[10, 11], [12, 13, 14], [15, 16, 17, 18]], [1.0, 0.0, 0.0])
    (m,) = learner.train_batch(batch)
    assert m["overlong_masked"] == 1 and m["samples"] == 2 and m["completion_tokens"] == 5
    assert len(learner.turn_records) == 3


def test_an_entropy_bonus_step_raises_the_entropy(tiny):
    from finetune.learner import Learner

    # equal rewards: advantages 0, so the only gradient is the entropy bonus's
    learner = Learner(tiny, TrainConfig(lr=1e-4, entropy_coef=1.0))
    batch = _samples(learner, [[10, 11, 12], [20, 21]], [0.5, 0.5])
    first = learner.train_batch(batch)[0]
    second = learner.train_batch(batch, batch_index=1)[0]
    assert first["grad_norm"] > 0 and second["entropy"] > first["entropy"]


# ---- the command line ------------------------------------------------------------------------


def test_help_lists_every_estimator_and_loss_and_an_unknown_name_is_refused():
    run = [sys.executable, "-m", "finetune.train"]
    wide = {**os.environ, "COLUMNS": "100000"}  # argparse wraps at the terminal's width (and breaks at hyphens)
    out = subprocess.run([*run, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=wide)
    assert out.returncode == 0, out.stderr[-2000:]
    text = " ".join(out.stdout.split())
    for name, spec in [*ESTIMATORS.items(), *LOSSES.items()]:
        assert f"{name}: {spec.doc.rstrip('.')} ({spec.paper})" in text, name
    for option in ("--entropy-coef", "--overlong-buffer", "--overlong-penalty", "--overlong-filter"):
        assert option in text
    for option, value in (("--estimator", "loo"), ("--algorithm", "gspo2")):
        bad = subprocess.run(
            [*run, "--model", "m", "--run-dir", "r", "--print-config", option, value],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode == 2
        last = bad.stderr.strip().splitlines()[-1]
        assert option in last and repr(value) in last, bad.stderr
