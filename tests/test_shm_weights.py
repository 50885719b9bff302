"""The shared-memory weight path (--server.weight_transfer shm): each version a model folder in /dev/shm, the
servers on this machine reload it by path. Its two ends with stand-ins here; with a real vLLM server:
tests/test_finetune_vllm.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract import shm_folder
from contract.rundir import RunDir
from contract.weight_paths import select
from finetune.publish import announced, publisher_for
from finetune.publish.shm import ShmPublisher
from orchestrate.loop.config import RLConfig
from orchestrate.loop.config_checks import ConfigError, check_same_machine
from orchestrate.serving.weights import transport_for


@pytest.fixture(autouse=True)
def shm_root(tmp_path, monkeypatch):
    root = tmp_path / "shm"  # a folder of the test's, not the machine's /dev/shm
    root.mkdir()
    monkeypatch.setattr(shm_folder, "SHM_ROOT", root)
    return root


class Learner:
    save_dtype = "float32"

    def __init__(self):
        self.saved: list[Path] = []

    def policy_weights(self):
        return {"w": 1}

    def save_weights(self, folder, weights):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "config.json").write_text(json.dumps(weights))  # what has_weights looks for
        self.saved.append(Path(folder))


class Server:
    base_url = "http://stand-in"

    def __init__(self):
        self.loaded: list[Path] = []

    def reload_weights(self, path, verify=True):
        self.loaded.append(Path(path))

    def answers(self):
        return True


class Trainer:
    external = False

    def check_alive(self):
        pass


def test_versions_go_through_shared_memory_and_the_disk_only_when_due(tmp_path, shm_root):
    run = RunDir(tmp_path / "run")
    run.checkpoints.mkdir(parents=True)
    server = Server()
    transport = transport_for(run, [server], select("shm"), timeout_s=5, trainer=Trainer())
    transport.start()
    assert announced(run) == "shm"  # the learner publishes by what the orchestrator announced
    publisher, learner = publisher_for(run, announced(run), lora_rank=0), Learner()
    assert isinstance(publisher, ShmPublisher)
    for version in (1, 2, 3):
        tmp = run.temp_checkpoint(version)
        publisher.write(learner, tmp, version, publisher.gather(learner), keep_folder=version == 2)
        run.publish_checkpoint(tmp, version)
        assert transport.serve(version) == []
    here = shm_folder.shm_root(run.root)
    assert here.parent == shm_root and server.loaded == [here / f"{v:06d}" for v in (1, 2, 3)]
    assert sorted(p.name for p in here.iterdir()) == ["000002", "000003"]  # the served one and the one before
    assert [run.has_weights(v) for v in (1, 2, 3)] == [False, True, False]  # the disk when due (a full state)
    transport.close()
    assert not here.exists()  # the run's memory given back


def test_a_version_not_in_shared_memory_comes_from_its_checkpoint(tmp_path):
    """A learner that resumed wrote the version to the disk: the servers reload that folder."""
    run = RunDir(tmp_path / "run")
    run.checkpoints.mkdir(parents=True)
    tmp = run.temp_checkpoint(4)
    Learner().save_weights(tmp, {"w": 4})
    run.publish_checkpoint(tmp, 4)
    server = Server()
    transport = transport_for(run, [server], select("shm"), timeout_s=5, trainer=Trainer())
    assert transport.serve(4) == [] and server.loaded == [run.checkpoint(4).resolve()]


class FullShm(Learner):
    """A learner whose version is 1 GiB of bf16 tensors; its writes into shared memory fail for want of room
    when `fails_in_shm` (the space check passed, the tmpfs filled meanwhile)."""

    def __init__(self, fails_in_shm=False):
        super().__init__()
        self.fails_in_shm = fails_in_shm

    def policy_weights(self):
        import torch

        return {"w": torch.empty(1, dtype=torch.bfloat16).expand(2**29)}  # 1 GiB, no memory taken

    def save_weights(self, folder, weights):
        if self.fails_in_shm and shm_folder.SHM_ROOT in Path(folder).parents:
            Path(folder).mkdir(parents=True)
            (Path(folder) / "model.safetensors").write_text("part")
            raise OSError(28, "No space left on device")
        super().save_weights(folder, {"w": 1})


@pytest.mark.parametrize("fails_in_shm", [False, True])
def test_a_version_shared_memory_has_no_room_for_goes_through_the_disk(tmp_path, monkeypatch, fails_in_shm):
    """/dev/shm is too small (it needs the version's bytes and a tenth more free), or fills during the write:
    the version's checkpoint gets its model folder, which the servers reload; nothing half-written is left."""
    import shutil
    from collections import namedtuple

    free = 2**40 if fails_in_shm else int(1.05 * 2**30)  # room by the check / not a tenth to spare
    usage = namedtuple("usage", "total used free")(2**41, 0, free)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    run = RunDir(tmp_path / "run")
    run.checkpoints.mkdir(parents=True)
    server = Server()
    transport = transport_for(run, [server], select("shm"), timeout_s=5, trainer=Trainer())
    transport.start()
    publisher, learner = publisher_for(run, announced(run), lora_rank=0), FullShm(fails_in_shm)
    tmp = run.temp_checkpoint(1)
    publisher.write(learner, tmp, 1, publisher.gather(learner), keep_folder=False)
    run.publish_checkpoint(tmp, 1)
    assert not shm_folder.shm_version(run.root, 1).exists() and run.has_weights(1)
    assert transport.serve(1) == [] and server.loaded == [run.checkpoint(1).resolve()]


def test_the_two_run_directories_get_two_folders_and_the_run_names_its_own(tmp_path):
    assert shm_folder.shm_root(tmp_path / "a") != shm_folder.shm_root(tmp_path / "b")
    assert shm_folder.shm_root(tmp_path / "a") == shm_folder.shm_root(tmp_path / "x" / ".." / "a")


@pytest.mark.parametrize(
    "server, trainer, option",
    [({"policy_urls": "http://a:8000"}, {}, "--server.policy_urls"), ({}, {"launch": "external"}, "--trainer.launch")],
)
def test_shared_memory_needs_the_learner_and_the_servers_here(server, trainer, option):
    config = RLConfig.model_validate({"server": {"weight_transfer": "shm", **server}, "trainer": trainer})
    with pytest.raises(ConfigError, match=rf"^--server.weight_transfer: shm passes .* {option}"):
        check_same_machine(config)
    check_same_machine(RLConfig.model_validate({"server": {"weight_transfer": "shm"}}))
