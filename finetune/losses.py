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
with `register_loss(name, OptionsClass)`: the training config then has an
`algorithm` of that name and a section of its options (finetune.config), and
the learner reports every term the loss returns. grpo, reinforce and ppo
(with a critic: `gae`, `value_loss`) are defined so below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from finetune.kl import k3

Aggregation = Literal["token", "sequence"]


def group_advantages(rewards: Tensor, group_ids: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """(reward - group mean) / (group std + eps), one value per sample.

    The std is the sample std (n - 1 in the denominator, as in DeepSeek's and
    TRL's GRPO). `normalize_std=False` keeps only the mean baseline
    (Dr. GRPO). A group whose rewards are all equal (a single sample
    included) gets advantage exactly 0, so it contributes no policy gradient.
    """
    rewards = rewards.double()  # group means of floats are exact enough in fp64
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, rewards) / count
    centered = rewards - mean[group]
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, centered**2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    adv = centered / (std[group] + eps) if normalize_std else centered
    lo = torch.full((n_groups,), float("inf"), dtype=torch.float64).scatter_reduce(0, group, rewards, "amin")
    hi = torch.full((n_groups,), float("-inf"), dtype=torch.float64).scatter_reduce(0, group, rewards, "amax")
    constant = (lo == hi)[group]
    return torch.where(constant, torch.zeros_like(adv), adv).float()


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """G_t = r_t + gamma * G_{t+1} for each turn t of one episode (G after the last turn is 0: a truncated
    episode is not bootstrapped)."""
    out, g = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        g = float(rewards[t]) + gamma * g
        out[t] = g
    return out


Baseline = Literal["group", "batch", "none"]


def turn_advantages(
    turns: Sequence[Sequence[tuple[int, float]]],
    episode_ids: Sequence[str],
    group_ids: Sequence[str | int],
    baseline: Baseline,
    gamma: float = 1.0,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> tuple[list[list[float]], list[list[float]]]:
    """Per-turn returns and advantages of every sample: (returns, advantages), each a list per sample
    holding one value per turn of that sample.

    `turns[i]` lists sample i's turns as (index in the episode, reward). Samples sharing an episode id are
    parts of one episode: its returns run over all of its turns.
    - group: GRPO over episodes. Each episode is one member of its group whatever its number of turns,
      scored by its return G_0; advantage = (G_0 - group mean) / (group std + eps), the same for every turn.
    - batch: every turn's return G_t, normalised over all turns of the batch (GEM's ReBN, `norm_return`):
      (G_t - mean) / (std + eps). Fits per-turn rewards and gamma < 1, where a group baseline does not.
    - none: the returns themselves.
    With normalize_std False the std is not divided by (Dr. GRPO / plain mean baseline).
    """
    episodes: dict[str, dict[int, float]] = {}
    episode_group: dict[str, str | int] = {}
    for sample_turns, episode, group in zip(turns, episode_ids, group_ids):
        rewards = episodes.setdefault(episode, {})
        episode_group.setdefault(episode, group)
        for index, reward in sample_turns:
            rewards[index] = float(reward)
    returns_of: dict[str, dict[int, float]] = {}
    for episode, rewards in episodes.items():
        order = sorted(rewards)
        returns_of[episode] = dict(zip(order, discounted_returns([rewards[t] for t in order], gamma)))
    returns = [[returns_of[e][index] for index, _ in st] for st, e in zip(turns, episode_ids)]

    if baseline == "none":
        advantages = [list(r) for r in returns]
    elif baseline == "group":
        names = list(episodes)
        first = torch.tensor(
            [returns_of[e][min(returns_of[e])] if returns_of[e] else 0.0 for e in names], dtype=torch.float64
        )
        group_index: dict[str | int, int] = {}
        gids = torch.tensor([group_index.setdefault(episode_group[e], len(group_index)) for e in names])
        adv = group_advantages(first, gids, normalize_std, eps).double().tolist()
        by_episode = dict(zip(names, adv))
        advantages = [[by_episode[e]] * len(st) for st, e in zip(turns, episode_ids)]
    elif baseline == "batch":
        flat = torch.tensor([g for e in episodes for g in returns_of[e].values()], dtype=torch.float64)
        mean = float(flat.mean()) if len(flat) else 0.0
        std = float(flat.std()) if len(flat) > 1 else 0.0
        scale = (std + eps) if normalize_std else 1.0
        constant = len(flat) == 0 or float(flat.max() - flat.min()) == 0.0
        advantages = [[0.0 if constant else (g - mean) / scale for g in r] for r in returns]
    else:
        raise ValueError(f"baseline must be 'group', 'batch' or 'none', not {baseline!r}")
    return returns, advantages


def grpo_token_loss(
    logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, clip_eps_low: float, clip_eps_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO-clip policy loss per token: -min(ratio * A, clip(ratio, 1 - low, 1 + high) * A).

    Returns (loss, ratio, clipped): `clipped` marks tokens where the clipped
    term is the smaller one, i.e. where the token gives no gradient.
    """
    ratio = torch.exp(logp - behaviour_logp)
    unclipped = ratio * advantages
    clipped_obj = torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * advantages
    clipped = clipped_obj < unclipped
    return -torch.minimum(unclipped, clipped_obj), ratio.detach(), clipped


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


@dataclass
class LossInputs:
    """What a loss gets for the completion tokens of one micro-batch, laid end to end (one value per token).

    `weights` aggregate per-token terms into the step's loss (see `token_weights`). `kl_logp` are the
    policy's untempered log-probs for the KL to the reference (None: `logp`, sampled at T = 1). The
    critic's fields are set for losses registered with `critic=True` only.
    """

    logp: Tensor  # trainer's log-probs of the sampled tokens (with grad), at the sampling temperature
    behaviour_logp: Tensor  # the sampling policy's (vLLM's) log-probs
    advantages: Tensor
    weights: Tensor
    ref_logp: Tensor | None = None  # the reference model's log-probs (T = 1)
    kl_logp: Tensor | None = None
    kl_coef: float = 0.0  # weight of the k3 KL penalty in the loss
    values: Tensor | None = None  # the critic's current values V(s_t) (with grad)
    old_values: Tensor | None = None  # the critic's values when the batch arrived (no grad)
    returns: Tensor | None = None  # the critic's targets: advantages (unwhitened) + old values


@dataclass
class LossOutputs:
    """A loss and what the learner reports of it.

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
    """Options of one loss: a section of the training config named after the algorithm."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: Callable[[LossInputs, LossConfig], LossOutputs]
    config: type[LossConfig]
    critic: bool  # trains a value model beside the policy (advantages from GAE, not from returns)
    doc: str


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, config: type[LossConfig], critic: bool = False):
    """Register `fn(inputs, options) -> LossOutputs` as `--train.algorithm NAME`, its options as
    `--train.NAME.OPTION` (the fields of `config`). Adding a loss is this: one function, one config class."""

    def wrap(fn: Callable[[LossInputs, LossConfig], LossOutputs]):
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is registered twice")
        LOSSES[name] = LossSpec(name, fn, config, critic, (fn.__doc__ or "").strip().splitlines()[0])
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


def _policy_outputs(
    x: LossInputs,
    pg: Tensor,
    ratio: Tensor,
    clipped: Tensor,
    extra: Tensor | None = None,
    terms: dict[str, Tensor] | None = None,
) -> LossOutputs:
    kl, kl_sum = kl_term(x)
    per_token = pg + x.kl_coef * kl if x.kl_coef else pg
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


@register_loss("grpo", ClipConfig)
def grpo_loss(x: LossInputs, c: ClipConfig) -> LossOutputs:
    """PPO-clip policy term against the behaviour log-probs, advantages from returns (group / batch / none
    baseline), plus kl_coef x k3 to the reference."""
    pg, ratio, clipped = grpo_token_loss(x.logp, x.behaviour_logp, x.advantages, c.clip_eps_low, c.clip_eps_high)
    return _policy_outputs(x, pg, ratio, clipped)


class ReinforceConfig(LossConfig):
    pass


@register_loss("reinforce", ReinforceConfig)
def reinforce_loss(x: LossInputs, c: ReinforceConfig) -> LossOutputs:
    """log-prob x advantage, no importance ratio, plus kl_coef x k3 to the reference."""
    pg = reinforce_token_loss(x.logp, x.advantages)
    ratio = torch.exp(x.logp - x.behaviour_logp).detach()  # reported, not used
    return _policy_outputs(x, pg, ratio, torch.zeros_like(x.logp, dtype=torch.bool))


class PPOConfig(ClipConfig):
    critic: Literal["separate", "head"] = Field(
        "separate",
        description="separate: a value model initialised from the policy, with its own optimizer "
        "(oat's choice; twice the weights in memory); head: a linear value head on the policy's last hidden "
        "state, trained through the shared body with vf_coef",
    )
    critic_lr: float = Field(
        1e-5, gt=0, description="learning rate of the critic (the separate model or the value head)"
    )
    gae_lambda: float = Field(
        1.0,
        ge=0,
        le=1,
        description="GAE lambda over the tokens (1: Monte-Carlo "
        "returns minus the value; lower bootstraps more from the critic)",
    )
    vf_coef: float = Field(0.5, ge=0, description="weight of the value loss")
    value_clip: float = Field(
        0.2,
        ge=0,
        description="the value may move at most this far from its value when "
        "the batch arrived (clipped value loss, as in PPO2); 0: no clipping",
    )
    whiten_advantages: bool = Field(True, description="normalise the batch's token advantages to mean 0, std 1")
    kl_in_reward: float = Field(
        0.0,
        ge=0,
        description="subtract this x (behaviour log-prob - reference "
        "log-prob) from each token's reward (needs the reference pass)",
    )


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float) -> tuple[Tensor, Tensor]:
    """Per token: (0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), clipped), where `clipped`
    marks tokens whose clipped term is the larger (the value gets no gradient there). c = 0: no clipping."""
    plain = (values - returns) ** 2
    if not value_clip:
        return 0.5 * plain, torch.zeros_like(plain, dtype=torch.bool)
    moved = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    clipped_sq = (moved - returns) ** 2
    return 0.5 * torch.maximum(plain, clipped_sq), (clipped_sq > plain).detach()


@register_loss("ppo", PPOConfig, critic=True)
def ppo_loss(x: LossInputs, c: PPOConfig) -> LossOutputs:
    """PPO with a learned critic: the clipped policy term on GAE advantages, plus vf_coef x the clipped value
    loss, plus kl_coef x k3 to the reference."""
    if x.values is None or x.old_values is None or x.returns is None:
        raise ValueError("ppo needs the critic's values, old values and returns")
    pg, ratio, clipped = grpo_token_loss(x.logp, x.behaviour_logp, x.advantages, c.clip_eps_low, c.clip_eps_high)
    vl, v_clipped = value_loss(x.values, x.old_values, x.returns, c.value_clip)
    v_sum = (x.weights * vl).sum()
    out = _policy_outputs(x, pg, ratio, clipped, extra=c.vf_coef * v_sum, terms={"value_loss": v_sum.detach()})
    out.token_means["vf_clip_frac"] = v_clipped.to(x.logp.dtype)
    return out


def gae(
    rewards: Sequence[float], values: Sequence[float], turn_ends: Sequence[bool], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """Token-level GAE over the trained tokens of one episode: (advantages, returns), one per token.

    `values[k]` is the critic's V before token k; `rewards[k]` the reward given after token k (a turn's
    reward sits at its last token, plus any per-token KL penalty); `turn_ends[k]` marks the last token of a
    turn. The discount `gamma` applies between turns, as for the turn returns (G_t = r_t + gamma G_{t+1}):
    within a turn tokens are not discounted; `lam` applies per token. After the last token the value is 0:
    an episode that ended, truncated or not, is not bootstrapped (the environment tokens between turns are
    context, not steps).
        delta_k = r_k + g_k V_{k+1} - V_k,   A_k = delta_k + g_k lam A_{k+1},   g_k = gamma if turn_ends[k] else 1
    returns = A + V (the critic's targets).
    """
    n = len(rewards)
    adv = [0.0] * n
    next_value, next_adv = 0.0, 0.0
    for k in reversed(range(n)):
        g = gamma if turn_ends[k] else 1.0
        delta = float(rewards[k]) + g * next_value - float(values[k])
        next_adv = delta + g * lam * next_adv
        adv[k] = next_adv
        next_value = float(values[k])
    return adv, [a + float(v) for a, v in zip(adv, values)]


def explained_variance(values: Tensor, returns: Tensor) -> float:
    """1 - Var(R - V) / Var(R): 1 when the critic predicts the returns, 0 when it predicts their mean,
    negative when worse. NaN when the returns are all equal."""
    var = returns.double().var(unbiased=False)
    if len(returns) < 2 or float(var) == 0.0:
        return float("nan")
    return float(1 - (returns.double() - values.double()).var(unbiased=False) / var)
