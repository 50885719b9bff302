"""Weights in memory: the wire format of a collective transfer into running vLLM servers, which both ends import.

With `--server.weight_transfer gloo` (CPU) or `nccl` (GPUs) the learner does not write a model folder per
iteration for vLLM to reload: its main process sends the policy's weights, in the served dtype, to every
policy server over a torch.distributed process group of its own (rank 0: the learner; ranks 1..: the
servers' workers, whose engine is orchestrate.serving.vllm_plugin.collective_engine). The ends: the learner's
finetune.publish.collective, the orchestrator's orchestrate.serving.transports.collective (contract.weight_paths
names them). The run folder carries the rest of the protocol (file names in contract.rundir):

1. The orchestrator hosts the group's TCP store and writes RUN/weight_group.json: {generation, backend,
   host, port, world_size, timeout_s}. The learner joins a generation it has not joined yet, between
   batches, while the orchestrator asks each server to join (both block until all have).
2. After training batch N the learner publishes checkpoints/N/ with transfer.json, the manifest below
   (without model weights unless they are due), then broadcasts the buckets it describes.
3. The orchestrator, seeing transfer.json, asks every policy server to receive version N; each receives
   every bucket into a staging buffer, checks its size and checksum, and only then loads the weights, so a
   partial or corrupted transfer is refused and the server still holds one whole version. It then writes
   RUN/weights_ack.json {version, ok, reason}.
4. The learner waits for that ack. Not ok, or no ack in time: it writes the weights of version N into
   checkpoints/N/ as a Hugging Face folder (config.json last), the orchestrator reloads them from disk,
   and the next generation of the group is set up afresh.

The manifest (checkpoints/N/transfer.json):

    {"version": 3, "generation": 1, "dtype": "float32",
     "tensors": [{"name": "model.embed_tokens.weight", "dtype": "float32", "shape": [49152, 576],
                  "bucket": 0, "offset": 0}, ...],
     "buckets": [{"bytes": 536870912, "checksum": 123456789}, ...]}

A bucket is one contiguous uint8 tensor holding several weights, each at an offset aligned to ALIGN bytes
(a whole number of 8-byte words in all, so the checksum, the wrapping int64 sum of its words, is the same
whatever the device or the order of the sum). Names are the Hugging Face checkpoint's (vLLM's load_weights
fuses and shards them), with an untied output head, as in a checkpoint folder.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import Tensor

ALIGN = 64  # bytes: every weight starts at a multiple of this in its bucket
BUCKET_BYTES = 256 * 2**20  # bytes per bucket: few collective calls, bounded staging per call
BACKENDS = ("gloo", "nccl")  # the torch.distributed backends a group is built with (new_group)
HOST_BACKENDS = ("gloo",)  # those that send and receive in host memory (NCCL: on the GPU)


class TransferError(RuntimeError):
    """A transfer that did not deliver one whole, checked version."""


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def checksum(bucket: Tensor) -> int:
    """The wrapping int64 sum of a bucket's 8-byte words (integer addition: the same on every device)."""
    return int(bucket.view(torch.int64).sum().item())


@dataclass
class Packed:
    buckets: list[Tensor]
    manifest: dict


def pack(named: Iterable[tuple[str, Tensor]], dtype: str, bucket_bytes: int = BUCKET_BYTES,
         reuse: list[Tensor] | None = None, device=None) -> Packed:  # fmt: skip
    """Weights, cast to `dtype`, laid into buckets of at most `bucket_bytes` (a larger weight gets its own).
    `reuse`: buckets of an earlier pack, written over where each has the size and device needed (host
    memory kept between versions: a fresh bucket costs a page fault per 4 KiB, most of the time of packing
    it on CPU). Every byte is written (the padding with zeros), so a version packs to the same bytes and
    checksums into any buckets. `device`: where the buckets are (default: the weights' own device)."""
    target = getattr(torch, dtype)
    entries, groups, size = [], [[]], 0
    for name, tensor in named:
        t = tensor.detach().to(target).contiguous()
        n = aligned(t.numel() * t.element_size())
        if groups[-1] and size + n > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, t, size))
        size += n
    buckets, meta = [], []
    for b, group in enumerate(groups):
        if not group:
            continue
        name, last, offset = group[-1]
        total = offset + aligned(last.numel() * last.element_size())
        where = torch.device(device) if device is not None else last.device
        kept = reuse[b] if reuse is not None and b < len(reuse) else None
        fits = kept is not None and kept.numel() == total and kept.device == where
        bucket = kept if fits else new_buffer(total, where)
        for name, t, offset in group:  # every byte written: the weights, and zeros to each next offset
            nbytes = t.numel() * t.element_size()
            bucket[offset : offset + nbytes].copy_(t.reshape(-1).view(torch.uint8))
            bucket[offset + nbytes : offset + aligned(nbytes)].zero_()
            entries.append({"name": name, "dtype": dtype, "shape": list(t.shape), "bucket": b, "offset": offset})
        buckets.append(bucket)
        meta.append({"bytes": total, "checksum": checksum(bucket)})
    return Packed(buckets, {"dtype": dtype, "tensors": entries, "buckets": meta})


STAGING_MARGIN = 2**30  # bytes a GPU keeps free beside a version staged on it


def staging_device(device, nbytes: int):
    """Where a version of `nbytes` bytes is held whole, to be sent or checked before it is loaded: on the GPU
    `device` while it has room for it and STAGING_MARGIN more (a vLLM server's GPU is mostly its KV cache,
    taken up front; a 8B model's version is 16 GB in bf16), else in host memory, from which (or into which)
    the buckets go through the GPU one at a time. Not a GPU: host memory. The room counts what torch's caching
    allocator holds free (reserved, not allocated): it serves the staging from there, and the driver's free
    memory (mem_get_info) does not count it."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.device("cpu")
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return device if free >= nbytes + STAGING_MARGIN else torch.device("cpu")


def new_buffer(nbytes: int, device) -> Tensor:
    """A bucket's bytes on `device`; in host memory page-locked where CUDA is (faster copies to and from
    a GPU; these buffers are kept between versions)."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def receive(group, sizes: list[int], device, staging: list[Tensor], via=None) -> tuple[list[Tensor], list[int]]:
    """Every bucket of a version, broadcast by rank 0 of `group`, and the checksum of each as it arrived.
    The buckets are `staging`'s where they have these sizes on `device` (kept between versions: the list
    is filled in place), else new ones. `via`: the device the group receives on, when it is not `device`
    (NCCL into host staging): each bucket arrives in one buffer there and is copied out of it, so a version
    takes one bucket's room on that device. Every broadcast is received before anything is checked: a rank
    that stopped half-way would hold the others'."""
    device = torch.device(device)
    if [(b.numel(), b.device) for b in staging] != [(n, device) for n in sizes]:
        staging.clear()  # the old ones are freed before new ones are taken
        staging.extend(new_buffer(n, device) for n in sizes)
    bounce = torch.empty(max(sizes, default=0), dtype=torch.uint8, device=via) if via is not None else None
    opts, sums = broadcast_options(), []
    for bucket in staging:
        target = bounce[: bucket.numel()] if bounce is not None else bucket
        group.broadcast([target], opts).wait()
        sums.append(checksum(target))
        if bounce is not None:
            bucket.copy_(target)
    return list(staging), sums


def unpack(buckets: list[Tensor], manifest: dict, index: int | None = None) -> Iterator[tuple[str, Tensor]]:
    """The named weights of checked buckets (views into them, no copy). `index`: those of bucket `index`
    only, which `buckets[0]` holds (a version received one bucket at a time)."""
    for e in manifest["tensors"]:
        if index is not None and e["bucket"] != index:
            continue
        dtype = getattr(torch, e["dtype"])
        numel = 1
        for d in e["shape"]:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        raw = buckets[e["bucket"] if index is None else 0][e["offset"] : e["offset"] + nbytes]
        yield e["name"], raw.view(dtype).view(e["shape"])


def receive_each(group, manifest: dict, buffer: Tensor) -> Iterator[tuple[str, Tensor]]:
    """A version's named weights one bucket at a time, each bucket broadcast by rank 0 of `group` into
    `buffer` (room for the largest, reused: each bucket's weights must be used before the next is asked
    for), checked against the manifest as it arrives. A bucket that fails its check raises after the
    buckets before it were given out."""
    opts = broadcast_options()
    for index, expected in enumerate(manifest["buckets"]):
        if not 0 <= int(expected["bytes"]) <= buffer.numel():
            raise TransferError(f"bucket {index}: {expected['bytes']} bytes in the manifest, {buffer.numel()} room")
        bucket = buffer[: int(expected["bytes"])]
        group.broadcast([bucket], opts).wait()
        check_bucket(bucket, expected, index)
        yield from unpack([bucket], manifest, index)


def check_bucket(bucket: Tensor, expected: dict, index: int, got: int | None = None) -> None:
    """Refuse a bucket whose size or checksum (`got`, when computed as it arrived) is not the manifest's."""
    if bucket.numel() != expected["bytes"]:
        raise TransferError(f"bucket {index}: {bucket.numel()} bytes received, the manifest says {expected['bytes']}")
    got = checksum(bucket) if got is None else got
    if got != expected["checksum"]:
        raise TransferError(f"bucket {index}: checksum {got} is not the manifest's {expected['checksum']}")


def broadcast_options():
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return opts


# What an NCCL group of the transfer is built with (ProcessGroupNCCL reads both when it is constructed, so
# they are set around that and nothing else): its waits block the calling thread until the broadcast is
# done, and raise once the group's timeout has passed, like gloo's, instead of returning at once and
# leaving the timeout to torch's watchdog, which by default ends the whole process (a vLLM server, or the
# learner). A transfer that fails must fail one route, or send the learner to the disk path.
NCCL_GROUP_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


@contextmanager
def group_env(backend: str) -> Iterator[None]:
    """NCCL_GROUP_ENV in os.environ while a group of `backend` is built (gloo: nothing); restored after."""
    if backend != "nccl":
        yield
        return
    saved = {k: os.environ.get(k) for k in NCCL_GROUP_ENV}
    os.environ.update(NCCL_GROUP_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


ABORT = "tapeloop/abort"  # set on a group's store by the first rank, or the orchestrator, that fails a version
ABORT_POLL_S = 0.05  # how often a rank in a broadcast looks for ABORT: the failure reaches it that much later
SIGNAL_TIMEOUT = timedelta(seconds=2)  # to reach the group's store for ABORT (gone: the group's timeout is left)


def signal_abort(host: str, port: int, why: str) -> None:
    """Tell every rank of the group on the store at host:port that the version in flight failed: each
    aborts its end (`aborted_on_signal`). Best effort: with the store's host gone, the group's timeout is
    what is left."""
    from torch.distributed import TCPStore

    try:
        TCPStore(host, port, world_size=None, is_master=False, timeout=SIGNAL_TIMEOUT).set(ABORT, why)
    except Exception:  # noqa: BLE001 - see above
        pass


@contextmanager
def aborted_on_signal(group, host: str, port: int) -> Iterator[None]:
    """While the body runs (a version's broadcasts), a thread aborts `group` once ABORT is set on its store.
    Over NCCL a peer's abort does not reach the other ranks, whose waits would last the group's timeout
    (600 s by default); aborting a group from another thread of its process ends them at once. Over gloo an
    abort does not end a wait; a peer that drops the group closes its sockets, which does."""
    from torch.distributed import TCPStore

    done = threading.Event()

    def watch() -> None:
        try:
            store = TCPStore(host, port, world_size=None, is_master=False, timeout=SIGNAL_TIMEOUT)
            while not done.wait(ABORT_POLL_S):
                if store.check([ABORT]):
                    group.abort()
                    return
        except Exception:  # noqa: BLE001 - no store to read, or a group that refuses its abort: the timeout
            pass

    watcher = threading.Thread(target=watch, name="weight-transfer-abort", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


FORMED = "tapeloop/formed"  # the store key each rank of a new group adds 1 to (one store per generation)


def barrier(store, world_size: int, timeout_s: float) -> None:
    """Every rank of a new group passes this on the group's TCP store before its first collective: NCCL's
    communicator set-up, which that collective enters, has no timeout, so a rank that never comes (a server
    that could not join) would hold the others there for good (TRL #6796). Here they wait on the store, for
    at most `timeout_s`, and raise a TransferError naming how many came: the run goes on on the disk path."""
    arrived = store.add(FORMED, 1)
    if arrived == world_size:
        store.set(FORMED + "/all", "1")
    try:
        store.wait([FORMED + "/all"], timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - the store's timeout (DistStoreError), or its host gone
        try:
            arrived = store.add(FORMED, 0)
        except Exception:  # noqa: BLE001 - the store is gone: its last count is what we know
            pass
        raise TransferError(f"{arrived} of {world_size} ranks joined the weight-transfer group within "
                            f"{timeout_s:.0f} s ({type(exc).__name__})") from None  # fmt: skip


def first_broadcast(group, device) -> None:
    """One 4-byte broadcast from rank 0, which every rank of a new group passes (after `barrier`) before the
    group counts as formed (the learner in new_group, each server's worker in its engine's init). Gloo
    connects its ranks when the group is built; NCCL only at the first collective, so without this a rank
    that cannot connect would show at the first version's broadcast, not when the group forms, where a
    failure leaves the run on the disk path."""
    probe = torch.zeros(1, device=device)
    group.broadcast([probe], broadcast_options()).wait()
    if probe.is_cuda:
        torch.cuda.synchronize(probe.device)


def new_group(backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float, device=None):
    """A process group of its own (not torch.distributed's default one, which accelerate or vLLM may hold),
    on the TCP store the orchestrator hosts at host:port, formed: every rank passed `barrier`, then
    `first_broadcast`. The same construction as vLLM's stateless_init_torch_distributed_process_group, which
    the servers' side uses, so the two meet: the group's keys are prefixed with tcp://host:port."""
    from torch.distributed import PrefixStore, TCPStore

    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(host, port, world_size=None, is_master=False, timeout=timeout)
    prefix = PrefixStore(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}", store)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        group = ProcessGroupGloo(prefix, rank, world_size, timeout)
    elif backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        with group_env(backend):
            group = ProcessGroupNCCL(prefix, rank, world_size, options)
    else:
        raise ValueError(f"weight transfer backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    barrier(store, world_size, timeout_s)
    first_broadcast(group, device or ("cpu" if backend in HOST_BACKENDS else "cuda"))
    return group
