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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from tapes.kl import k3

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
        first = torch.tensor([returns_of[e][min(returns_of[e])] if returns_of[e] else 0.0 for e in names],
                             dtype=torch.float64)
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


def policy_loss(
    algorithm: Literal["grpo", "reinforce"],
    logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    weights: Tensor,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    kl_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss to minimise, aggregated with `weights`, and its parts.

    loss = sum(weights * (pg_loss + kl_coef * k3(logp, ref_logp)))
    All inputs are per completion token. The returned stats are detached:
    pg_loss and kl are aggregated with the same weights as the loss;
    ratio, clipped are per token (for clip fraction and ratio stats).
    `kl_logp` are the policy's log-probs for the KL term when they differ from
    `logp`: with a sampling temperature T != 1, `logp` is of the tempered
    distribution (like `behaviour_logp`) while the reference is scored at
    T = 1, so the KL takes the policy's untempered log-probs.
    """
    kl_logp = logp if kl_logp is None else kl_logp
    if algorithm == "grpo":
        pg, ratio, clipped = grpo_token_loss(logp, behaviour_logp, advantages, clip_eps_low, clip_eps_high)
    elif algorithm == "reinforce":
        pg = reinforce_token_loss(logp, advantages)
        ratio = torch.exp(logp - behaviour_logp).detach()  # reported, not used
        clipped = torch.zeros_like(logp, dtype=torch.bool)
    else:
        raise ValueError(f"algorithm must be 'grpo' or 'reinforce', not {algorithm!r}")
    per_token = pg
    if kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference log-probs")
        kl = k3(kl_logp, ref_logp)
        per_token = pg + kl_coef * kl
    else:
        kl = k3(kl_logp.detach(), ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    loss = (weights * per_token).sum()
    stats = {
        "pg_loss": (weights * pg).sum().detach(),
        "kl": (weights * kl).sum().detach(),
        "ratio": ratio,
        "clipped": clipped,
    }
    return loss, stats
