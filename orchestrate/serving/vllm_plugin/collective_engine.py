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
and the server goes on holding the version it had, never a mix of two.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from contract.weight_wire import (
    HOST_BACKENDS,
    TransferError,
    check_bucket,
    first_broadcast,
    group_env,
    receive,
    staging_device,
    unpack,
)  # fmt: skip

logger = logging.getLogger("vllm.tapeloop")  # vLLM's handlers: the server's log


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


class CollectiveEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None
        # Staging in host memory (gloo; NCCL when the GPU has no room for a version) is kept for the next
        # version, received over it when the sizes match: a fresh buffer costs a page fault per 4 KiB
        # (receiving into kept ones is 3x faster on CPU); one version's bytes stay in host memory. On a GPU:
        # fresh ones, which the caching allocator serves from freed memory without holding it for good.
        self.staging: list = []

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        from datetime import timedelta

        import torch
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.shutdown()  # a new generation of the group replaces the old one
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        with group_env(init_info.backend):  # NCCL: waits that block and raise, no watchdog ending the server
            self.group = stateless_init_torch_distributed_process_group(
                init_info.host, init_info.port, rank, init_info.world_size, backend=init_info.backend,
                timeout=timedelta(seconds=init_info.timeout_s),
            )  # fmt: skip
        self.backend = init_info.backend
        first_broadcast(self.group, torch.device("cpu") if self.backend in HOST_BACKENDS else self.device)

    def start_weight_update(self) -> None:
        """Nothing to do yet: the model is touched only once a whole version has arrived."""

    def finish_weight_update(self) -> None:
        """Nothing left: receive_weights loaded the checked version as a whole."""

    def update_weights(self, update_info: dict) -> None:
        # The base class adds torch.accelerator.synchronize(), which needs a GPU; loading is synchronous here.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: UpdateInfo) -> None:
        import torch
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        if self.group is None:
            raise TransferError("no weight-transfer group: POST /init_weight_transfer_engine first")
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
        checked = time.perf_counter()
        initialize_layerwise_reload(self.model)
        self.model.load_weights((name, tensor.to(self.device)) for name, tensor in unpack(buckets, manifest))
        finalize_layerwise_reload(self.model, self.model_config)
        logger.info("version %s: %d bytes received in %.3f s, checked in %.3f s, loaded in %.3f s",
                    update_info.version, sum(b.numel() for b in buckets), received - start, checked - received,
                    time.perf_counter() - checked)  # fmt: skip

    def shutdown(self) -> None:
        if self.group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            try:
                stateless_destroy_torch_distributed_process_group(self.group)
            finally:
                self.group = None
