"""The servers' end of the collective path (gloo or nccl): a vLLM weight-transfer engine, loaded as a plugin.

vLLM 0.32 creates a weight-transfer engine in each worker when the server is started with
`--weight-transfer-config '{"backend": "tapeloop"}'` (contract.weight_paths.ENGINES), and drives it through
its HTTP routes (/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update;
dev mode). The plugin's entry point (orchestrate.serving.vllm_plugin.weight_engine.register) registers this
class by path, so vLLM imports this module, and with it vLLM's weight-transfer API, only when a server
creates the engine. The group's backend, gloo or nccl, is named at init, so CPU machines (and CI) run the
very protocol that GPUs run.

The wire format is contract.weight_wire, which the learner's end (finetune.publish.collective) imports too.
Unlike vLLM's own NCCL engine, a version is received whole into staging buffers and checked against its
manifest before any weight is loaded: a partial or corrupted transfer raises (the route answers HTTP 500)
and the server goes on holding the version it had, never a mix of two; so does a version that lacks a weight,
and a load that leaves a parameter of the model unset. A tensor-parallel worker (or a version sent with
"bucketed") receives and loads one bucket at a time instead (receive_in_buckets): a failure part-way leaves a
mix, which the orchestrator's disk fallback replaces. Any failure is signalled on the group's store, so that
every rank aborts its end at once (contract.weight_wire.signal_abort).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from contract.weight_wire import (
    HOST_BACKENDS,
    TransferError,
    aborted_on_signal,
    barrier,
    check_bucket,
    first_broadcast,
    group_env,
    new_buffer,
    receive,
    receive_each,
    signal_abort,
    staging_device,
    unpack,
)  # fmt: skip

logger = logging.getLogger("vllm.tapeloop")  # vLLM's handlers: the server's log


def unpinned(backend: str):
    """Around an NCCL group's set-up: vLLM's unpinned_nccl_env where the installed vLLM has it. The NCCL
    variables vLLM pins for its own communicators (vllm.utils.nccl.pin_nccl_env) are not the learner's, and
    NCCL does not reconcile them across ranks: a communicator shared with another process is built without
    them, or it may hang. gloo, or a vLLM without it: nothing."""
    if backend in HOST_BACKENDS:
        return contextlib.nullcontext()
    try:
        from vllm.utils.nccl import unpinned_nccl_env
    except ImportError:
        return contextlib.nullcontext()
    return unpinned_nccl_env()


def unloaded(model, loaded) -> list[str]:
    """The model's parameters that `loaded` (what its load_weights returned: the names it set) lacks, as
    vLLM's own loader checks them after a first load (DefaultModelLoader.track_weights_loading). A load that
    reports nothing (None) cannot be checked: nothing is named."""
    if loaded is None:
        return []
    return sorted({name for name, _ in model.named_parameters()} - set(loaded))


def group_and_store(init, info, rank: int, backend: str, vllm_config):
    """vLLM's stateless process group (`init`: vllm.distributed.utils.stateless_init_torch_distributed_process_group)
    and the raw TCP store under it, where the barrier and the abort key live, both bounded by the transfer
    timeout (`info.timeout_s`). vLLM 0.32's `init` takes the timeout. 0.26's takes none: it reads the current
    vLLM config's `parallel_config.distributed_timeout_seconds` (NCCL) or `cpu_distributed_timeout_seconds`
    (gloo), else PyTorch's default (600 s for NCCL, 1800 s for gloo) bounds the rendezvous, the group's
    forming and every collective; so there the group is built under a copy of the server's config (`vllm_config`)
    that sets both."""
    import inspect
    from datetime import timedelta

    where = (info.host, info.port, rank, info.world_size)
    if "timeout" in inspect.signature(init).parameters:
        return init(*where, backend=backend, return_store=True, timeout=timedelta(seconds=info.timeout_s))
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(timed(vllm_config, info.timeout_s)):
        return init(*where, backend=backend, return_store=True)


def timed(vllm_config, seconds: float):
    """A copy of `vllm_config` whose device and CPU process groups time out after `seconds` (whole seconds,
    rounded up); the server's own config is left as it is."""
    import copy
    import math

    parallel = copy.copy(vllm_config.parallel_config)
    parallel.distributed_timeout_seconds = parallel.cpu_distributed_timeout_seconds = math.ceil(seconds)
    config = copy.copy(vllm_config)
    config.parallel_config = parallel
    return config


@dataclass
class InitInfo(WeightTransferInitInfo):
    backend: str
    host: str
    port: int
    world_size: int
    rank_offset: int = 1  # rank 0 is the learner
    timeout_s: float = 600.0


@dataclass
class UpdateInfo(WeightTransferUpdateInfo):
    version: int
    manifest: dict = field(default_factory=dict)
    bucketed: bool = False  # one bucket at a time where a version would be staged whole (tests force it)


class CollectiveEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.backend, self.store_at = None, ("", 0)  # the group's backend and its store's host and port
        # Staging in host memory (gloo; NCCL when the GPU has no room for a version) is kept for the next
        # version, received over it when the sizes match: a fresh buffer costs a page fault per 4 KiB
        # (receiving into kept ones is 3x faster on CPU); one version's bytes stay in host memory. On a GPU:
        # fresh ones, which the caching allocator serves from freed memory without holding it for good.
        # Received one bucket at a time: the one bucket's buffer, kept on either.
        self.staging: list = []
        # The weight names of the last version loaded whole (checked by `load`): a version without one of
        # them is refused before anything is loaded, so the served version stays whole.
        self.names: set[str] = set()
        self.pending: set[str] = set()

    def init_transfer_engine(self, init_info: InitInfo) -> None:

        import torch
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.shutdown()  # a new generation of the group replaces the old one
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        self.backend, self.store_at = init_info.backend, (init_info.host, init_info.port)
        with unpinned(self.backend):  # NCCL builds its communicator at the first collective: that too
            with group_env(self.backend):  # NCCL: waits that block and raise, no watchdog ending the server
                self.group, store = group_and_store(stateless_init_torch_distributed_process_group, init_info,
                                                    rank, self.backend, self.vllm_config)  # fmt: skip
            try:
                barrier(store, init_info.world_size, init_info.timeout_s)  # before NCCL's set-up, which has none
                first_broadcast(self.group, torch.device("cpu") if self.backend in HOST_BACKENDS else self.device)
            except Exception:
                self.shutdown()
                raise

    @staticmethod
    def trainer_send_weights(*args, **kwargs) -> None:
        """vLLM's own trainer side (abstract in 0.26): ours is finetune.publish.collective, in the learner."""
        raise NotImplementedError("tapeloop's learner sends through finetune.publish.collective")

    def start_weight_update(self) -> None:
        """Nothing to do yet: the model is touched only once a whole version has arrived."""

    def finish_weight_update(self) -> None:
        """Nothing left: receive_weights loaded the checked version as a whole."""

    def update_weights(self, update_info: dict) -> None:
        # The base class adds torch.accelerator.synchronize(), which needs a GPU; loading is synchronous here.
        if self.group is None:
            raise TransferError("no weight-transfer group: POST /init_weight_transfer_engine first")
        try:
            with aborted_on_signal(self.group, *self.store_at):  # another rank's failure ends our wait
                self.receive_weights(self.parse_update_info(update_info))
        except Exception as exc:  # every rank hears of it at once, and this group is aborted
            signal_abort(*self.store_at, f"a server failed: {type(exc).__name__}: {exc}")
            self.shutdown()
            raise

    def receive_weights(self, update_info: UpdateInfo) -> None:
        import torch

        if update_info.bucketed or self.parallel_config.tensor_parallel_size > 1:
            return self.receive_in_buckets(update_info.manifest, update_info.version)
        manifest = update_info.manifest
        start = time.perf_counter()
        sizes = [int(expected["bytes"]) for expected in manifest["buckets"]]
        # gloo: in host memory. NCCL: on the GPU while it has room for a whole version, else in host memory,
        # each bucket received on the GPU and copied out (one bucket's room there).
        on_host = self.backend in HOST_BACKENDS
        on = torch.device("cpu") if on_host else staging_device(self.device, sum(sizes))
        via = self.device if not on_host and on.type == "cpu" else None
        if on.type != "cpu":
            self.staging = []  # fresh buffers on the GPU, not kept; host ones of an earlier version freed
        buckets, sums = receive(self.group, sizes, on, self.staging if on.type == "cpu" else [], via)
        received = time.perf_counter()
        for i, (bucket, got, expected) in enumerate(zip(buckets, sums, manifest["buckets"])):
            check_bucket(bucket, expected, i, got)  # all checked before the model is touched
        self.check_names(manifest, update_info.version)
        checked = time.perf_counter()
        self.load(unpack(buckets, manifest), update_info.version)
        logger.info("version %s: %d bytes received in %.3f s, checked in %.3f s, loaded in %.3f s",
                    update_info.version, sum(b.numel() for b in buckets), received - start, checked - received,
                    time.perf_counter() - checked)  # fmt: skip

    def receive_in_buckets(self, manifest: dict, version) -> None:
        """A version received and loaded one bucket at a time, through one buffer kept for the next version
        (in host memory over gloo, on the GPU over NCCL): with tensor parallelism every worker receives the
        whole version, and staging it whole would take as many versions as workers, in host memory or beside
        the KV cache. Each bucket is checked as it arrives, so a bad one is refused after the ones before it
        were loaded: the server then holds a mix, which the orchestrator's disk fallback replaces with the
        whole version."""
        import torch

        start = time.perf_counter()
        room = max(int(b["bytes"]) for b in manifest["buckets"])
        where = torch.device("cpu") if self.backend in HOST_BACKENDS else torch.device(self.device)
        kept = self.staging[0] if self.staging else None
        fits = kept is not None and kept.numel() == room and kept.device == where
        self.staging = []  # the old buffers freed before a new one is taken
        buffer = kept if fits else new_buffer(room, where)
        self.staging = [buffer]
        self.check_names(manifest, version)
        try:
            # copies: vLLM's layerwise reload keeps a layer's weights until the whole layer has come, and a
            # layer may span buckets; the buffer is written over by the next one
            self.load(((name, t.clone()) for name, t in receive_each(self.group, manifest, buffer)), version)
        except Exception as exc:
            raise TransferError(f"version {version} failed part-way, one bucket at a time ({exc}): reload a "
                                "whole version") from exc  # fmt: skip
        logger.info("version %s: received and loaded one bucket at a time (%d bytes of room) in %.3f s",
                    version, room, time.perf_counter() - start)  # fmt: skip

    def check_names(self, manifest: dict, version) -> None:
        """Refuse, before the model is touched, a version that lacks a weight the last whole version had."""
        names = {e["name"] for e in manifest["tensors"]}
        if gap := self.names - names:
            raise TransferError(f"version {version}: {len(gap)} weights missing from the manifest "
                                f"({', '.join(sorted(gap)[:5])}); the served version is kept")  # fmt: skip
        self.pending = names

    def load(self, named, version) -> None:
        """Load a checked version; raise if it did not set every parameter of the model. vLLM's layerwise
        reload puts a layer's old tensors back, with only a warning, when nothing was loaded for it, so the
        load's own report (the parameters it set) is compared with the model's."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        self.names = set()  # until this load is known whole, no version is the reference
        initialize_layerwise_reload(self.model)
        try:
            loaded = self.model.load_weights((name, tensor.to(self.device)) for name, tensor in named)
        finally:  # the model's parameters back from the meta device whatever happened
            finalize_layerwise_reload(self.model, self.model_config)
        if gap := unloaded(self.model, loaded):
            raise TransferError(f"version {version}: {len(gap)} parameters of the model not loaded "
                                f"({', '.join(gap[:5])})")  # fmt: skip
        self.names = self.pending

    def shutdown(self) -> None:
        """Drop this worker's end of the group. A group is only replaced after a failure or a rejoin, so over
        NCCL it is aborted: a graceful shutdown waits for operations in flight that a failed peer never
        completes. gloo: vLLM's shutdown, whose closed sockets end the peers' broadcasts at once."""
        group, self.group = self.group, None
        if group is None:
            return
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        if self.backend in HOST_BACKENDS:
            stateless_destroy_torch_distributed_process_group(group)
        else:
            try:
                group.abort()
            except Exception:  # noqa: BLE001 - aborted already (aborted_on_signal): dropped all the same
                pass
