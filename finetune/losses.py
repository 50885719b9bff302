"""The RL losses, as pure functions of tensors.

Everything here works on flat per-token tensors: the completion tokens of
several sequences laid end to end (no padding), plus one weight per token
that does the aggregation (token mean or sequence mean, see `token_weights`).
With weights that are fixed for the whole optimizer step, the loss of a step
is the plain sum of its micro-batches' losses, so micro-batching never
changes the gradient.

Conventions: `logp` are the trainer's log-probs (with grad) of the sampled
tokens, `behaviour_logp` those of the policy that sampled them (vLLM),
`ref_logp` those of the reference model. Losses are to be minimised.

A loss is a function `(LossInputs, its options) -> LossOutputs` registered
with `register_loss(name, OptionsClass, paper=...)`: the training config then has a
`loss` of that name (set by an algorithm, finetune.algorithms) and a section of its options (finetune.config), and
the learner reports every term the loss returns. grpo, reinforce, gspo and ppo
(with a critic: finetune.critic) are defined so below. The advantages they
get come from an estimator of finetune.estimators (`--train.estimator`), any of
which combines with any loss (ppo's critic excepted: GAE).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from contract.kl import k3
from finetune.critic import Critic, CriticOptions, value_loss
from finetune.lazy import lazy_import

if TYPE_CHECKING:
    import torch
    from torch import Tensor
else:
    torch = lazy_import("torch")  # the config reads the registry below; torch loads when a loss runs

Aggregation = Literal["token", "sequence"]


def grpo_token_loss(
    logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO-clip policy loss per token: -min(ratio * A, clip(ratio, 1 - low, 1 + high) * A); with `dual_clip` c
    (dual-clip PPO, arXiv:1912.09729), a token with A < 0 loses at most -c * A: a ratio far above 1 (a stale or
    mismatched sample) no longer gives an unbounded loss and gradient.

    Returns (loss, ratio, clipped): `clipped` marks tokens where a clipped
    term is the one taken, i.e. where the token gives no gradient.
    """
    ratio = torch.exp(logp - behaviour_logp)
    unclipped = ratio * advantages
    clipped_obj = torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * advantages
    clipped = clipped_obj < unclipped
    loss = -torch.minimum(unclipped, clipped_obj)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual = (advantages < 0) & (loss > bound)
        loss, clipped = torch.where(dual, bound, loss), clipped | dual
    return loss, ratio.detach(), clipped


def reinforce_token_loss(logp: Tensor, advantages: Tensor) -> Tensor:
    """REINFORCE per token: -logp * A (no importance ratio)."""
    return -logp * advantages


def token_weights(
    lengths: list[int] | Tensor,
    aggregation: Aggregation,
    n_tokens: int | None = None,
    n_sequences: int | None = None,
) -> Tensor:
    """One weight per completion token such that sum(weight * x) aggregates x.

    token:    every token of the step counts the same: 1 / n_tokens.
    sequence: each sequence counts the same, its tokens share it: 1 / (n_sequences * length).
    `lengths` are the completion lengths of the sequences laid end to end.
    Pass the step's totals as n_tokens / n_sequences when `lengths` is only
    one micro-batch of the step; they default to those of `lengths`.
    """
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    n_tokens = int(lengths.sum()) if n_tokens is None else n_tokens
    n_sequences = len(lengths) if n_sequences is None else n_sequences
    if aggregation == "token":
        per_seq = torch.full((len(lengths),), 1.0 / n_tokens, dtype=torch.float64)
    elif aggregation == "sequence":
        per_seq = 1.0 / (n_sequences * lengths.double())
    else:
        raise ValueError(f"aggregation must be 'token' or 'sequence', not {aggregation!r}")
    return per_seq.repeat_interleave(lengths).float()


# ---- typed inputs and outputs, and the registry -----------------------------------------------


def tis_weights(trainer_logp: Tensor, behaviour_logp: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"): per token min(p_trainer / p_vllm, cap), no gradient. It corrects for the
    sampler (vLLM) and the trainer computing different probabilities for the same weights, or for older ones."""
    return torch.exp(trainer_logp.detach() - behaviour_logp).clamp(max=cap)


@dataclass
class LossInputs:
    """What a loss gets for the completion tokens of one micro-batch, laid end to end (one value per token).

    `weights` aggregate per-token terms into the step's loss (see `token_weights`). `kl_logp` are the
    policy's untempered log-probs for the KL to the reference (None: `logp`, sampled at T = 1). The
    critic's fields are set for losses registered with a critic (finetune.critic) only.
    """

    logp: Tensor  # trainer's log-probs of the sampled tokens (with grad), at the sampling temperature
    behaviour_logp: Tensor  # the sampling policy's (vLLM's) log-probs
    advantages: Tensor
    weights: Tensor
    ref_logp: Tensor | None = None  # the reference model's log-probs (T = 1)
    kl_logp: Tensor | None = None
    kl_coef: float = 0.0  # weight of the k3 KL penalty in the loss
    lengths: list[int] | None = None  # tokens of each sequence, laid end to end (sequence-level losses: gspo)
    entropy: Tensor | None = None  # the policy's entropy at each token (with grad when entropy_coef > 0)
    entropy_coef: float = 0.0  # weight of the entropy bonus: coef x entropy is subtracted from the loss
    values: Tensor | None = None  # the critic's current values V(s_t) (with grad)
    old_values: Tensor | None = None  # the critic's values when the batch arrived (no grad)
    returns: Tensor | None = None  # the critic's targets: advantages (unwhitened) + old values


@dataclass
class LossOutputs:
    """A loss and what the learner reports of it: open mappings, by how a step's micro-batches add them up.
    Every name in them reaches the learner's step line, train_metrics.jsonl and metrics.jsonl (train_NAME);
    none is required.

    loss: to minimise (with grad), already aggregated with the inputs' weights.
    terms: detached parts of the loss aggregated with the same weights (`pg_loss`, `kl`, `value_loss`):
      the learner sums them over the micro-batches of a step and reports the sums.
    token_means: detached per-token values (`clip_frac` as 0/1, `ratio_mean`): reported as their mean
      over the step's trained tokens.
    token_extremes: detached per-token values whose max and min are reported (`ratio` -> ratio_max,
      ratio_min).
    """

    loss: Tensor
    terms: dict[str, Tensor] = field(default_factory=dict)
    token_means: dict[str, Tensor] = field(default_factory=dict)
    token_extremes: dict[str, Tensor] = field(default_factory=dict)


class LossConfig(BaseModel):
    """Options of one loss: a section of the training config named after the loss (`--train.NAME.OPTION`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def needs_reference(self) -> bool:
        """Whether these options need reference log-probs besides kl_coef (a KL penalty in the reward)."""
        return False


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: Callable[[LossInputs, LossConfig], LossOutputs]
    config: type[LossConfig]
    critic: type[Critic] | None  # a learned critic gives the advantages (finetune.critic), not an estimator
    doc: str
    paper: str = ""  # where it comes from: an arXiv id, or a reference when there is none


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, config: type[LossConfig], critic: type[Critic] | None = None, paper: str = ""):
    """Register `fn(inputs, options) -> LossOutputs` as `--train.loss NAME`, its options as
    `--train.NAME.OPTION` (the fields of `config`). Adding a loss is this: one function, one config class.
    `paper` (an arXiv id) shows in --help beside the first line of the function's docstring. A loss with a
    `critic` (finetune.critic.Critic; its options class then has CriticOptions's fields) gets the critic's
    values, old values and returns in LossInputs and its advantages from the critic."""

    def wrap(fn: Callable[[LossInputs, LossConfig], LossOutputs]):
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is registered twice")
        LOSSES[name] = LossSpec(name, fn, config, critic, (fn.__doc__ or "").strip().splitlines()[0], paper)
        return fn

    return wrap


def kl_term(x: LossInputs) -> tuple[Tensor, Tensor]:
    """(k3 per token, with grad when it is in the loss; its weighted sum, detached) of the policy to the
    reference. Zero when there are no reference log-probs."""
    if x.ref_logp is None:
        if x.kl_coef:
            raise ValueError("kl_coef > 0 needs reference log-probs")
        zero = torch.zeros_like(x.logp)
        return zero, zero.sum().detach()
    kl_logp = x.logp if x.kl_logp is None else x.kl_logp
    kl = k3(kl_logp if x.kl_coef else kl_logp.detach(), x.ref_logp)
    return kl, (x.weights * kl).sum().detach()


def policy_outputs(
    x: LossInputs,
    pg: Tensor,
    ratio: Tensor,
    clipped: Tensor,
    extra: Tensor | None = None,
    terms: dict[str, Tensor] | None = None,
) -> LossOutputs:
    """A policy-gradient loss's outputs, as grpo, reinforce, gspo and ppo report them: per token `pg` (plus
    kl_coef x k3 to the reference, minus entropy_coef x the entropy) aggregated, plus `extra`; terms pg_loss,
    kl (and `terms`), clip_frac and ratio_mean per token, the ratio's extremes."""
    kl, kl_sum = kl_term(x)
    per_token = pg + x.kl_coef * kl if x.kl_coef else pg
    if x.entropy_coef:  # the entropy bonus: higher entropy lowers the loss
        if x.entropy is None or not x.entropy.requires_grad:
            raise ValueError("entropy_coef > 0 needs the policy's entropy with its gradient")
        per_token = per_token - x.entropy_coef * x.entropy
    loss = (x.weights * per_token).sum()
    if extra is not None:
        loss = loss + extra
    return LossOutputs(
        loss=loss,
        terms={"pg_loss": (x.weights * pg).sum().detach(), "kl": kl_sum, **(terms or {})},
        token_means={"clip_frac": clipped.to(x.logp.dtype), "ratio_mean": ratio},
        token_extremes={"ratio": ratio},
    )


class ClipConfig(LossConfig):
    clip_eps_low: float = Field(0.2, ge=0, lt=1, description="lower clip of the importance ratio: >= 1 - clip_eps_low")
    clip_eps_high: float = Field(0.2, ge=0, description="upper clip: ratio <= 1 + clip_eps_high (DAPO uses 0.28)")
    dual_clip: float | None = Field(
        None,
        gt=1,
        description="dual-clip PPO (arXiv:1912.09729): a token with a negative advantage A loses at most "
        "-dual_clip x A, however far its ratio is above 1 (stale samples under async, a sampler/trainer "
        "mismatch); verl's clip_ratio_c, 3. None: off",
    )


@register_loss("grpo", ClipConfig, paper="arXiv:2402.03300; clip-higher and token mean: arXiv:2503.14476 (DAPO)")
def grpo_loss(x: LossInputs, c: ClipConfig) -> LossOutputs:
    """PPO-clip policy term against the behaviour log-probs, advantages from returns (group / batch / none
    baseline), plus kl_coef x k3 to the reference."""
    pg, ratio, clipped = grpo_token_loss(x.logp, x.behaviour_logp, x.advantages, c.clip_eps_low, c.clip_eps_high,
                                         c.dual_clip)  # fmt: skip
    return policy_outputs(x, pg, ratio, clipped)


class ReinforceConfig(LossConfig):
    pass


@register_loss("reinforce", ReinforceConfig, paper="Williams 1992; arXiv:2402.14740")
def reinforce_loss(x: LossInputs, c: ReinforceConfig) -> LossOutputs:
    """log-prob x advantage, no importance ratio, plus kl_coef x k3 to the reference."""
    pg = reinforce_token_loss(x.logp, x.advantages)
    ratio = torch.exp(x.logp - x.behaviour_logp).detach()  # reported, not used
    return policy_outputs(x, pg, ratio, torch.zeros_like(x.logp, dtype=torch.bool))


class GSPOConfig(LossConfig):
    clip_eps_low: float = Field(
        3e-4, ge=0, lt=1, description="lower clip of the sequence ratio: >= 1 - clip_eps_low (the paper: 3e-4)"
    )
    clip_eps_high: float = Field(4e-4, ge=0, description="upper clip: sequence ratio <= 1 + clip_eps_high (4e-4)")


def sequence_ratio(logp: Tensor, behaviour_logp: Tensor, lengths: Sequence[int]) -> Tensor:
    """GSPO's importance ratio of each sequence, s_i = exp(mean over its tokens of (logp - behaviour_logp)),
    given to each of its tokens as sg[s_i] * p(y_t) / sg[p(y_t)] (GSPO-token): every token carries the value
    s_i and the gradient s_i * d logp_t, so averaged over the sequence's tokens (aggregation sequence) the
    gradient is that of s_i itself."""
    lengths_t = torch.as_tensor(list(lengths), device=logp.device)
    seq = torch.repeat_interleave(torch.arange(len(lengths_t), device=logp.device), lengths_t)
    diff = (logp - behaviour_logp).detach()
    mean = torch.zeros(len(lengths_t), dtype=diff.dtype, device=diff.device).index_add_(0, seq, diff) / lengths_t
    return torch.exp(mean[seq] + logp - logp.detach())


@register_loss("gspo", GSPOConfig, paper="arXiv:2507.18071")
def gspo_loss(x: LossInputs, c: GSPOConfig) -> LossOutputs:
    """GSPO: PPO-clip on each sequence's length-normalised ratio exp(mean_t(logp - behaviour)), clipped per sequence."""
    # The paper averages over sequences: use it with --train.aggregation sequence.
    if x.lengths is None:
        raise ValueError("gspo needs the sequences' lengths (LossInputs.lengths)")
    ratio = sequence_ratio(x.logp, x.behaviour_logp, x.lengths)
    unclipped = ratio * x.advantages
    clipped_obj = torch.clamp(ratio, 1 - c.clip_eps_low, 1 + c.clip_eps_high) * x.advantages
    pg = -torch.minimum(unclipped, clipped_obj)
    return policy_outputs(x, pg, ratio.detach(), (clipped_obj < unclipped).detach())


class PPOConfig(CriticOptions, ClipConfig):
    """PPO's options: the clipped objective's and its critic's (finetune.critic.CriticOptions)."""


@register_loss("ppo", PPOConfig, critic=Critic, paper="arXiv:1707.06347")
def ppo_loss(x: LossInputs, c: PPOConfig) -> LossOutputs:
    """PPO with a learned critic: the clipped policy term on GAE advantages, plus vf_coef x the clipped value
    loss, plus kl_coef x k3 to the reference."""
    if x.values is None or x.old_values is None or x.returns is None:
        raise ValueError("ppo needs the critic's values, old values and returns")
    pg, ratio, clipped = grpo_token_loss(x.logp, x.behaviour_logp, x.advantages, c.clip_eps_low, c.clip_eps_high,
                                         c.dual_clip)  # fmt: skip
    vl, v_clipped = value_loss(x.values, x.old_values, x.returns, c.value_clip)
    v_sum = (x.weights * vl).sum()
    out = policy_outputs(x, pg, ratio, clipped, extra=c.vf_coef * v_sum, terms={"value_loss": v_sum.detach()})
    out.token_means["vf_clip_frac"] = v_clipped.to(x.logp.dtype)
    return out
