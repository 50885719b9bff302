"""The models' forward passes over micro-batches: the samples cut into micro-batches (this process's share of
them under several processes), the policy's log-probs (and entropy, values) of one, the critic's values, and
the log-probs and values of whole samples without an update."""

from __future__ import annotations

import math
from contextlib import ExitStack

import torch

from contract.batch import Sample
from finetune.config import TrainConfig
from finetune.lora import ADAPTER, activate, role_adapter
from finetune.microbatch import MicroBatch, micro_batches
from finetune.models import Models


def fork_parents(samples: list[Sample]) -> list[int | None]:
    """For each sample of a fork (`branch`, tree rollouts), the sample of its parent episode that starts with
    the same prompt (the layout shares what they start with); none for the others."""
    first: dict[tuple[str, tuple[int, ...]], int] = {}
    for i, s in enumerate(samples):
        if s.episode_id is not None:
            first.setdefault((s.episode_id, tuple(s.prompt_ids)), i)
    return [first.get((s.branch.parent_id, tuple(s.prompt_ids))) if s.branch is not None else None for s in samples]


class Passes:
    def __init__(self, models: Models, config: TrainConfig):
        self.models, self.config = models, config
        self._active = ADAPTER  # the adapter applied (finetune.lora.with_lora starts with the policy's)

    def micro_batches(self, samples: list[Sample]) -> list[MicroBatch]:
        """The samples cut into micro-batches of at most token_budget tokens, in the configured layout; with
        roles of their own adapter (lora.roles), each micro-batch of one adapter's samples."""
        lora = self.config.lora
        if not lora.roles:
            return self._micro_batches(samples)
        by_adapter: dict[str, list[int]] = {}
        for i, sample in enumerate(samples):
            by_adapter.setdefault(role_adapter(lora, sample.role), []).append(i)
        out = []
        for name, members in by_adapter.items():
            for mb in self._micro_batches([samples[i] for i in members]):
                mb.indices, mb.adapter = [members[i] for i in mb.indices], name
                out.append(mb)
        return out

    def _micro_batches(self, samples: list[Sample]) -> list[MicroBatch]:
        cfg = self.config
        return micro_batches(
            [s.prompt_ids for s in samples],
            [s.completion_ids for s in samples],
            cfg.token_budget,
            cfg.layout,
            self.models.pad_id,
            [s.trained_positions() for s in samples],
            fork_parents(samples),
        )

    def my_share(self, mbs: list[MicroBatch]) -> list[tuple[MicroBatch, float]]:
        """This process's micro-batches (every world_size-th), each with its weight scale (1, or 0 for padding).

        Every process must run the same number of forward/backward passes (DDP / FSDP synchronise on them):
        a process short of micro-batches repeats one with zero weight."""
        acc = self.models.accelerator
        world, rank = acc.num_processes, acc.process_index
        per_rank = math.ceil(len(mbs) / world)
        mine = [(mb, 1.0) for mb in mbs[rank::world]]
        mine += [(mbs[0], 0.0)] * (per_rank - len(mine))
        return mine

    def no_sync(self, sync: bool) -> ExitStack:
        """A context that holds back the gradient all-reduce of every trained model unless sync."""
        stack = ExitStack()
        if not sync:
            for model in self.models.trained():
                stack.enter_context(self.models.accelerator.no_sync(model))
        return stack

    def policy(self, mb: MicroBatch, inv_temp: torch.Tensor, raw: bool, soft_ids: torch.Tensor | None = None):
        """The policy on one micro-batch: log-probs of its targets at inv_temp (and untempered ones if raw; at
        `soft_ids` [n, k], a teacher's top-k tokens of each target's position, untempered, when given)."""
        dev = self.models.accelerator.device
        self._activate(mb)
        return self.models.model(
            mb.input_ids.to(dev),
            None if mb.position_ids is None else mb.position_ids.to(dev),
            mb.rows.to(dev),
            mb.cols.to(dev),
            mb.targets.to(dev),
            inv_temp.to(dev),
            raw,
            None if mb.attention_mask is None else mb.attention_mask.to(dev),
            None if soft_ids is None else soft_ids.to(dev),
        )

    def values(self, mb: MicroBatch) -> torch.Tensor:
        """The critic's value before each trained token of the micro-batch (from the separate value model, or
        the policy's value head)."""
        dev = self.models.accelerator.device
        args = (
            mb.input_ids.to(dev),
            None if mb.position_ids is None else mb.position_ids.to(dev),
            mb.rows.to(dev),
            mb.cols.to(dev),
        )
        mask = None if mb.attention_mask is None else mb.attention_mask.to(dev)
        self._activate(mb)
        if self.models.value_model is not None:
            return self.models.value_model(*args, attention_mask=mask)
        inv_temp = torch.ones(len(mb.targets), device=dev)
        return self.models.model(*args, mb.targets.to(dev), inv_temp, False, mask).values

    def _activate(self, mb: MicroBatch) -> None:
        """The micro-batch's adapter applied, where roles have adapters of their own."""
        if mb.adapter is not None and mb.adapter != self._active:
            activate(self.models.accelerator.unwrap_model(self.models.model).lm, mb.adapter)
            self._active = mb.adapter

    @torch.no_grad()
    def sample_values(self, samples: list[Sample]) -> list[torch.Tensor]:
        """The critic's value before each trained token of each sample (no update)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        for mb in self.micro_batches(samples):
            values = self.values(mb)
            for i, part in zip(mb.indices, values.float().cpu().split(mb.completion_lengths)):
                out[i] = part
        return out

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Current log-probs of each sample's completion tokens (at its temperature), no update."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        for mb in self.micro_batches(samples):
            inv_temp = torch.tensor(
                [1.0 / samples[i].temperature for i in mb.indices for _ in range(samples[i].n_trained)]
            )
            logp = self.policy(mb, inv_temp, False).logp
            for i, part in zip(mb.indices, logp.float().cpu().split(mb.completion_lengths)):
                out[i] = part
        return out

    @torch.no_grad()
    def fingerprint(self) -> torch.Tensor:
        """Per-tensor sums of the policy's weights (float64): any update moves at least one of them."""
        model = self.models.accelerator.unwrap_model(self.models.model)
        return torch.stack([p.detach().double().sum().cpu() for p in model.parameters()])
