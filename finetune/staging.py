"""The trainer's state copied to host memory between steps, for a thread to write while training goes on.

A full trainer state (fp32 weights, AdamW's two moments, RNG) is most of what a learner writes: 14.8 GB
for a 1B model, 20-28 s on the H200 we measured, two to three optimizer steps. `HostStage.copy` takes a
copy of its tensors at one moment (between steps: the optimizer updates its tensors in place, so the live
ones cannot be written while training goes on); `Learner.stage_trainer_state` writes that copy with
accelerate's own `save_accelerator_state`, the files `Accelerator.load_state` reads.

On CUDA the copies go to page-locked buffers that are kept and reused by the next save (allocating them
is the slow part: a copy into them runs at the bus's speed); on CPU they are plain copies, freed after
the write. Tensors that share storage (a tied output head) stay shared in the copy, so accelerate's
save drops the duplicate as it does for the live model.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch


class HostStage:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}  # reused between saves (CUDA only)

    def copy(self, tree, name: str = ""):
        """`tree` (nested dicts, lists and tuples of tensors and plain values) with every tensor copied to
        host memory; other values are kept as they are (they are not updated in place)."""
        shared: dict[tuple, torch.Tensor] = {}
        out = self._copy(tree, name, shared)
        if self.cuda:
            torch.cuda.synchronize()  # the non-blocking copies have landed
        return out

    def _copy(self, value, name: str, shared: dict):
        if isinstance(value, torch.Tensor):
            key = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), value.dtype,
                   tuple(value.shape), value.stride())  # fmt: skip
            if key not in shared:
                shared[key] = self._host(value.detach(), name)
            return shared[key]
        if isinstance(value, dict):  # an OrderedDict stays one: accelerate's save tells a state dict by it
            copied = {k: self._copy(v, f"{name}/{k}", shared) for k, v in value.items()}
            return OrderedDict(copied) if isinstance(value, OrderedDict) else copied
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(v, f"{name}/{i}", shared) for i, v in enumerate(value))
        return value

    def _host(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        if not self.cuda or tensor.device.type != "cuda":
            return tensor.to("cpu", copy=True)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return buffer.copy_(tensor, non_blocking=True)

    @property
    def kept_bytes(self) -> int:
        """Host memory held between saves (the page-locked buffers)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def host_memory_available() -> int | None:
    """Bytes of host memory available now (Linux's MemAvailable); None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
