"""How a version in memory fails, without a server or a GPU (tests/test_finetune_vllm.py runs the gloo path
against a real vLLM server): a rank that never joins is a timeout on the group's store before any collective
(NCCL's communicator set-up has none); a failure signalled on the store aborts every rank's end of the group
(over NCCL another rank's abort does not reach it); the first version of a group is checked by a change of
log-probs, as a disk reload is."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from contract import weight_wire as wt


def store():
    return dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)


def test_a_group_forms_only_once_every_rank_is_on_its_store():
    """Two of three ranks wait at most the timeout and fail naming how many came; three pass at once."""
    master = store()
    errors = []

    def rank(s, size):
        client = dist.TCPStore("127.0.0.1", s.port, world_size=None, is_master=False)
        try:
            wt.barrier(client, size, 1.0)
        except wt.TransferError as exc:
            errors.append(str(exc))

    start = time.monotonic()
    ranks = [threading.Thread(target=rank, args=(master, 3)) for _ in range(2)]
    [t.start() for t in ranks]
    [t.join(timeout=30) for t in ranks]
    assert len(errors) == 2 and all("2 of 3 ranks joined" in e for e in errors), errors
    assert time.monotonic() - start < 10

    errors.clear()
    other = store()
    ranks = [threading.Thread(target=rank, args=(other, 3)) for _ in range(3)]
    [t.start() for t in ranks]
    [t.join(timeout=30) for t in ranks]
    assert errors == []


def test_the_learner_passes_the_store_barrier_before_its_first_collective(monkeypatch):
    """new_group (the learner's end; the servers' engine does the same): the barrier, then the first
    broadcast, which over NCCL enters the communicator's set-up. A stand-in NCCL class: no GPU here."""
    order = []

    class StandIn:
        Options = type("Options", (), {})

        def __init__(self, store, rank, size, options):
            order.append("built")

    monkeypatch.setattr(dist, "ProcessGroupNCCL", StandIn)
    monkeypatch.setattr(wt, "barrier", lambda store, size, timeout_s: order.append(("barrier", size, timeout_s)))
    monkeypatch.setattr(wt, "first_broadcast", lambda group, device: order.append("first broadcast"))
    master = store()
    wt.new_group("nccl", "127.0.0.1", master.port, 0, 3, 30)
    assert order == ["built", ("barrier", 3, 30), "first broadcast"]


class Group:
    """A group that records its abort (gloo's does not end a wait; NCCL's, the one this is for, needs a GPU)."""

    def __init__(self):
        self.aborted = threading.Event()

    def abort(self):
        self.aborted.set()


def test_a_failure_signalled_on_the_store_aborts_a_rank_in_a_broadcast():
    master = store()
    group = Group()
    with wt.aborted_on_signal(group, "127.0.0.1", master.port):
        time.sleep(0.3)
        assert not group.aborted.is_set()  # no failure: the broadcast goes on
        start = time.monotonic()
        wt.signal_abort("127.0.0.1", master.port, "a server failed")
        assert group.aborted.wait(5), "the signal did not abort the group"
        assert time.monotonic() - start < 1
    assert master.get(wt.ABORT) == b"a server failed"

    quiet, other = Group(), store()
    with wt.aborted_on_signal(quiet, "127.0.0.1", other.port):
        pass
    assert not quiet.aborted.is_set()


def test_a_server_whose_receive_fails_tells_every_rank_and_aborts_its_end():
    """The engine (vLLM's worker side) on any failure of a version: the signal on the group's store, and its
    NCCL group aborted, not shut down (a shutdown waits for operations a failed peer never completes)."""
    from orchestrate.serving.vllm_plugin.collective_engine import CollectiveEngine

    master = store()
    engine = CollectiveEngine.__new__(CollectiveEngine)  # no vLLM worker here
    engine.group, engine.backend, engine.store_at = Group(), "nccl", ("127.0.0.1", master.port)
    group = engine.group

    def fails(update_info):
        raise wt.TransferError("bucket 0: checksum 1 is not the manifest's 2")

    engine.parse_update_info = lambda info: info
    engine.receive_weights = fails
    with pytest.raises(wt.TransferError):
        engine.update_weights({"version": 3})
    assert group.aborted.is_set() and engine.group is None
    assert master.check([wt.ABORT]) and b"checksum" in master.get(wt.ABORT)


class Server:
    """A policy server's routes as the orchestrator's end drives them; its log-probs move with each load
    unless `takes` is False (a group that delivers bytes the model does not take)."""

    def __init__(self, takes=True, fails="", routes=("/shutdown_weight_transfer_engine",)):
        self.base_url, self.takes, self.fails, self.calls, self.logprobs = "http://s", takes, fails, [], [-1.0]
        self.routes = routes  # vLLM's optional routes this server has (0.26-0.31: no shutdown route)

    from orchestrate.serving.vllm_server import VLLMServer

    drop_weight_group = VLLMServer.drop_weight_group  # the orchestrator's own, on these routes

    def probe_logprobs(self):
        self.calls.append("probe")
        return list(self.logprobs)

    def _post(self, route, json=None, timeout=None):
        from orchestrate.serving.vllm_server import ServerError

        self.calls.append(route if route != "/collective_rpc" else f"{route} {json['method']}")
        if route == "/shutdown_weight_transfer_engine" and route not in self.routes:
            raise ServerError(f"policy {route}: HTTP 404: Not Found")
        if route == "/update_weights":
            if self.fails:
                raise ServerError(self.fails)
            if self.takes:
                self.logprobs[0] -= 1


def transport(servers):
    from contract.weight_paths import MECHANISMS
    from orchestrate.serving.transports.collective import CollectiveTransport

    t = CollectiveTransport(None, servers, MECHANISMS["gloo"], 30, None)  # the routes only: no run folder
    t.store = store()
    t.store_host, t.generation = "127.0.0.1", 1
    return t


class Run:
    """The run folder as `put` reads it: every version's manifest is of generation `generation`."""

    def __init__(self, tmp_path):
        self.weights_ack, self.generation = tmp_path / "weights_ack.json", 1

    def transfer_manifest(self, version):
        return {"generation": self.generation}


def test_the_first_version_of_a_group_is_checked_by_a_change_of_log_probs(tmp_path):
    """Once per generation, when the version is to be verified: a load that leaves the log-probs as they
    were is a failure (then the disk path); the next versions of that generation are not probed."""
    good = Server()
    t = transport([good])
    t.run = Run(tmp_path)
    assert t.put(5, verify=True, keep_previous=False) == [] and good.calls.count("probe") == 2
    good.calls.clear()
    assert t.put(6, verify=True, keep_previous=False) == [] and "probe" not in good.calls
    t.generation = t.run.generation = (
        2  # a new group: its first version is probed again, unless it is not to be verified
    )
    assert t.put(7, verify=False, keep_previous=False) == [] and "probe" not in good.calls
    assert t.put(8, verify=True, keep_previous=False) == [] and good.calls.count("probe") == 2

    bad = Server(takes=False)
    t = transport([bad])
    failed = t._transfer(5, {}, probe=True)
    assert failed and "left the model's log-probs unchanged" in failed[0][1] and t.probed == 0
    assert t.store.check([wt.ABORT]) and t.store.get(wt.ABORT).startswith(
        b"http://s: version 5"
    )  # the group aborted at the failure


def test_the_first_failure_is_signalled_on_the_groups_store():
    """A server that fails (here before the broadcast: no room for its staging) makes the orchestrator tell
    every rank on the store, and ask every server to drop its end."""
    failing = Server(fails="HTTP 500: no room for the staging")
    t = transport([failing])
    failed = t._transfer(7, {}, probe=False)
    assert failed == [(failing, "HTTP 500: no room for the staging")]
    assert (
        t.store.check([wt.ABORT])
        and b"no room" in t.store.get(wt.ABORT)
        and "/shutdown_weight_transfer_engine" in failing.calls
    )


def test_a_server_without_vllms_shutdown_route_drops_its_group_through_the_worker_extension():
    """vLLM 0.26-0.31 have no /shutdown_weight_transfer_engine (404): the orchestrator asks the worker
    extension's drop_weight_group instead (before, the 404 was taken for a dead server and the servers kept
    their ends: on gloo the learner's broadcast then waited out its timeout); the worker's engine is shut."""
    from orchestrate.serving.vllm_plugin.worker_ext import WorkerExtension
    from orchestrate.serving.vllm_server import ServerError

    old = Server(fails="HTTP 500: no room for the staging", routes=())
    t = transport([old])
    t._transfer(7, {}, probe=False)
    assert old.calls[-2:] == ["/shutdown_weight_transfer_engine", "/collective_rpc drop_weight_group"]

    class Failing(Server):  # another error than a missing route is the caller's to handle, not a fallback
        def _post(self, route, json=None, timeout=None):
            self.calls.append(route)
            raise ServerError(f"policy {route}: HTTP 500: boom")

    with pytest.raises(ServerError, match="HTTP 500"):
        Failing().drop_weight_group()

    class Engine:
        shut = False

        def shutdown(self):
            self.shut = True

    class Worker(WorkerExtension):  # vLLM mixes the extension into its worker, which holds the engine
        weight_transfer_engine = Engine()

    worker = Worker()
    assert worker.drop_weight_group() is True and worker.weight_transfer_engine.shut
    Worker.weight_transfer_engine = None  # a server started without --weight-transfer-config
    assert Worker().drop_weight_group() is False


def test_the_servers_nccl_group_is_built_in_vllms_unpinned_env():
    """vLLM 0.32 has unpinned_nccl_env (its own NCCL weight transfer builds communicators in it): the engine's
    NCCL set-up uses it; gloo builds no communicator, and nothing is wrapped."""
    from orchestrate.serving.vllm_plugin.collective_engine import unpinned

    assert unpinned("nccl").gen.__name__ == "unpinned_nccl_env"
    assert not hasattr(unpinned("gloo"), "gen")


def test_with_several_learner_processes_the_ack_is_awaited_within_their_groups_timeout():
    """The main learner process waits for the servers' ack while the others wait in their default process
    group's next collective, whose watchdog would end them past its timeout (TRL #7103): with several
    processes the wait is at most half that timeout; alone, the transfer's timeout."""
    from finetune.publish.collective import ack_wait_s, learner_group

    assert ack_wait_s(600, 1, None) == 600
    assert ack_wait_s(600, 2, 600) == 300  # NCCL's default group timeout: 10 minutes
    assert ack_wait_s(600, 2, 1800) == 600  # gloo's: 30 minutes
    assert ack_wait_s(60, 4, None) == 60  # no timeout known: the transfer's
    assert learner_group() == (1, None)  # this test process: no default group


def _learner_process(rank: int, init: str, out) -> None:
    from finetune.publish.collective import ack_wait_s, learner_group

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    processes, group_timeout = learner_group()
    out.put((rank, processes, group_timeout, ack_wait_s(1200, processes, group_timeout)))
    dist.destroy_process_group()


def test_two_learner_processes_read_their_groups_timeout(tmp_path):
    """Two CPU processes in a gloo default group (as accelerate forms it): each reads 2 processes and gloo's
    default timeout (30 minutes), so a 20-minute transfer timeout is waited 15 minutes at most."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_learner_process, args=(rank, init, out)) for rank in range(2)]
    [p.start() for p in procs]
    got = sorted(out.get(timeout=120) for _ in procs)
    [p.join(timeout=60) for p in procs]
    assert got == [(0, 2, 1800.0, 900.0), (1, 2, 1800.0, 900.0)]


def test_the_servers_group_is_bounded_by_the_transfer_timeout_on_a_vllm_without_a_timeout_argument():
    """vLLM 0.26's stateless group takes no `timeout`: it reads the current vLLM config's, else PyTorch's
    default (600 s NCCL, 1800 s gloo) would bound it; the engine builds it under a copy of the server's config
    that sets the transfer timeout, the server's own config left as it was. 0.32's is given the timeout."""
    import types
    from datetime import timedelta

    from vllm.config import get_current_vllm_config_or_none

    from orchestrate.serving.vllm_plugin.collective_engine import CollectiveEngine, group_and_store

    info = types.SimpleNamespace(host="127.0.0.1", port=29500, world_size=2, timeout_s=4.5)
    parallel = types.SimpleNamespace(distributed_timeout_seconds=None, cpu_distributed_timeout_seconds=None)
    server_config = types.SimpleNamespace(parallel_config=parallel)
    calls = []

    def old(host, port, rank, world_size, backend, group_name=None, return_store=False, listen_socket=None):  # 0.26
        current = get_current_vllm_config_or_none().parallel_config  # as 0.26 reads it
        calls.append((return_store, current.distributed_timeout_seconds, current.cpu_distributed_timeout_seconds))
        return "group", "store"

    assert group_and_store(old, info, 1, "nccl", server_config) == ("group", "store")
    assert calls == [(True, 5, 5)]  # whole seconds, rounded up
    assert get_current_vllm_config_or_none() is None and parallel.distributed_timeout_seconds is None

    def new(host, port, rank, world_size, backend, return_store=False, timeout=None):  # 0.32's
        calls.append({"return_store": return_store, "timeout": timeout})
        return "group", "store"

    assert group_and_store(new, info, 1, "gloo", server_config) == ("group", "store")
    assert calls[-1] == {"return_store": True, "timeout": timedelta(seconds=4.5)}
    with pytest.raises(NotImplementedError):  # 0.26 makes it abstract: the engine must define it to be built
        CollectiveEngine.trainer_send_weights(iter(()), None)
