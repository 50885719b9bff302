"""The collective path (gloo on CPU, NCCL on GPUs: the mechanism's backend): the learner joins the
orchestrator's process group as rank 0 and broadcasts each version in the wire format of
contract.weight_wire (the protocol is described there), then waits for the orchestrator's ack. Without a
group, or when a send fails, a version goes through the disk as DiskPublisher's."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from contract.durable import atomic_write_json
from contract.rundir import TRANSFER_MANIFEST
from contract.weight_wire import (
    HOST_BACKENDS,
    Packed,
    TransferError,
    aborted_on_signal,
    aligned,
    broadcast_options,
    new_group,
    pack,
    signal_abort,
    staging_device,
)
from finetune.publish.disk import DiskPublisher

log = logging.getLogger("finetune.publish")


def learner_group() -> tuple[int, float | None]:
    """The learner's processes, and the timeout of their default process group (torch's default for its
    backend: accelerate leaves it there unless told otherwise); (1, None) with one process."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() <= 1:
        return 1, None
    from torch.distributed.distributed_c10d import _get_default_timeout

    return dist.get_world_size(), _get_default_timeout(dist.get_backend()).total_seconds()


def ack_wait_s(timeout_s: float, processes: int, group_timeout_s: float | None) -> float:
    """How long the main process waits for the servers' ack of a version: the transfer's timeout, but with
    several learner processes at most half the timeout of their default process group. The others wait
    meanwhile in its next collective, and its watchdog ends a process that waits past it (TRL #7103); a
    version not acked in time goes through the disk."""
    if processes > 1 and group_timeout_s:
        return min(timeout_s, group_timeout_s / 2)
    return timeout_s


class CollectivePublisher(DiskPublisher):
    def __init__(self, run, mechanism):
        super().__init__(run, mechanism)
        self.group = None
        self.generation = 0  # the group generation joined (0: none)
        self.info: dict = {}
        self.failed_generation = 0  # a generation this learner could not join (not tried again)
        self.buckets: list[torch.Tensor] = []  # the last version's buckets in host memory, packed over by the next
        self.packed: Packed | None = None  # the version written, to be sent once its checkpoint is in place

    # -- the group -------------------------------------------------------------------

    def between_batches(self) -> None:
        self.joined()

    def joined(self) -> bool:
        """Join the orchestrator's group when it set up a generation not joined yet; whether a group is
        joined. A join that fails is logged and the weights go through the disk instead."""
        info = self.run.read_json(self.run.weight_group)
        generation = int(info.get("generation", 0))
        if info.get("backend") != self.mechanism.name or generation == self.failed_generation:
            return False
        if generation != self.generation:
            log.info("joining weight-transfer group %s (generation %s, %s ranks)", info.get("backend"),
                     info.get("generation"), info.get("world_size"))  # fmt: skip
            try:
                self.join(info)
            except Exception as exc:  # noqa: BLE001 - the disk path still works
                log.warning("could not join the weight-transfer group (%s); weights go through the disk", exc)
                self.close()
                self.failed_generation = generation
                return False
        return True

    def join(self, info: dict) -> None:
        self.close()
        self.group = new_group(self.mechanism.backend, info["host"], int(info["port"]), 0, int(info["world_size"]),
                               float(info.get("timeout_s", 600)))  # fmt: skip
        self.generation, self.info = int(info["generation"]), info

    def close(self, failed: bool = False) -> None:
        """Leave the group: shut down (a failed transfer: aborted, so that nothing waits on the broadcast
        that did not complete)."""
        group, self.group, self.generation = self.group, None, 0
        if group is not None:
            try:
                group.abort() if failed else group.shutdown()
            except Exception:  # noqa: BLE001 - a group whose peers are gone may refuse; it is dropped anyway
                pass

    # -- one version -----------------------------------------------------------------

    def write(self, learner, tmp: Path, index: int, weights: dict, keep_folder: bool) -> None:
        """The manifest of version `index` (transfer.json) when a group is joined, and the model folder when
        none is or it is due anyway."""
        self.packed = None
        in_memory = self.joined()
        if not in_memory or keep_folder:
            learner.save_weights(tmp, weights)
        if in_memory:
            self.packed = self.pack(weights.items(), learner.save_dtype)
            atomic_write_json(tmp / TRANSFER_MANIFEST,
                              {"version": index, "generation": self.generation, **self.packed.manifest})  # fmt: skip

    def pack(self, named: Iterable[tuple[str, torch.Tensor]], dtype: str) -> Packed:
        """`pack` where staging_device says (weights on a GPU: on it while it has room, else in host memory),
        into the buckets of the version before when they are in host memory (on a GPU the caching allocator
        reuses freed memory by itself, and memory kept there would be taken from training)."""
        named = list(named)
        size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        nbytes = sum(aligned(t.numel() * size) for _, t in named)
        device = staging_device(named[0][1].device, nbytes) if named else None
        packed = pack(named, dtype, reuse=self.buckets, device=device)
        self.buckets = packed.buckets if all(b.device.type == "cpu" for b in packed.buckets) else []
        return packed

    def deliver(self, learner, index: int, weights: dict) -> str | None:
        """Broadcast the version written, then wait for the orchestrator's ack (RUN/weights_ack.json). Without
        a good one, write the version's model folder (which the servers then reload) and leave the group: the
        orchestrator forms a new generation."""
        packed, self.packed = self.packed, None
        if packed is None:
            return None
        start = time.perf_counter()
        timeout = ack_wait_s(float(self.info.get("timeout_s", 600)), *learner_group())
        try:
            with aborted_on_signal(self.group, self.info["host"], int(self.info["port"])):
                self.send(packed)  # a server's failure, signalled on the store, ends it at once
            deadline = time.monotonic() + timeout
            while (ack := self.run.read_json(self.run.weights_ack)).get("version") != index:
                if time.monotonic() > deadline:
                    raise TransferError(f"no ack of version {index} within {timeout:.0f} s")
                time.sleep(0.02)
            if not ack.get("ok"):
                raise TransferError(ack.get("reason") or "refused")
        except Exception as exc:  # noqa: BLE001 - the disk path still works
            signal_abort(self.info["host"], int(self.info["port"]), f"the learner: {type(exc).__name__}: {exc}")
            self.close(failed=True)
            if not self.run.has_weights(index):
                learner.save_weights(self.run.checkpoint(index), weights)
            failed = f"{type(exc).__name__}: {exc}"
            log.warning("version %d: transfer failed (%s); its weights were written to disk", index, failed)
            return failed
        log.info("version %d sent in memory in %.2f s (%d buckets)", index, time.perf_counter() - start,
                 len(packed.buckets))  # fmt: skip
        return None

    def send(self, packed: Packed) -> float:
        """Broadcast every bucket (blocks until all ranks have it, or the group's timeout: NCCL's waits block
        too, contract.weight_wire.NCCL_GROUP_ENV); seconds taken."""
        if self.group is None:
            raise TransferError("no weight-transfer group joined")
        start = time.perf_counter()
        opts = broadcast_options()
        on_host = self.mechanism.backend in HOST_BACKENDS  # gloo sends from host memory, NCCL from the GPU
        for bucket in packed.buckets:
            bucket = bucket.cpu() if on_host else bucket.cuda()
            self.group.broadcast([bucket], opts).wait()
        return time.perf_counter() - start
