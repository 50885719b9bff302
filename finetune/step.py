"""One optimizer step of the learner, and the critic's step alone.

A step on some of a batch's samples: this process's share of the step's length-sorted micro-batches, each
forwarded and backwarded (the loss weights are those of the whole step, so the summed gradient is the step's
whatever the number of processes); truncated importance sampling against the trainer's own log-probs from
before the batch's first update; on the batch's first step, the training-inference mismatch; the loss's
terms tallied and reduced over the processes (finetune.tally); then each optimizer clipped and stepped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from contract.batch import Sample, lag
from finetune.config import TrainConfig
from finetune.critic import CriticBatch
from finetune.losses import LossInputs, tis_weights, token_weights
from finetune.models import Models
from finetune.passes import Passes
from finetune.tally import StepTally, advantage_metrics, loss_metrics, loss_terms


class TeacherTopK(NamedTuple):
    """A micro-batch's targets from the teacher's top-k, per trained token (rows padded to the widest k)."""

    ids: torch.Tensor  # [n, k] token ids
    q: torch.Tensor  # [n, k] the teacher's probabilities renormalised over its top k (0 in padding)
    neg_entropy: torch.Tensor  # [n] sum q log q: the KL to q is the cross-entropy to it plus this


def teacher_top(seqs: list[Sample], vocab: int | None = None) -> TeacherTopK:
    """The teacher's top-k of `seqs`' trained tokens, in the micro-batch's order, as targets: q = its
    probabilities renormalised over the k tokens (softmax of their log-probs). A token id the student's head
    does not have (`vocab`: its rows; a teacher whose head is padded further) is left out of q."""
    ids = [row for s in seqs for row in s.teacher_top_ids]
    lps = [row for s in seqs for row in s.teacher_top_logprobs]
    k = max(map(len, ids))
    id_t = torch.tensor([row + [row[0]] * (k - len(row)) for row in ids], dtype=torch.long)
    lp_t = torch.tensor([row + [-math.inf] * (k - len(row)) for row in lps], dtype=torch.float32)
    if vocab is not None and (outside := id_t >= vocab).any():
        id_t, lp_t = id_t.masked_fill(outside, 0), lp_t.masked_fill(outside, -math.inf)
    q = torch.softmax(lp_t, dim=-1).nan_to_num(0.0)  # a row left wholly out: no target
    log_q = torch.log_softmax(lp_t, dim=-1)
    return TeacherTopK(id_t, q, torch.where(q > 0, q * log_q, torch.zeros_like(q)).sum(-1))


class OptimizerStep:
    """Optimizer steps on the batch `start` set up; `loss_terms` names what the loss reported in the last."""

    def __init__(self, models: Models, passes: Passes, config: TrainConfig):
        self.models, self.passes, self.config = models, passes, config
        self.loss_terms: list[str] = []
        self._progress = None  # [done, total, callback] of the batch being trained
        self._trainer_old = None  # per sample: the trainer's log-probs before the batch's first update (TIS)
        self._lag0: list[list[bool]] = []  # per sample, per trained token: sampled by the weights training it
        self.fresh = False  # the batch's first optimizer step (log-probs not yet updated)

    def start(self, samples: list[Sample], batch_index: int, tokens: int, on_progress: Callable | None) -> None:
        """Before the batch's first step: its trainer log-probs (TIS), which tokens are of lag 0, the progress
        (`tokens`: the completion tokens its steps will train, over all epochs)."""
        self._progress = [0, tokens, on_progress]
        # Truncated importance sampling: the trainer's own log-probs before any update of this batch.
        self._trainer_old = self.passes.logprobs(samples) if self.config.tis_cap is not None else None
        # The training-inference mismatch is measured in the batch's first step (log-probs not yet updated),
        # over tokens of lag 0 (sampled by the weights trained here) or of unknown version.
        self._lag0 = [[v is None or lag(batch_index, v) == 0 for v in s.token_versions()] for s in samples]
        self.fresh = True

    def run(self, samples: list[Sample], idx: list[int], advantages, rewards, critic=None) -> dict:
        """One optimizer step on samples[idx]: this process's share of the step's micro-batches, each
        forwarded and backwarded; the optimizers stepped; the metrics summed over processes."""
        t0 = time.perf_counter()
        sub = [samples[i] for i in idx]
        mbs = self.passes.micro_batches(sub)
        n_completion = sum(s.n_trained for s in sub)
        lr = self._set_lr()
        tally = StepTally()
        mine = self.passes.my_share(mbs)
        for k, (mb, scale) in enumerate(mine):
            seqs = [sub[i] for i in mb.indices]
            rows = [idx[i] for i in mb.indices]  # the micro-batch's samples, as indices into the batch
            weights = token_weights(mb.completion_lengths, self.config.aggregation, n_completion, len(sub)) * scale
            sync = k == len(mine) - 1
            out, result, vllm_logp = self._forward_backward(mb, seqs, rows, advantages, critic, weights, sync)
            if scale:
                self._tally(tally, mb, seqs, rows, out, result, vllm_logp)
                self._report_progress(mb)
        grad_norm, critic_norm = self._apply_gradients()
        sums = tally.reduce(self.models.accelerator)
        self.loss_terms = loss_terms(sums)
        seconds = time.perf_counter() - t0
        tokens, slots = sums.base["tokens"], sums.base["slots"]
        m = {"step": self.models.step, **loss_metrics(sums, n_completion)}
        m.update(advantage_metrics(torch.cat([advantages[i] for i in idx])))  # per trained token
        m["reward_mean"] = float(rewards[idx].mean())
        m["grad_norm"] = float(grad_norm)
        if critic_norm is not None:
            m["critic_grad_norm"] = float(critic_norm)
        m.update(
            {
                "lr": lr,
                "samples": len(idx),
                "completion_tokens": n_completion,
                "tokens": int(tokens),
                # every sample's prompt + completion counted as if alone: what a shared prompt or a tree's
                # shared prefix (the shared_prefix layout) saves is 1 - tokens / logical_tokens
                "logical_tokens": sum(len(s.prompt_ids) + len(s.completion_ids) for s in sub),
                "padding_frac": 1 - tokens / slots if slots else 0.0,
                "micro_batches": len(mbs),
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
            }
        )
        return m

    def _set_lr(self) -> float:
        """This step's learning rates: the schedule's factor times each parameter group's own lr."""
        cfg = self.config
        lr = cfg.lr_at(self.models.step)
        for optimizer in self.models.optimizers():
            for group in optimizer.param_groups:
                group["lr"] = group.get("base_lr", cfg.lr) * lr / cfg.lr
        return lr

    def _forward_backward(self, mb, seqs, rows, advantages, critic, weights, sync: bool):
        """The loss of one micro-batch, backwarded (gradients synchronised over processes only when sync).

        Returns the policy's output, the loss's LossOutputs and vLLM's log-probs of the tokens."""
        cfg, acc, dev = self.config, self.models.accelerator, self.models.accelerator.device
        adv = torch.cat([advantages[r] for r in rows])
        vllm_logp = torch.tensor([x for s in seqs for x in s.behaviour_logprobs])
        behaviour = vllm_logp
        if self._trainer_old is not None:  # TIS: ratio against the trainer's log-probs, weighted by the cap
            old = torch.cat([self._trainer_old[r] for r in rows])
            adv = adv * tis_weights(old, behaviour, cfg.tis_cap)
            behaviour = old
        ref = (
            torch.tensor([x for s in seqs for x in s.ref_logprobs])
            if all(s.ref_logprobs is not None for s in seqs)
            else None
        )
        inv_temp = torch.tensor([1.0 / s.temperature for s in seqs for _ in range(s.n_trained)])
        # The reference is scored at T = 1: the KL takes untempered log-probs.
        tempered = bool((inv_temp != 1).any())
        top = teacher_top(seqs, self.models.vocab_size) if cfg.teacher_topk_coef else None
        with self.passes.no_sync(sync):
            out = self.passes.policy(mb, inv_temp, ref is not None and tempered, None if top is None else top.ids)
            x = LossInputs(
                logp=out.logp,
                behaviour_logp=behaviour.to(dev),
                advantages=adv.to(dev),
                weights=weights.to(dev),
                ref_logp=None if ref is None else ref.to(dev),
                kl_logp=out.raw_logp,
                kl_coef=cfg.kl_coef,
                lengths=list(mb.completion_lengths),
                entropy=out.entropy,
                entropy_coef=cfg.entropy_coef,
            )
            if critic is not None:
                x.values = out.values if self.models.value_model is None else self.passes.values(mb)
                old_values, returns = critic.rows(rows)
                x.old_values, x.returns = old_values.to(dev), returns.to(dev)
            result = cfg.loss_spec.fn(x, cfg.loss_options)
            if top is not None:  # the teacher's top-k: cross-entropy to it, token by token, aggregated as the loss
                xent = -(top.q.to(dev) * out.soft_logp).sum(-1)
                w = weights.to(dev)
                result.loss = result.loss + cfg.teacher_topk_coef * (w * xent).sum()
                result.terms["teacher_topk_kl"] = (w * (xent.detach() + top.neg_entropy.to(dev))).sum()
            # Gradients are averaged over processes; the weights already
            # divide by the step's totals, so undo the average.
            acc.backward(result.loss * acc.num_processes)
        return out, result, vllm_logp

    def _tally(self, tally: StepTally, mb, seqs, rows, out, result, vllm_logp) -> None:
        """Add one micro-batch's loss, entropy, token counts and the loss's terms and extremes to the step's;
        on the batch's first step, its training-inference mismatch too."""
        tally.add("base", {"loss": result.loss.item(), "entropy": out.entropy.detach().sum().item(),
                           "tokens": mb.n_tokens, "slots": mb.n_slots})  # fmt: skip
        if self.fresh:
            tally.add("mismatch", self._mismatch(tally, rows, out.logp, vllm_logp))
        tally.add("terms", {name: value.item() for name, value in result.terms.items()})
        tally.add("token_sums", {name: value.sum().item() for name, value in result.token_means.items()})
        for name, value in result.token_extremes.items():
            tally.extreme(name, value.max().detach().cpu(), value.min().detach().cpu())

    def _mismatch(self, tally: StepTally, rows, logp, vllm_logp) -> dict[str, float]:
        """The gap between the trainer's and vLLM's log-probs over the micro-batch's lag-0 tokens: sums of
        |gap| and of the ratio e^gap and their count (StepSums.mismatch); the ratio's max goes to the tally."""
        lag0 = torch.tensor([flag for r in rows for flag in self._lag0[r]])
        gap = (logp.detach().float().cpu() - vllm_logp)[lag0]
        hi = gap.exp().max() if len(gap) else torch.tensor(-math.inf)
        tally.extreme("tis_ratio", hi, torch.tensor(math.inf))  # its minimum is not reported
        return {"abs": gap.abs().sum().item(), "ratio": gap.exp().sum().item(), "n": float(len(gap))}

    def _report_progress(self, mb) -> None:
        """Count the micro-batch's completion tokens (on every process) and tell on_progress."""
        progress = self._progress
        if progress and progress[2] is not None:
            done = progress[0] + sum(mb.completion_lengths) * self.models.accelerator.num_processes
            progress[0] = min(progress[1], done)
            progress[2](progress[0], progress[1])

    def _apply_gradients(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Clip (grad_clip 0: measure only), step and zero each optimizer; count the step. Returns the policy's
        and the critic's (None without one) gradient norms."""
        models = self.models
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        grad_norm = models.accelerator.clip_grad_norm_(models.model.parameters(), max_norm)
        models.optimizer.step()
        models.optimizer.zero_grad(set_to_none=True)
        critic_norm = self._step_critic() if models.value_model is not None else None
        models.step += 1
        return grad_norm, critic_norm

    def _step_critic(self) -> torch.Tensor:
        """Clip the separate value model's gradients (grad_clip 0: measure only), step and zero its
        optimizer; returns its gradient norm."""
        models = self.models
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        norm = models.accelerator.clip_grad_norm_(models.value_model.parameters(), max_norm)
        models.value_optimizer.step()
        models.value_optimizer.zero_grad(set_to_none=True)
        return norm

    def critic_step(self, samples: list[Sample], critic: CriticBatch) -> dict:
        """One optimizer step of the separate value model alone on samples (the policy is not touched): the
        clipped value loss against `critic` (critic_batch's), aggregated like the policy's loss. Returns
        value_loss and critic_grad_norm (bench/bench_critic.py replays a run's batches through it)."""
        if self.models.value_model is None:
            raise ValueError("critic_step needs the separate value model (ppo.critic separate)")
        cfg, acc, dev = self.config, self.models.accelerator, self.models.accelerator.device
        n_completion = sum(s.n_trained for s in samples)
        mine = self.passes.my_share(self.passes.micro_batches(samples))
        total = 0.0
        for k, (mb, scale) in enumerate(mine):
            weights = token_weights(mb.completion_lengths, cfg.aggregation, n_completion, len(samples)) * scale
            with self.passes.no_sync(k == len(mine) - 1):
                values = self.passes.values(mb)
                old_values, returns = critic.rows(mb.indices)
                vl, _ = self.models.critic.value_loss(values, old_values.to(dev), returns.to(dev))
                loss = (weights.to(dev) * vl).sum()
                acc.backward(loss * acc.num_processes)
            total += float(loss.detach())
        return {"value_loss": total, "critic_grad_norm": float(self._step_critic())}
