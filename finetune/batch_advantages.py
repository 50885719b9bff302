"""What a batch trains with before its first step: the samples fresh enough to train (max_lag) and the lag
figures, then per-turn returns (discount gamma) and advantages (the chosen estimator, see
`estimators.turn_advantages`; with a loss's critic, token-level GAE on the critic's values instead, see
finetune.critic), one advantage per trained token (plus, with a teacher, teacher_coef x its log-prob minus the
behaviour log-prob of each token: `teacher_advantages`), and the record of each turn the trainer writes beside the
checkpoint (RUN/advantages/)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from contract.batch import Sample, credit_ids, lag
from finetune.config import TrainConfig
from finetune.critic import Critic, CriticBatch
from finetune.estimators import turn_advantages


@dataclass
class BatchAdvantages:
    per_token: list[torch.Tensor]  # per sample: one advantage per trained token
    turn_records: list[dict]  # per sample, per turn: reward, return, advantage (and value, overlong penalty)
    stats: dict  # the critic's and the teacher's figures of the batch (none without either)
    critic: CriticBatch | None  # the critic's advantages, old values and returns (with one)


def drop_stale(samples: list[Sample], batch_index: int, max_lag: int | None) -> tuple[list[Sample], dict]:
    """Samples within max_lag of the version that trains them (batch b trains version b - 1), and the
    lag figures: lag_mean and lag_max over samples of known version, stale_dropped."""
    lags = [lag(batch_index, s.policy_version) for s in samples if s.policy_version is not None]
    stats: dict = {"stale_dropped": 0}
    if lags:
        stats.update(lag_mean=sum(lags) / len(lags), lag_max=max(lags))
        tokens = [lag(batch_index, v) for s in samples for v in s.token_versions() if v is not None]
        stats["lag_token_mean"] = sum(tokens) / len(tokens) if tokens else 0.0  # each token's own version
    if max_lag is None:
        return samples, stats
    kept = [s for s in samples if s.policy_version is None or lag(batch_index, s.policy_version) <= max_lag]
    stats["stale_dropped"] = len(samples) - len(kept)
    return kept, stats


def keep_roles(samples: list[Sample], roles: list[str] | None) -> tuple[list[Sample], dict]:
    """The samples of the roles trained (`roles`; none: every sample), and how many were left out
    (role_dropped, where roles are named)."""
    if roles is None:
        return samples, {}
    kept = [s for s in samples if s.role in roles]
    return kept, {"role_dropped": len(samples) - len(kept)}


def is_cut(sample: Sample) -> bool:
    """Whether an output of the sample was cut by its sampling limit (its finish reason: overlong
    filtering)."""
    if any(t.truncated is None for t in sample.all_turns):
        raise ValueError(f"overlong_filter: sample {sample.sample_id} does not record whether its outputs were cut "
                         "(no turns[].truncated in the batch file); the filter reads it")  # fmt: skip
    return any(t.truncated for t in sample.all_turns)


def batch_advantages(
    samples: list[Sample],
    cfg: TrainConfig,
    critic: Critic | None,
    values: Callable[[list[Sample]], list],
    untempered: Callable[[list[Sample]], list] | None = None,
) -> BatchAdvantages:
    """The batch's advantages from the estimator, or from `critic` on the `values` it gives the samples now (and,
    when its KL-in-reward needs them, the policy's `untempered` log-probs)."""
    shaped = [[cfg.shaped_reward(t.reward, t.length, t.max_tokens) for t in sample.all_turns] for sample in samples]
    returns, turn_adv = turn_advantages(
        [[(t.index, r) for t, r in zip(sample.all_turns, rs)] for sample, rs in zip(samples, shaped)],
        *credit_ids(samples),
        cfg.estimator, cfg.gamma, cfg.normalize_std, cfg.std_eps,
        lengths=[[t.length for t in sample.all_turns] for sample in samples],
        branches=[sample.branch for sample in samples],
    )  # fmt: skip
    critic_batch = None
    stats: dict[str, float | None] = {}
    if critic is not None:
        at_1 = untempered(samples) if untempered is not None and critic.needs_untempered(samples) else None
        critic_batch = critic.batch(samples, values(samples), at_1)
        advantages, stats = critic_batch.advantages, critic_batch.stats
        turn_adv, turn_values = critic_batch.per_turn(samples)
    else:
        advantages = [
            torch.tensor(
                [a for t, a in zip(sample.all_turns, sample_adv) for _ in range(t.length)], dtype=torch.float32
            )
            for sample, sample_adv in zip(samples, turn_adv)
        ]  # one per trained token
        turn_values = None
    if cfg.teacher_coef:
        distill, distill_stats = teacher_advantages(samples, cfg.teacher_coef, advantages)
        advantages = [a + d for a, d in zip(advantages, distill)]
        stats = {**stats, **distill_stats}
    # what the step trains with, per sample and turn: the trainer writes it beside the checkpoint
    records = [
        {"sample_id": sample.sample_id, "turns": [
            {"index": t.index, "reward": t.reward, "return": g, "advantage": a,
             **({} if turn_values is None else {"value": turn_values[i][k]}),
             **({"overlong_penalty": shaped[i][k] - t.reward} if cfg.overlong_buffer else {})}
            for k, (t, g, a) in enumerate(zip(sample.all_turns, sample_returns, sample_adv))]}
        for i, (sample, sample_returns, sample_adv) in enumerate(zip(samples, returns, turn_adv))
    ]  # fmt: skip
    return BatchAdvantages(advantages, records, stats, critic_batch)


def teacher_advantages(
    samples: list[Sample], coef: float, reward_advantages: list[torch.Tensor]
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """On-policy distillation's per-token advantages: coef x (teacher log-prob - behaviour log-prob) of each
    sampled token, the negative of that token's reverse KL from the student that sampled it to the teacher (the
    loss's ratio then corrects for the sampler like any advantage). Only the model's own tokens (each turn's
    output) have one. Figures over the batch's trained tokens: teacher_kl (the mean of behaviour - teacher
    log-prob, the reverse KL's estimate) and teacher_adv_share (sum |teacher advantage| over sum |teacher
    advantage| + sum |reward advantage|)."""
    if any(s.teacher_logprobs is None for s in samples):
        raise ValueError("teacher_coef > 0 but some samples have no teacher_logprobs: score them with the teacher "
                         "(--teacher.model), or set it to 0")  # fmt: skip
    kl = [
        torch.tensor(s.behaviour_logprobs, dtype=torch.float64) - torch.tensor(s.teacher_logprobs, dtype=torch.float64)
        for s in samples
    ]
    distill = [(-coef * k).float() for k in kl]
    tokens = sum(len(k) for k in kl)
    teacher = sum(float(d.abs().sum()) for d in distill)
    reward = sum(float(a.abs().sum()) for a in reward_advantages)
    stats = {
        "teacher_kl": sum(float(k.sum()) for k in kl) / tokens if tokens else 0.0,
        "teacher_adv_share": teacher / (teacher + reward) if teacher + reward else 0.0,
    }
    return distill, stats
