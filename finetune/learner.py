"""The learner: a model and its optimizer, trained one batch of samples at a time.

`Learner.train_batch` is one iteration of the chosen loss (finetune.losses: GRPO, REINFORCE, GSPO, PPO): the
batch's advantages (finetune.batch_advantages, kept in `turn_records` for the run directory), then `epochs`
passes over the batch, each cut into `steps_per_epoch` optimizer steps (finetune.step). It returns one
metrics dict per optimizer step: the learner's figures and every term the loss reported, under the loss's
own names (`loss_terms` names those of the last step).

The parts, each in its module: what is trained, built (finetune.models); the forward passes
(finetune.passes); the optimizer step (finetune.step); the policy's weights and adapters going out
(finetune.export); the trainer state to resume from (finetune.trainer_state). This class holds them together
for the learner process (finetune.train), the tests and the bench scripts.

Works the same in one process on CPU and under `accelerate launch` on GPUs (DDP or FSDP): each process takes
every world_size-th micro-batch of a step and the loss weights are those of the whole step, so the summed
gradient is the step's gradient whatever the number of processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import Accelerator

from contract.batch import Sample
from finetune.batch_advantages import BatchAdvantages, batch_advantages, drop_stale, is_cut, keep_roles
from finetune.config import TrainConfig
from finetune.critic import CriticBatch
from finetune.export import Export
from finetune.models import build_models, mixed_precision_for
from finetune.passes import Passes
from finetune.step import OptimizerStep
from finetune.trainer_state import TrainerState


class Learner:
    def __init__(self, model_dir: str | os.PathLike, config: TrainConfig, accelerator: Accelerator | None = None):
        self.config = config
        self.model_dir = Path(model_dir)
        acc = accelerator or Accelerator(mixed_precision=mixed_precision_for(config))
        self.models = build_models(self.model_dir, config, acc)
        self.passes = Passes(self.models, config)
        self.steps = OptimizerStep(self.models, self.passes, config)
        self.export = Export(self.models, config, self.model_dir)
        self.state = TrainerState(self.models, config)
        self.turn_records: list[dict] = []  # the last batch's, per sample and turn (finetune.batch_advantages)

    # the parts callers reach for
    accelerator = property(lambda self: self.models.accelerator)
    model = property(lambda self: self.models.model)
    optimizer = property(lambda self: self.models.optimizer)
    value_model = property(lambda self: self.models.value_model)
    critic = property(lambda self: self.models.critic)
    pad_id = property(lambda self: self.models.pad_id)
    save_dtype = property(lambda self: self.export.save_dtype)
    loss_terms = property(lambda self: self.steps.loss_terms)
    writes_state_in_background = property(lambda self: self.state.in_background)
    background_state_why = property(lambda self: self.state.background_why)

    @property
    def step(self) -> int:
        """Optimizer steps taken so far, over the whole run."""
        return self.models.step

    # ---- training ---------------------------------------------------------------------------

    def train_batch(self, samples: list[Sample], batch_index: int = 0, on_step=None, on_progress=None) -> list[dict]:
        """Train on one batch; returns one metrics dict per optimizer step (also passed to on_step).

        on_progress(done, total) is called after each micro-batch, in completion tokens over all epochs.
        """
        cfg = self.config
        samples, role_stats = keep_roles(samples, cfg.roles)
        samples, lag_stats = drop_stale(samples, batch_index, cfg.max_lag)
        lag_stats.update(role_stats)
        if not samples:  # every sample was too stale: no step, the weights stay as they were
            self.turn_records = []
            return [self._no_step(batch_index, lag_stats)]
        if cfg.needs_reference and any(s.ref_logprobs is None for s in samples):
            raise ValueError(
                "kl_coef > 0 (or ppo.kl_in_reward > 0) but some samples have no ref_logprobs: score "
                "them with the reference model, or set it to 0"
            )
        if cfg.teacher_topk_coef and (missing := sum(s.teacher_top_ids is None for s in samples)):
            raise ValueError(f"teacher_topk_coef > 0 but {missing} of {len(samples)} samples have no teacher "
                             "top-k (teacher_top_ids): score them with --teacher.topk, or set it to 0")  # fmt: skip
        adv = batch_advantages(samples, cfg, self.critic, self.passes.sample_values, self.untempered_logprobs)
        self.turn_records = adv.turn_records
        # Overlong filtering: samples with an output cut by the limit counted in the baseline, not trained on.
        trained = [i for i, s in enumerate(samples) if not (cfg.overlong_filter and is_cut(s))]
        if cfg.overlong_filter:
            lag_stats = {**lag_stats, "overlong_masked": len(samples) - len(trained)}
        if not trained:  # every sample was cut: no step, the weights stay as they were
            return [self._no_step(batch_index, lag_stats)]
        return self._epochs(samples, trained, adv, batch_index, {**adv.stats, **lag_stats}, on_step, on_progress)

    def _no_step(self, batch_index: int, lag_stats: dict) -> dict:
        return {"batch": batch_index, "epoch": 0, "step_in_batch": 0, "step": self.step, "samples": 0,
                "weights_changed": False, **lag_stats}  # fmt: skip

    def _epochs(self, samples, trained: list[int], adv: BatchAdvantages, batch_index: int, batch_stats: dict,
                on_step: Callable | None, on_progress: Callable | None) -> list[dict]:  # fmt: skip
        """The batch's optimizer steps over `epochs` passes of its `trained` samples."""
        cfg = self.config
        kept = torch.tensor(trained)
        rewards = torch.tensor([sample.reward for sample in samples], dtype=torch.float64)
        # Same shuffle after a restart: seeded by the batch number.
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + batch_index)
        metrics = []
        self.steps.start(samples, batch_index, cfg.epochs * sum(samples[i].n_trained for i in trained), on_progress)
        before = self.passes.fingerprint()  # the weights before the batch's first step
        for epoch in range(cfg.epochs):
            order = kept[torch.randperm(len(kept), generator=gen)] if cfg.steps_per_epoch > 1 else kept
            for part in torch.tensor_split(order, cfg.steps_per_epoch):
                if len(part) == 0:
                    continue
                m = self.steps.run(samples, part.tolist(), adv.per_token, rewards, adv.critic)
                # recorded for the orchestrator: an unchanged model cannot be told from a failed reload
                after = self.passes.fingerprint()
                m["weights_changed"] = not torch.equal(before, after)
                before = after  # one fingerprint per step: the next step starts from this one
                self.steps.fresh = False
                m = {"batch": batch_index, "epoch": epoch, "step_in_batch": len(metrics), **m, **batch_stats}
                metrics.append(m)
                if on_step is not None:
                    on_step(m)
        return metrics

    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Current log-probs of each sample's completion tokens (at its temperature), no update."""
        return self.passes.logprobs(samples)

    def untempered_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Current log-probs of each sample's completion tokens at T = 1, whatever it was sampled at (no update)."""
        return self.passes.logprobs([s.model_copy(update={"temperature": 1.0}) for s in samples])

    def critic_batch(self, samples: list[Sample]) -> CriticBatch:
        """The critic's advantages, old values and returns of `samples` as they are now (no update)."""
        if self.critic is None:
            raise ValueError(f"loss {self.config.loss} has no critic")
        at_1 = self.untempered_logprobs(samples) if self.critic.needs_untempered(samples) else None
        return self.critic.batch(samples, self.passes.sample_values(samples), at_1)

    def critic_step(self, samples: list[Sample], critic: CriticBatch) -> dict:
        """One optimizer step of the separate value model alone (finetune.step.OptimizerStep.critic_step)."""
        return self.steps.critic_step(samples, critic)

    def _fingerprint(self) -> torch.Tensor:
        return self.passes.fingerprint()

    # ---- what goes out: weights, adapters (finetune.export), the trainer state (finetune.trainer_state) ----

    def policy_weights(self) -> dict | None:
        return self.export.policy_weights()

    def adapter_weights(self) -> dict | None:
        return self.export.adapter_weights()

    def save_weights(self, folder: str | os.PathLike, weights: dict) -> None:
        self.export.save_weights(folder, weights)

    def save_adapter(self, folder: str | os.PathLike, tensors: dict) -> Path:
        return self.export.save_adapter(folder, tensors)

    def save_trainer_state(self, folder: str | os.PathLike, progress: dict) -> None:
        self.state.save(folder, progress)

    def stage_trainer_state(self, folder: str | os.PathLike, progress: dict) -> Callable[[], None]:
        return self.state.stage_state(folder, progress)

    def background_state_choice(self) -> tuple[bool, str]:
        return self.state.background_choice()

    def load_trainer_state(self, folder: str | os.PathLike) -> dict:
        return self.state.load(folder)

    def save_checkpoint(self, folder: str | os.PathLike, progress: dict) -> None:
        """A Hugging Face model folder plus trainer_state/. Not atomic by itself: write into a temp folder
        and rename (contract.rundir)."""
        weights = self.policy_weights()
        if weights is not None:
            self.save_weights(folder, weights)
        del weights
        self.save_trainer_state(folder, progress)
