"""The losses of finetune/losses.py against numbers worked out by hand.

The fixed batch: two groups, five completions, seven completion tokens.

    group a: rewards [1, 0]       mean 0.5, deviations +-0.5,
             sample std = sqrt((0.25 + 0.25) / 1) = 0.70711 -> advantages +-0.70711
    group b: rewards [2, -1, -1]  mean 0, deviations [2, -1, -1],
             sample std = sqrt((4 + 1 + 1) / 2) = sqrt(3) = 1.73205
             -> advantages [1.15470, -0.57735, -0.57735]

    completion lengths [2, 1, 1, 2, 1]; per token (sequence: advantage A, ratio):
      t0 (s0, A=+0.70711, 1.5)  clipped above 1 + 0.28: loss -1.28 * 0.70711 = -0.90510
      t1 (s0, A=+0.70711, 1.1)  inside:                 loss -1.1  * 0.70711 = -0.77782
      t2 (s1, A=-0.70711, 0.5)  clipped below 1 - 0.2:  loss -0.8  * -0.70711 = +0.56569
      t3 (s2, A=+1.15470, 1.0)  inside:                 loss -1.0  * 1.15470 = -1.15470
      t4 (s3, A=-0.57735, 1.3)  above 1.28 but A < 0, so min() keeps 1.3:  +0.75056
      t5 (s3, A=-0.57735, 0.9)  inside:                 loss +0.9  * 0.57735 = +0.51962
      t6 (s4, A=-0.57735, 0.7)  clipped below 0.8:      loss +0.8  * 0.57735 = +0.46188
    token mean    = (-0.90510 - 0.77782 + 0.56569 - 1.15470 + 0.75056 + 0.51962 + 0.46188) / 7
                  = -0.53987 / 7 = -0.077124
    sequence mean = (-0.84146 + 0.56569 - 1.15470 + 0.63509 + 0.46188) / 5 = -0.33350 / 5 = -0.066700
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from contract.kl import k3
from finetune.estimators import group_advantages
from finetune.losses import (
    LOSSES,
    LossInputs,
    grpo_token_loss,
    reinforce_token_loss,
    token_weights,
)


def policy_loss(
    algorithm,
    logp,
    behaviour,
    adv,
    weights,
    ref_logp=None,
    kl_coef=0.0,
    clip_eps_low=0.2,
    clip_eps_high=0.2,
    kl_logp=None,
):
    """The registered loss through its typed inputs and outputs: (loss, its weighted terms)."""
    spec = LOSSES[algorithm]
    options = spec.config(
        **(
            {"clip_eps_low": clip_eps_low, "clip_eps_high": clip_eps_high}
            if "clip_eps_low" in spec.config.model_fields
            else {}
        )
    )
    out = spec.fn(
        LossInputs(
            logp=logp,
            behaviour_logp=behaviour,
            advantages=adv,
            weights=weights,
            ref_logp=ref_logp,
            kl_logp=kl_logp,
            kl_coef=kl_coef,
        ),
        options,
    )
    return out.loss, out.terms


REWARDS = [1.0, 0.0, 2.0, -1.0, -1.0]
GROUPS = [0, 0, 1, 1, 1]
LENGTHS = [2, 1, 1, 2, 1]
SEQ_OF_TOKEN = [0, 0, 1, 2, 3, 3, 4]
RATIOS = [1.5, 1.1, 0.5, 1.0, 1.3, 0.9, 0.7]
BEHAVIOUR = [-1.0, -2.0, -0.5, -1.5, -0.3, -2.2, -0.8]
REF_MINUS_LOGP = [0.5, -0.2, 0.0, 0.1, -0.4, 0.3, 0.2]
EPS_LOW, EPS_HIGH = 0.2, 0.28

ADV_BY_HAND = [0.70711, -0.70711, 1.15470, -0.57735, -0.57735]


def tensors():
    logp = torch.tensor([b + math.log(r) for b, r in zip(BEHAVIOUR, RATIOS)], dtype=torch.float64, requires_grad=True)
    behaviour = torch.tensor(BEHAVIOUR, dtype=torch.float64)
    ref = logp.detach() + torch.tensor(REF_MINUS_LOGP, dtype=torch.float64)
    adv = torch.tensor(ADV_BY_HAND, dtype=torch.float64)[SEQ_OF_TOKEN]
    return logp, behaviour, ref, adv


def test_group_advantages_by_hand():
    adv = group_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS))
    assert adv.tolist() == pytest.approx(ADV_BY_HAND, abs=1e-4)
    # Dr. GRPO: deviations from the group mean only.
    drgrpo = group_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), normalize_std=False)
    assert drgrpo.tolist() == pytest.approx([0.5, -0.5, 2.0, -1.0, -1.0], abs=1e-6)


def test_equal_rewards_give_exactly_zero_advantage():
    # 0.1 is not exact in binary: (0.1 - mean) could be 1e-17, and / (0 + eps) would blow it up.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 5.0])
    groups = torch.tensor([7, 7, 7, 3, 3, 9])  # group 9 has a single sample
    adv = group_advantages(rewards, groups)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[5].item() == 0.0
    assert adv[3].item() > 0 > adv[4].item()


def test_zero_advantage_gives_zero_policy_gradient():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = group_advantages(torch.tensor([0.3, 0.3, 0.3]), torch.tensor([0, 0, 0]))
    for algorithm in ("grpo", "reinforce"):
        loss, _ = policy_loss(algorithm, logp, logp.detach() - 0.1, adv, token_weights([3], "token"))
        (grad,) = torch.autograd.grad(loss, logp)
        assert grad.abs().max().item() == 0.0


def test_grpo_clip_by_hand():
    logp, behaviour, _, adv = tensors()
    loss, ratio, clipped = grpo_token_loss(logp, behaviour, adv, EPS_LOW, EPS_HIGH)
    expected = [-0.90510, -0.77782, 0.56569, -1.15470, 0.75056, 0.51962, 0.46188]
    assert loss.tolist() == pytest.approx(expected, abs=1e-4)
    assert ratio.tolist() == pytest.approx(RATIOS, abs=1e-9)
    assert clipped.tolist() == [True, False, True, False, False, False, True]
    # Clipped tokens give no gradient; the others give -ratio * A (d ratio / d logp = ratio).
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    for t in range(7):
        want = 0.0 if clipped[t] else -RATIOS[t] * ADV_BY_HAND[SEQ_OF_TOKEN[t]]
        assert grad[t].item() == pytest.approx(want, abs=1e-4)


def test_dual_clip_bounds_a_negative_advantage_by_hand():
    # A = -1 and -2 at ratios 5 and 1.5; A = +1 at ratio 5. With c = 3: the first loses min(5, 3) = 3, no
    # gradient; the second 1.5 x 2 = 3 < 6, unchanged; a positive advantage is the upper clip's (1.2 x -1)
    logp = torch.log(torch.tensor([5.0, 1.5, 5.0], dtype=torch.float64)).requires_grad_()
    behaviour = torch.zeros(3, dtype=torch.float64)
    adv = torch.tensor([-1.0, -2.0, 1.0], dtype=torch.float64)
    loss, _, clipped = grpo_token_loss(logp, behaviour, adv, 0.2, 0.2, dual_clip=3.0)
    assert loss.tolist() == pytest.approx([3.0, 3.0, -1.2]) and clipped.tolist() == [True, False, True]
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert grad.tolist() == pytest.approx([0.0, 3.0, 0.0])  # d(-ratio x A)/d logp = -ratio x A = 3 for the second
    plain, _, _ = grpo_token_loss(logp, behaviour, adv, 0.2, 0.2)
    assert plain.tolist() == pytest.approx([5.0, 3.0, -1.2])  # without it: 5, unbounded in the ratio


def test_grpo_aggregations_by_hand():
    logp, behaviour, _, adv = tensors()
    token_w = token_weights(LENGTHS, "token").double()
    assert token_w.tolist() == pytest.approx([1 / 7] * 7)
    loss, stats = policy_loss("grpo", logp, behaviour, adv, token_w, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH)
    assert loss.item() == pytest.approx(-0.53987 / 7, abs=1e-5)
    assert stats["pg_loss"].item() == pytest.approx(loss.item())

    seq_w = token_weights(LENGTHS, "sequence").double()
    # each sequence weighs 1/5, shared by its tokens: s0 and s3 have 2 tokens -> 1/10 each
    assert seq_w.tolist() == pytest.approx([0.1, 0.1, 0.2, 0.2, 0.1, 0.1, 0.2])
    loss, _ = policy_loss("grpo", logp, behaviour, adv, seq_w, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH)
    assert loss.item() == pytest.approx(-0.33350 / 5, abs=1e-5)


def test_kl_k3_by_hand():
    # k3 = exp(d) - d - 1 with d = ref - logp
    #   d=0.5: 1.648721 - 1.5 = 0.148721;  d=-0.2: 0.818731 + 0.2 - 1 = 0.018731;  d=0: 0
    #   d=0.1: 0.005171;  d=-0.4: 0.070320;  d=0.3: 0.049859;  d=0.2: 0.021403
    logp, behaviour, ref, adv = tensors()
    kl = k3(logp, ref)
    assert kl.tolist() == pytest.approx([0.148721, 0.018731, 0.0, 0.005171, 0.070320, 0.049859, 0.021403], abs=1e-6)
    assert (kl >= 0).all()
    # d k3 / d logp = 1 - exp(ref - logp)
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    assert grad.tolist() == pytest.approx([1 - math.exp(d) for d in REF_MINUS_LOGP], abs=1e-9)
    # the same function on floats (the browser, orchestrate.after.show, the kl_ref metric): the same numbers
    floats = [k3(p, r) for p, r in zip(logp.tolist(), ref.tolist())]
    assert all(type(x) is float for x in floats) and floats == pytest.approx(kl.tolist(), abs=1e-12)

    # In the GRPO loss: token mean of k3 = 0.314205 / 7 = 0.044886, weighted by kl_coef 0.1.
    w = token_weights(LENGTHS, "token").double()
    loss, stats = policy_loss(
        "grpo", logp, behaviour, adv, w, ref_logp=ref, kl_coef=0.1, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH
    )
    assert stats["kl"].item() == pytest.approx(0.314205 / 7, abs=1e-6)
    assert loss.item() == pytest.approx(-0.53987 / 7 + 0.1 * 0.314205 / 7, abs=1e-5)
    with pytest.raises(ValueError, match="reference"):
        policy_loss("grpo", logp, behaviour, adv, w, ref_logp=None, kl_coef=0.1)


def test_kl_takes_the_untempered_logprobs_when_given():
    # Sampling at T != 1: the ratio uses the tempered logp, the KL (reference scored at T = 1)
    # the untempered ones. With kl_logp = ref everywhere, k3 = 0 and the gradient of the KL
    # part reaches kl_logp only.
    logp, behaviour, ref, adv = tensors()
    w = token_weights(LENGTHS, "token").double()
    kl_logp = ref.clone().requires_grad_(True)
    plain, _ = policy_loss("grpo", logp, behaviour, adv, w, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH)
    loss, stats = policy_loss(
        "grpo",
        logp,
        behaviour,
        adv,
        w,
        ref_logp=ref,
        kl_coef=0.1,
        clip_eps_low=EPS_LOW,
        clip_eps_high=EPS_HIGH,
        kl_logp=kl_logp,
    )
    assert stats["kl"].item() == 0.0
    assert loss.item() == pytest.approx(plain.item(), abs=1e-9)
    # d k3 / d kl_logp = 1 - exp(ref - kl_logp) = 0 here; shift kl_logp by -0.5: grad = 1 - e^0.5, times 0.1 / 7
    shifted = (ref - 0.5).requires_grad_(True)
    loss, _ = policy_loss("grpo", logp, behaviour, adv, w, ref_logp=ref, kl_coef=0.1, kl_logp=shifted)
    (grad,) = torch.autograd.grad(loss, shifted)
    assert grad.tolist() == pytest.approx([0.1 * (1 - math.exp(0.5)) / 7] * 7, abs=1e-9)


def test_reinforce_by_hand():
    # logp = behaviour + ln(ratio):
    #   [-0.594535, -1.904690, -1.193147, -1.5, -0.037636, -2.305361, -1.156675]
    # per token -logp * A:
    #   [0.420403, 1.346819, -0.843683, 1.732051, -0.021729, -1.331001, -0.667807]  sum 0.635053
    logp, behaviour, ref, adv = tensors()
    per_token = reinforce_token_loss(logp, adv)
    assert per_token.tolist() == pytest.approx(
        [0.420403, 1.346819, -0.843683, 1.732051, -0.021729, -1.331001, -0.667807], abs=1e-5
    )
    w = token_weights(LENGTHS, "token").double()
    loss, stats = policy_loss("reinforce", logp, behaviour, adv, w)
    assert loss.item() == pytest.approx(0.635053 / 7, abs=1e-5)
    # No ratio in the gradient: d loss / d logp = -A / 7 for every token, clipped or not.
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.tolist() == pytest.approx([-ADV_BY_HAND[s] / 7 for s in SEQ_OF_TOKEN], abs=1e-5)
    # Same KL term as GRPO.
    loss_kl, _ = policy_loss("reinforce", logp, behaviour, adv, w, ref_logp=ref, kl_coef=0.1)
    assert loss_kl.item() - loss.item() == pytest.approx(0.1 * 0.314205 / 7, abs=1e-6)
    # Sequence mean: per sequence means [0.883611, -0.843683, 1.732051, -0.676365, -0.667807], / 5
    seq_loss, _ = policy_loss("reinforce", logp, behaviour, adv, token_weights(LENGTHS, "sequence").double())
    assert seq_loss.item() == pytest.approx((0.883611 - 0.843683 + 1.732051 - 0.676365 - 0.667807) / 5, abs=1e-5)


def test_micro_batch_weights_sum_to_the_step_loss():
    """Split into micro-batches with the step's totals, the losses add up to the whole step's loss."""
    logp, behaviour, _, adv = tensors()
    for aggregation in ("token", "sequence"):
        whole, _ = policy_loss("grpo", logp, behaviour, adv, token_weights(LENGTHS, aggregation).double())
        first = token_weights(LENGTHS[:2], aggregation, n_tokens=7, n_sequences=5).double()
        rest = token_weights(LENGTHS[2:], aggregation, n_tokens=7, n_sequences=5).double()
        a, _ = policy_loss("grpo", logp[:3], behaviour[:3], adv[:3], first)
        b, _ = policy_loss("grpo", logp[3:], behaviour[3:], adv[3:], rest)
        assert (a + b).item() == pytest.approx(whole.item(), abs=1e-12)


# ---- a new loss: docs/training.md's example, trained ---------------------------------------------

NEW_LOSS_RUN = """
import json, sys
from pathlib import Path

import torch

from pydantic import Field

from finetune.losses import LossConfig, LossInputs, LossOutputs, register_loss

exec(sys.argv[2])  # registered before the config is built, as a loss in finetune/losses.py is

from contract.batch import Sample
from contract.rundir import RunDir
from finetune.config import TrainConfig
from finetune.learner import Learner
from finetune.tiny_model import make_tiny_model
from finetune.train import _step_line
from orchestrate.loop.trainer import TrainerProcess

tmp = Path(sys.argv[1])
model = make_tiny_model(tmp / "model")
cfg = TrainConfig(loss="mine", mine={"beta": 0.2}, lr=1e-3, epochs=2)
learner = Learner(model, cfg)
samples = [Sample(prompt_ids=[40, 41, 42], completion_ids=c, behaviour_logprobs=[-1.0] * len(c), reward=r,
                  group_id="g") for c, r in [([10, 11, 12], 1.0), ([20, 21], 0.0)]]
before = torch.cat(learner.logprobs(samples))
steps = learner.train_batch(samples, 1)
run = RunDir(tmp / "run")
run.create()
for m in steps:  # as finetune.train writes them
    run.append_metrics({**m, "time": 0.0})
print(json.dumps({
    "beta": cfg.loss_options.beta, "terms": learner.loss_terms, "drift": [m["drift"] for m in steps],
    "expected_first_drift": float(((before + 1) ** 2).mean()), "lines": [_step_line(m, learner.loss_terms) for m in steps],
    "iteration": TrainerProcess(run, model, cfg).iteration_metrics(1),
}))
"""


def new_loss_example() -> str:
    """The code of docs/training.md's new loss (its indented block that registers "mine")."""
    lines = (Path(__file__).resolve().parent.parent / "docs" / "training.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "class MyOptions(LossConfig):")
    block = []
    for line in lines[start:]:
        if line and not line.startswith("    "):
            break
        block.append(line[4:])
    return "\n".join(block)


def test_the_documented_new_loss_trains_and_reports_its_own_terms(tmp_path):
    """docs/training.md's example, registered before the config is built (as a loss in finetune/losses.py is):
    the config takes its section, the learner trains a batch with it (two epochs: two steps), and its own
    term (`drift`, the weighted squared log-ratio to the sampler) reaches the step records, the step line and
    the iteration's metrics (averaged over the steps), with no list of names to keep."""
    code = new_loss_example()
    assert '@register_loss("mine", MyOptions, paper=' in code and '"drift"' in code
    out = subprocess.run([sys.executable, "-c", NEW_LOSS_RUN, str(tmp_path), code],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["beta"] == 0.2 and got["terms"] == ["drift", "pg_loss"]
    first, second = got["drift"]
    # token mean of (logp - (-1))^2 over the 5 tokens, with the weights before the first update
    assert first == pytest.approx(got["expected_first_drift"], rel=1e-5) and first > 1 and second != first
    assert got["iteration"]["train_drift"] == pytest.approx((first + second) / 2)
    assert "train_pg_loss" in got["iteration"] and "train_kl" not in got["iteration"]
    line = got["lines"][0]
    assert re.search(r"\): loss -?[\d.]+ pg -?[\d.]+ entropy [\d.]+ drift [\d.]+ grad_norm ", line), line
