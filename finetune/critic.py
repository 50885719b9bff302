"""A learned critic and its advantages (PPO's), behind the interface the learner calls.

A loss registered with a critic (finetune.losses.register_loss(..., critic=Critic)) gets its advantages
from here, not from an estimator. The learner knows a critic by this class only:

- `value_head`: whether the values come from a linear head on the policy's last hidden state (trained
  through the shared body) or from a separate value model (the policy's body copied, with its own
  optimizer); `lr`: the learning rate of either;
- `batch(samples, values)`: before the batch's first step, from the values the critic gives every trained
  token as the batch arrives, a `CriticBatch`: per sample the advantages (token-level GAE over each episode,
  whitened over the batch if asked), those old values and the returns the value loss pulls towards, plus
  the batch's statistics;
- `value_loss(values, old_values, returns)`: per token, the clipped value loss and where it clipped;
- `needs_reference`: whether its rewards take a KL penalty (reference log-probs needed).

The learner does the mechanics: the micro-batches, the forward passes that give values, the optimizers
and the checkpoint. The options are `CriticOptions`, the fields of a loss's options class (`--train.ppo.*`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from contract.batch import credit_ids
from finetune.lazy import lazy_import

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from contract.batch import Sample
else:
    torch = lazy_import("torch")


class CriticOptions(BaseModel):
    """The options of a critic: a loss with one has these fields (PPOConfig)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    critic: Literal["separate", "head"] = Field(
        "separate",
        description="separate: a value model initialised from the policy, with its own optimizer "
        "(oat's choice; twice the weights in memory); head: a linear value head on the policy's last hidden "
        "state, trained through the shared body with vf_coef",
    )
    critic_lr: float = Field(
        1e-4,
        gt=0,
        description="learning rate of the critic (the separate model or the value head); measured on the "
        "embedded preset: at 1e-5 its values stay near 0, at 1e-4 they follow the returns' mean (docs/results.md)",
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

    def needs_reference(self) -> bool:
        return self.kl_in_reward > 0


@dataclass
class CriticBatch:
    """What the critic says about one batch before any update: one tensor per sample, one value per trained
    token (the order of Sample.trained_positions)."""

    advantages: list[Tensor]
    old_values: list[Tensor]  # the critic's values as the batch arrived
    returns: list[Tensor]  # the value loss's targets: the unwhitened advantages + old values
    stats: dict[str, float | None]  # value_mean, returns_mean, explained_variance (None: all returns equal)

    def rows(self, rows: Sequence[int]) -> tuple[Tensor, Tensor]:
        """The old values and returns of these samples, end to end (a micro-batch's)."""
        return torch.cat([self.old_values[r] for r in rows]), torch.cat([self.returns[r] for r in rows])

    def per_turn(self, samples: list[Sample]) -> tuple[list[list[float]], list[list[float]]]:
        """Per sample and turn: the mean of the turn's token advantages (what the browser shows as its
        advantage) and the critic's value before its first token."""
        advantages, values = [], []
        for sample, adv, old in zip(samples, self.advantages, self.old_values):
            offset = 0
            advantages.append([])
            values.append([])
            for t in sample.all_turns:
                advantages[-1].append(float(adv[offset : offset + t.length].mean()))
                values[-1].append(float(old[offset]))
                offset += t.length
        return advantages, values


class Critic:
    """PPO's critic (oat's and OpenRLHF's form): token-level GAE on a learned value of every trained token."""

    def __init__(self, options: CriticOptions, gamma: float, std_eps: float,
                 shaped_reward: Callable[[float, int, int | None], float]):  # fmt: skip
        self.options = options
        self.gamma, self.std_eps, self.shaped_reward = gamma, std_eps, shaped_reward

    @property
    def value_head(self) -> bool:
        return self.options.critic == "head"

    @property
    def lr(self) -> float:
        return self.options.critic_lr

    def value_loss(self, values: Tensor, old_values: Tensor, returns: Tensor) -> tuple[Tensor, Tensor]:
        return value_loss(values, old_values, returns, self.options.value_clip)

    def rewards(self, sample: Sample, untempered: Tensor | None = None) -> Tensor:
        """The reward after each trained token: a turn's (shaped) reward at its last token, minus
        kl_in_reward x (policy - reference log-prob) at every token when asked. Both log-probs at T = 1 (the
        reference is scored untempered): the behaviour's, or for a sample drawn at another temperature
        `untempered`, the policy's at T = 1 (its tempered log-probs would put a penalty on the temperature
        itself, even where policy and reference are one model)."""
        r = torch.zeros(sample.n_trained, dtype=torch.float64)
        offset = 0
        for t in sample.all_turns:
            offset += t.length
            r[offset - 1] += self.shaped_reward(t.reward, t.length, t.max_tokens)
        if self.options.kl_in_reward:
            if sample.temperature != 1.0 and untempered is None:
                raise ValueError("kl_in_reward: a sample drawn at temperature != 1 needs the policy's untempered "
                                 "log-probs")  # fmt: skip
            policy = (torch.tensor(sample.behaviour_logprobs) if sample.temperature == 1.0 else untempered).double()
            r -= self.options.kl_in_reward * (policy - torch.tensor(sample.ref_logprobs, dtype=torch.float64))
        return r

    def needs_untempered(self, samples: list[Sample]) -> bool:
        """Whether `rewards` needs the policy's untempered log-probs of some of these samples."""
        return bool(self.options.kl_in_reward) and any(s.temperature != 1.0 for s in samples)

    def batch(self, samples: list[Sample], values: list[Tensor], untempered: list[Tensor] | None = None) -> CriticBatch:
        """Token-level GAE over each episode (its samples' turns in order) on `values` (the critic's, per
        sample, before any update), whitened over the batch if asked; `untempered`: the policy's log-probs at
        T = 1 of each sample (kl_in_reward at another temperature, `needs_untempered`)."""
        rewards = [self.rewards(s, None if untempered is None else untempered[i]) for i, s in enumerate(samples)]
        episodes: dict[str, list[int]] = {}
        for i, episode in enumerate(credit_ids(samples)[0]):  # a role's turns are an episode of their own
            episodes.setdefault(episode, []).append(i)
        advantages: list[Tensor] = [torch.empty(0)] * len(samples)
        returns: list[Tensor] = [torch.empty(0)] * len(samples)
        for members in episodes.values():
            members.sort(key=lambda i: samples[i].all_turns[0].index)
            ends = [k == t.length - 1 for i in members for t in samples[i].all_turns for k in range(t.length)]
            adv, ret = gae(torch.cat([rewards[i] for i in members]).tolist(),
                           torch.cat([values[i] for i in members]).tolist(), ends, self.gamma,
                           self.options.gae_lambda)  # fmt: skip
            offset = 0
            for i in members:
                n = samples[i].n_trained
                advantages[i] = torch.tensor(adv[offset : offset + n], dtype=torch.float32)
                returns[i] = torch.tensor(ret[offset : offset + n], dtype=torch.float32)
                offset += n
        flat_values, flat_returns = torch.cat(values), torch.cat(returns)
        ev = explained_variance(flat_values, flat_returns)
        stats = {"value_mean": float(flat_values.mean()), "returns_mean": float(flat_returns.mean()),
                 "explained_variance": ev if math.isfinite(ev) else None}  # fmt: skip
        if self.options.whiten_advantages:
            flat = torch.cat(advantages).double()
            mean, std = flat.mean(), (flat.std() if len(flat) > 1 else torch.tensor(0.0, dtype=torch.float64))
            advantages = [((a.double() - mean) / (std + self.std_eps)).float() for a in advantages]
        return CriticBatch(advantages, values, returns, stats)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float) -> tuple[Tensor, Tensor]:
    """Per token: (0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), clipped), where `clipped`
    marks tokens whose clipped term is the larger (the value gets no gradient there). c = 0: no clipping."""
    plain = (values - returns) ** 2
    if not value_clip:
        return 0.5 * plain, torch.zeros_like(plain, dtype=torch.bool)
    moved = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    clipped_sq = (moved - returns) ** 2
    return 0.5 * torch.maximum(plain, clipped_sq), (clipped_sq > plain).detach()


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
