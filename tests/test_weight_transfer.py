"""The wire format of a version sent in memory (contract.weight_wire), without a server: what is packed
is what is unpacked, a bucket that is not the manifest's is refused, and the learner packs each version into
the host buckets of the one before (tests/test_finetune_vllm.py sends versions into a real vLLM server)."""

from __future__ import annotations

import pytest
import torch

from contract.weight_paths import MECHANISMS
from contract.weight_wire import ALIGN, TransferError, check_bucket, pack, unpack
from finetune.publish.collective import CollectivePublisher


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(50, 16, generator=g),
        "layer.0.norm": torch.randn(7, generator=g),  # 28 bytes: the next weight starts at the next ALIGN
        "layer.0.proj": torch.randn(16, 16, generator=g),
        "head.weight": torch.randn(50, 16, generator=g),
    }


def test_what_is_packed_is_unpacked_in_several_buckets():
    w = weights(0)
    packed = pack(w.items(), "bfloat16", bucket_bytes=2048)
    assert len(packed.buckets) > 1
    assert all(e["offset"] % ALIGN == 0 for e in packed.manifest["tensors"])
    for b, expected in zip(packed.buckets, packed.manifest["buckets"]):
        assert b.numel() == expected["bytes"] and b.numel() % 8 == 0
    out = dict(unpack(packed.buckets, packed.manifest))
    assert list(out) == list(w)
    for name, t in w.items():
        assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], t.to(torch.bfloat16))


def test_a_bucket_of_another_size_or_content_is_refused():
    packed = pack(weights(0).items(), "float32", bucket_bytes=2048)
    bucket, expected = packed.buckets[0], packed.manifest["buckets"][0]
    check_bucket(bucket, expected, 0)
    with pytest.raises(TransferError, match="bytes received"):
        check_bucket(bucket[:-8], expected, 0)
    flipped = bucket.clone()
    flipped[3] ^= 1
    with pytest.raises(TransferError, match="checksum"):
        check_bucket(flipped, expected, 0)


def test_a_version_packed_into_the_buckets_of_the_one_before_is_packed_whole():
    """Reused host buckets hold exactly what fresh ones would, checksums included, whatever the version
    before left in them; buckets of another size are not reused."""
    first = pack(weights(0).items(), "float32", bucket_bytes=2048)
    for b in first.buckets:
        b.fill_(0xAB)  # whatever the previous version (or a cut transfer) left there
    again = pack(weights(1).items(), "float32", bucket_bytes=2048, reuse=first.buckets)
    fresh = pack(weights(1).items(), "float32", bucket_bytes=2048)
    assert [b.data_ptr() for b in again.buckets] == [b.data_ptr() for b in first.buckets]
    assert again.manifest == fresh.manifest
    assert all(torch.equal(a, f) for a, f in zip(again.buckets, fresh.buckets))

    bigger = {**weights(1), "extra": torch.ones(300)}
    grown = pack(bigger.items(), "float32", bucket_bytes=2048, reuse=first.buckets)
    kept = {b.data_ptr() for b in first.buckets}
    assert sum(b.numel() for b in grown.buckets) > sum(b.numel() for b in first.buckets)
    assert [b.data_ptr() in kept for b in grown.buckets].count(False) >= 1
    for b, expected in zip(grown.buckets, grown.manifest["buckets"]):
        check_bucket(b, expected, 0)


def test_the_learner_keeps_its_host_buckets_between_versions():
    sender = CollectivePublisher(None, MECHANISMS["gloo"])  # the learner's end, no run folder needed here
    first = sender.pack(weights(0).items(), "float32")
    second = sender.pack(weights(1).items(), "float32")
    assert [b.data_ptr() for b in second.buckets] == [b.data_ptr() for b in first.buckets]
    out = dict(unpack(second.buckets, second.manifest))
    assert all(torch.equal(out[n], t) for n, t in weights(1).items())


# -- the group --------------------------------------------------------------------------------------


def test_an_nccl_group_is_built_with_waits_that_block_and_raise(monkeypatch):
    """ProcessGroupNCCL reads the two variables when it is built: they are set then (the servers' engine
    builds its end inside the same group_env), the process's own values back after; the new group passes a
    first broadcast on the GPU before it counts as formed. (No GPU here: the class is a stand-in.)"""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from contract import weight_wire as wt

    seen = {}

    class StandIn:
        Options = type("Options", (), {})

        def __init__(self, store, rank, size, options):
            seen["env"] = {k: os.environ.get(k) for k in wt.NCCL_GROUP_ENV}
            seen["timeout"] = options._timeout

    monkeypatch.setattr(dist, "ProcessGroupNCCL", StandIn)
    monkeypatch.setattr(wt, "first_broadcast", lambda group, device: seen.setdefault("first", (group, device)))
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    group = wt.new_group("nccl", "127.0.0.1", store.port, 0, 1, 30)
    assert seen["env"] == wt.NCCL_GROUP_ENV and seen["timeout"] == timedelta(seconds=30)
    assert seen["first"] == (group, "cuda")
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ
    with wt.group_env("gloo"):
        assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ


def test_the_learner_leaves_a_group_shut_down_or_aborted_after_a_failure():
    """A real one-rank gloo group is formed (its first broadcast passed) and left; the way out is a shutdown,
    or after a failed transfer an abort, so that nothing waits on a broadcast that did not complete (a
    stand-in records which: a one-rank gloo group does the same either way). A group whose peers are gone
    may refuse: it is dropped all the same."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    sender = CollectivePublisher(None, MECHANISMS["gloo"])  # the learner's end, no run folder needed here
    sender.join({"backend": "gloo", "host": "127.0.0.1", "port": store.port, "world_size": 1,
                 "generation": 3, "timeout_s": 30})  # fmt: skip
    assert sender.generation == 3 and sender.group is not None
    sender.close()
    assert sender.group is None and sender.generation == 0

    class Group:
        def __init__(self, refuse=False):
            self.calls, self.refuse = [], refuse

        def abort(self):
            self.calls.append("abort")
            if self.refuse:
                raise RuntimeError("peers gone")

        def shutdown(self):
            self.calls.append("shutdown")

    for failed, refuse, expected in ((False, False, ["shutdown"]), (True, False, ["abort"]), (True, True, ["abort"])):
        sender.group, sender.generation = Group(refuse), 4
        group = sender.group
        sender.close(failed=failed)
        assert group.calls == expected and sender.group is None and sender.generation == 0


def test_a_version_received_through_one_buffer_is_the_version_sent():
    """NCCL into host staging (a server's GPU without room for a whole version): each bucket arrives in one
    buffer on the group's device and is copied out. Here over gloo, the buffer in host memory too: the
    buckets and the checksums taken as they arrived are the learner's, and the staging is kept for the next
    version."""
    import threading

    import torch.distributed as dist

    from contract.weight_wire import broadcast_options, new_group, receive

    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    versions = [pack(weights(v).items(), "float32", bucket_bytes=2048) for v in (0, 1)]

    def learner():
        group = new_group("gloo", "127.0.0.1", store.port, 0, 2, 30)
        for packed in versions:
            for bucket in packed.buckets:
                group.broadcast([bucket], broadcast_options()).wait()

    sending = threading.Thread(target=learner)
    sending.start()
    group = new_group("gloo", "127.0.0.1", store.port, 1, 2, 30)
    staging: list = []
    for v, packed in enumerate(versions):
        sizes = [b.numel() for b in packed.buckets]
        buckets, sums = receive(group, sizes, "cpu", staging, via="cpu")
        if v == 0:
            kept = [b.data_ptr() for b in buckets]
        assert sums == [b["checksum"] for b in packed.manifest["buckets"]]
        assert all(torch.equal(got, sent) for got, sent in zip(buckets, packed.buckets))
    sending.join(timeout=60)
    assert [b.data_ptr() for b in buckets] == kept and len(buckets) > 1


def test_a_version_is_staged_on_the_gpu_while_it_has_room(monkeypatch):
    """The room on a GPU (stood in for: no GPU here) is the driver's free memory plus what torch's caching
    allocator holds free."""
    from contract import weight_wire as wt

    assert wt.staging_device("cpu", 10) == torch.device("cpu")
    free = {"bytes": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 * 2**30))
    version = 16 * 2**30  # an 8B model in bf16
    free["bytes"] = version + wt.STAGING_MARGIN
    assert wt.staging_device("cuda:1", version) == torch.device("cuda:1")
    free["bytes"] = version + wt.STAGING_MARGIN - 1
    assert wt.staging_device("cuda:1", version) == torch.device("cpu")
    # what the caching allocator holds free (reserved, not allocated) is room too: the driver does not count it
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * 2**30 - 1)
    assert wt.staging_device("cuda:1", version) == torch.device("cuda:1")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * 2**30)
    assert wt.staging_device("cuda:1", version) == torch.device("cpu")


def test_a_version_that_does_not_set_every_parameter_is_refused():
    """The engine's checks of a load (vLLM would put a layer's old tensors back with only a warning): the
    parameters load_weights did not report are named; a manifest without a weight the last whole version
    had is refused before anything is loaded, and one with them all becomes the reference only once its
    load is known whole."""
    from orchestrate.serving.vllm_plugin.collective_engine import CollectiveEngine, unloaded

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    assert unloaded(model, {"0.weight", "0.bias", "1.weight", "1.bias"}) == []
    assert unloaded(model, {"0.weight", "0.bias", "1.weight"}) == ["1.bias"]
    assert unloaded(model, None) == []  # a model whose load reports nothing: nothing to compare

    engine = CollectiveEngine.__new__(CollectiveEngine)  # its checks only: no vLLM worker here
    engine.names, engine.pending = set(), set()
    whole = {"tensors": [{"name": n} for n in ("a", "b", "c")]}
    engine.check_names(whole, 1)  # no reference yet: the load's own check decides
    engine.names = engine.pending
    with pytest.raises(TransferError, match="1 weights missing from the manifest \\(b\\)"):
        engine.check_names({"tensors": [{"name": "a"}, {"name": "c"}]}, 2)
    engine.check_names(whole, 3)


def test_a_load_that_leaves_a_parameter_out_raises_and_sets_no_reference(monkeypatch):
    """The engine's load with vLLM's layerwise reload stood in for: a load_weights that reports one parameter
    fewer than the model has raises (the reload is finalized all the same, so no parameter stays on the meta
    device), and its names do not become the reference; a whole one does."""
    import vllm.model_executor.model_loader.reload as reload

    from orchestrate.serving.vllm_plugin.collective_engine import CollectiveEngine

    calls = []
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: calls.append("init"))
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, config: calls.append("finalize"))

    class Model(torch.nn.Linear):
        def load_weights(self, named):
            return {name for name, _ in named}

    engine = CollectiveEngine.__new__(CollectiveEngine)
    engine.model, engine.model_config, engine.device = Model(2, 2), None, torch.device("cpu")
    engine.names, engine.pending = set(), {"weight"}
    with pytest.raises(TransferError, match="1 parameters of the model not loaded \\(bias\\)"):
        engine.load([("weight", torch.zeros(2, 2))], 4)
    assert calls == ["init", "finalize"] and engine.names == set()
    engine.pending = {"weight", "bias"}
    engine.load([("weight", torch.zeros(2, 2)), ("bias", torch.zeros(2))], 5)
    assert engine.names == {"weight", "bias"}


def test_a_version_received_one_bucket_at_a_time_is_the_version_sent():
    """The tensor-parallel servers' path (forced here: one worker, gloo): each bucket arrives in one reused
    buffer, is checked, and its weights are given out before the next is received; a bucket that is not the
    manifest's raises once the buckets before it were given out."""
    import threading

    import torch.distributed as dist

    from contract.weight_wire import broadcast_options, new_buffer, new_group, receive_each

    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    sent = weights(0)
    packed = pack(sent.items(), "float32", bucket_bytes=2048)
    assert len(packed.buckets) > 2

    def learner():
        group = new_group("gloo", "127.0.0.1", store.port, 0, 2, 30)
        for _ in range(2):
            for bucket in packed.buckets:
                group.broadcast([bucket], broadcast_options()).wait()

    sending = threading.Thread(target=learner)
    sending.start()
    group = new_group("gloo", "127.0.0.1", store.port, 1, 2, 30)
    buffer = new_buffer(max(b.numel() for b in packed.buckets), "cpu")
    got = {name: t.clone() for name, t in receive_each(group, packed.manifest, buffer)}
    assert got.keys() == sent.keys() and all(torch.equal(got[n], sent[n]) for n in sent)

    bad = {**packed.manifest, "buckets": [dict(b) for b in packed.manifest["buckets"]]}
    bad["buckets"][1]["checksum"] += 1
    given = []
    with pytest.raises(TransferError, match="bucket 1: checksum"):
        for name, _ in receive_each(group, bad, buffer):
            given.append(name)
    assert given == [e["name"] for e in bad["tensors"] if e["bucket"] == 0]
    for bucket in packed.buckets[2:]:  # what the learner still sends
        group.broadcast([buffer[: bucket.numel()]], broadcast_options()).wait()
    sending.join(timeout=60)
