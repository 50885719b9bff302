"""Colocated (--server.colocate): the policy servers and the learner time-share GPUs. What runs without a GPU:
the order things start in, when the servers sleep and wake, and the learner giving back its cached memory.
(The choice and its refusals: tests/test_server_pool.py.)"""

from __future__ import annotations

from contextlib import ExitStack, asynccontextmanager

import pytest

from contract.rundir import RunDir
from orchestrate.loop import iteration, servers
from orchestrate.loop.config import RLConfig
from orchestrate.loop.servers import Servers


class Recorded:
    """A server stand-in that notes what it is asked, in one shared list."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def start(self, wait: bool = True):
        self.calls.append((self.name, "start", wait))

    def wait_ready(self):
        self.calls.append((self.name, "ready"))

    def sleep(self):
        self.calls.append((self.name, "sleep"))

    def wake_up(self):
        self.calls.append((self.name, "wake"))

    def stop(self):
        pass


def colocated_servers(tmp_path, calls) -> Servers:
    group = Servers(RLConfig(), RunDir(tmp_path), None, [Recorded("policy", calls)], Recorded("reference", calls))
    group.colocated = True  # as colocated() says on a GPU machine
    return group


def test_colocated_servers_start_one_after_the_other_and_sleep_while_the_learner_trains(tmp_path, monkeypatch):
    calls = []
    group = colocated_servers(tmp_path, calls)
    with ExitStack() as stack:
        group.launch(stack)
    # each started and ready before the next starts: no two measure the GPU's free memory at once
    assert calls == [("policy", "start", True), ("reference", "start", True), ("policy", "ready"),
                     ("reference", "ready"), ("reference", "sleep")]  # fmt: skip

    calls.clear()

    @asynccontextmanager
    async def no_client(role):
        yield None

    async def scored(tapes, client, progress):
        calls.append(("reference pass",))

    monkeypatch.setattr(group, "client", no_client)
    monkeypatch.setattr(servers, "annotate_reference", scored)
    group.score_reference([])
    group.make_room()  # before the batch is written: asleep already, nothing more to do
    assert calls == [("policy", "sleep"), ("reference", "wake"), ("reference pass",), ("reference", "sleep")]
    assert group.asleep
    calls.clear()
    group.wake()
    group.wake()  # once
    assert calls == [("policy", "wake")] and not group.asleep


def test_servers_that_do_not_colocate_never_sleep_for_the_learner(tmp_path):
    calls = []
    group = Servers(RLConfig(), RunDir(tmp_path), None, [Recorded("policy", calls)])
    assert not group.colocated  # no GPU here, and stand-ins are not our servers
    group.make_room()
    group.wake()
    assert calls == [] and not group.asleep


@pytest.mark.parametrize("colocated", [False, True])
def test_the_learner_starts_after_colocated_servers(tmp_path, monkeypatch, embedded_model_dir, colocated):
    """Colocated, the learner loads its model once the servers have measured the GPU; otherwise it loads
    meanwhile. Either way it is told whether it shares its GPUs (train.colocated)."""
    calls = []

    class FakeServers:
        def __init__(self):
            self.colocated = colocated

        def launch(self, stack):
            calls.append("servers")

        def use(self, trainer):
            calls.append("use")

        def resume(self):
            calls.append("resume")

    class FakeTrainer:
        def __init__(self, run, model_dir, train, launch):
            self.train = train

        def start(self):
            calls.append(("trainer", self.train.colocated))

        def stop(self):
            pass

    monkeypatch.setattr(iteration.Servers, "for_run", classmethod(lambda cls, *a, **k: FakeServers()))
    monkeypatch.setattr(iteration, "TrainerProcess", FakeTrainer)
    loop = iteration.Loop(RLConfig(), RunDir(tmp_path), progress=False)
    with ExitStack() as stack:
        loop._start(stack)
    trainer = ("trainer", colocated)
    expected = ["servers", trainer] if colocated else [trainer, "servers"]
    assert calls == [*expected, "use", "resume"]


def test_the_colocated_learner_gives_back_its_cached_gpu_memory(monkeypatch):
    """After the batch and after publishing: torch's cache emptied, on CUDA and when colocated only."""
    import types

    import torch

    from finetune.config import TrainConfig
    from finetune.train import _Session

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    session = _Session.__new__(_Session)  # the method reads the config and the device only
    for colocated, device, calls in [(True, "cuda", 1), (True, "cpu", 0), (False, "cuda", 0)]:
        emptied.clear()
        session.config = TrainConfig(colocated=colocated)
        session.accelerator = types.SimpleNamespace(device=torch.device(device))
        session._release_gpu_memory()
        assert len(emptied) == calls, (colocated, device)
