"""The seam of the weight paths (contract.weight_paths): one table names the mechanisms, each end loads its
class from it, and each end's interface holds what the other end and the loop rely on. No server here
(tests/test_finetune_vllm.py and tests/test_lora.py drive the real ones)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import httpx
import pytest
import torch

from contract import weight_paths
from contract.rundir import ADAPTER_DIR, TRANSFER_MANIFEST, RunDir
from contract.weight_paths import DEFAULT, DRAIN, KEEP, MECHANISMS, Mechanism, options, select
from finetune.publish import publisher_for
from finetune.publish.adapter import AdapterPublisher
from finetune.publish.base import Publisher
from finetune.publish.collective import CollectivePublisher
from finetune.publish.disk import DiskPublisher
from orchestrate.serving.transports.collective import CollectiveTransport
from orchestrate.serving.vllm_server import ServerConfig, ServerError, VLLMServer
from orchestrate.serving.weights import Transport, transport_for

ROOT = Path(__file__).resolve().parent.parent


# -- one table -----------------------------------------------------------------------------------


class StandInPublisher(Publisher):
    """A mechanism's learner end defined here, where no other file names it."""

    def write(self, learner, tmp, index, weights, keep_folder):
        self.written = (index, sorted(weights))


class StandInTransport(Transport):
    def put(self, version, verify, keep_previous):
        self.put_versions = [*getattr(self, "put_versions", []), version]
        return []

    def rejoin(self, server):
        self.stale.discard(server)


@pytest.fixture
def stand_in(monkeypatch):
    """A mechanism registered as a new one is (contract.weight_paths.register), its two ends in this file."""
    mechanism = Mechanism("stand_in", f"{__name__}:StandInPublisher", f"{__name__}:StandInTransport",
                          engine="tapeloop", by_path=False)  # fmt: skip
    monkeypatch.setitem(MECHANISMS, mechanism.name, mechanism)
    return mechanism


def test_a_registered_mechanism_is_picked_by_both_ends(stand_in, tmp_path):
    """Registering is all it takes: the learner's end is the announced mechanism's, the orchestrator's the
    selected one's, the servers start with its engine, and the swap timing is the table's."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    disk = publisher_for(run, None, lora_rank=0)
    assert type(disk) is DiskPublisher
    closed = []
    disk.close = lambda failed=False: closed.append(failed)
    learner_end = publisher_for(run, "stand_in", lora_rank=0, current=disk)
    assert isinstance(learner_end, StandInPublisher) and learner_end.mechanism is stand_in and closed == [False]
    assert publisher_for(run, "stand_in", lora_rank=0, current=learner_end) is learner_end  # kept, not rebuilt

    server_end = transport_for(run, [], select("stand_in"), 60, trainer=None)
    assert isinstance(server_end, StandInTransport) and server_end.mechanism is stand_in
    config = ServerConfig.model_construct(**{**ServerConfig().model_dump(), "weight_transfer": "stand_in"})
    command = VLLMServer("model", log_path=tmp_path / "log", name="policy", config=config).command()
    assert '{"backend": "tapeloop"}' in command
    assert (stand_in.swap(False), stand_in.swap(True)) == (DRAIN, KEEP)


def test_the_option_and_lora_map_through_the_table():
    names = options()
    assert {"disk", "gloo", "nccl", "shm"} <= set(names) and ServerConfig().weight_transfer == DEFAULT
    for name in names:  # every registered option is a value, and --help says what it does
        assert ServerConfig(weight_transfer=name).weight_transfer == name and select(name).name == name
        assert f"{name} (" in ServerConfig.model_fields["weight_transfer"].description
    with pytest.raises(ValueError, match=re.escape(" or ".join([", ".join(map(repr, names[:-1])), repr(names[-1])]))):
        ServerConfig(weight_transfer="tcp")
    assert select(None) is MECHANISMS[DEFAULT]
    assert select("disk", lora_rank=8).adapter and not select("disk", lora_rank=8).option
    assert select("gloo").backend == "gloo" and select("nccl").one_rank_per_gpu and not select("gloo").by_path


# The files that may name a mechanism or a swap timing: the table and each mechanism's own ends (the client,
# orchestrate.serving.llm.VLLMClient.swap_weights, takes the swap timings' names from the table).
MECHANISM_FILES = {
    "contract/weight_paths.py", "contract/weight_wire.py",
    "finetune/publish/collective.py", "orchestrate/serving/transports/collective.py",
    "orchestrate/serving/vllm_plugin/collective_engine.py",
}  # fmt: skip
NAMES = {"disk", "gloo", "nccl", "lora", *MECHANISMS, DRAIN, KEEP, weight_paths.ADAPTER}  # the registered ones too


def compared_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of each mechanism name a comparison (==, !=, in) of `source` holds as a literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                found += [(node.lineno, i.value) for i in items if isinstance(i, ast.Constant) and i.value in NAMES]
    return found


def test_the_table_is_the_one_place_comparing_mechanism_names():
    assert compared_names("if x.backend == 'nccl' or mode in ('drain', 'keep'): pass") == [
        (1, "nccl"), (1, "drain"), (1, "keep")]  # fmt: skip
    wrong = []
    for package in ("contract", "finetune", "orchestrate"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in MECHANISM_FILES:
                wrong += [f"{rel}:{line} compares {name!r}" for line, name in compared_names(path.read_text())]
    assert not wrong, "mechanism names outside contract.weight_paths and the mechanisms' files: " + "; ".join(wrong)


# -- the learner's end ---------------------------------------------------------------------------


class FakeLearner:
    save_dtype = "float32"

    def __init__(self):
        self.saved: list[Path] = []

    def policy_weights(self):
        return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}

    def adapter_weights(self):
        return {"a": torch.ones(2)}

    def save_weights(self, folder, weights):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "config.json").write_text("{}")  # what has_weights looks for
        self.saved.append(Path(folder))

    def save_adapter(self, folder, tensors):
        self.saved.append(Path(folder))


@pytest.fixture
def run(tmp_path):
    run = RunDir(tmp_path / "run")
    run.checkpoints.mkdir(parents=True)
    return run


def test_the_orchestrator_asks_for_the_newest_version_unwritten(run):
    from contract.durable import atomic_write_json

    publisher = DiskPublisher(run, select(None))
    assert not publisher.asked_for(3)  # no request
    atomic_write_json(run.weights_request, {"version": 3})
    assert publisher.asked_for(3) and not publisher.asked_for(4) and not publisher.asked_for(None)
    FakeLearner().save_weights(run.checkpoint(3), {})
    assert run.has_weights(3) and not publisher.asked_for(3)  # written already


def test_each_publisher_writes_what_its_servers_load(run, tmp_path):
    learner = FakeLearner()
    disk, adapter = DiskPublisher(run, select(None)), AdapterPublisher(run, select(None, lora_rank=4))
    disk.write(learner, tmp_path / "a", 1, disk.gather(learner), keep_folder=False)
    adapter.write(learner, tmp_path / "b", 1, adapter.gather(learner), keep_folder=True)
    assert learner.saved == [tmp_path / "a", tmp_path / "b" / ADAPTER_DIR]
    assert disk.writes_final_folder and not adapter.writes_final_folder
    assert disk.deliver(learner, 1, {}) is None  # nothing to send


def test_a_collective_publisher_without_a_group_goes_through_the_disk(run, tmp_path):
    """Nothing announced (or another mechanism): the version's model folder, no manifest, nothing sent."""
    learner, publisher = FakeLearner(), CollectivePublisher(run, select("gloo"))
    publisher.write(learner, tmp_path / "tmp", 1, learner.policy_weights(), keep_folder=False)
    assert learner.saved == [tmp_path / "tmp"] and not (tmp_path / "tmp" / TRANSFER_MANIFEST).exists()
    assert publisher.deliver(learner, 1, learner.policy_weights()) is None and learner.saved == [tmp_path / "tmp"]


@pytest.mark.parametrize("ok", [True, False])
def test_a_collective_publisher_sends_then_falls_back_to_disk_without_a_good_ack(run, ok):
    """A one-rank gloo group, announced as the orchestrator announces it: the manifest is written instead of
    the model folder; after the broadcast a good ack leaves it at that, a refusal writes the folder and
    leaves the group (the orchestrator forms a new generation)."""
    import torch.distributed as dist

    from contract.durable import atomic_write_json

    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    atomic_write_json(run.weight_group, {"generation": 2, "backend": "gloo", "host": "127.0.0.1",
                                         "port": store.port, "world_size": 1, "timeout_s": 5})  # fmt: skip
    learner, publisher = FakeLearner(), CollectivePublisher(run, select("gloo"))
    tmp = run.temp_checkpoint(1)
    publisher.write(learner, tmp, 1, learner.policy_weights(), keep_folder=False)
    manifest = run.read_json(tmp / TRANSFER_MANIFEST)
    assert publisher.generation == 2 and manifest["version"] == 1 and manifest["generation"] == 2
    assert learner.saved == []
    run.publish_checkpoint(tmp, 1)
    atomic_write_json(run.weights_ack, {"version": 1, "ok": ok, "reason": "" if ok else "checksum"})
    failed = publisher.deliver(learner, 1, learner.policy_weights())
    if ok:
        assert failed is None and publisher.group is not None and not run.has_weights(1)
        publisher.close()
    else:
        assert "checksum" in failed and publisher.group is None and run.has_weights(1)


# -- the orchestrator's end ----------------------------------------------------------------------


class Server:
    def __init__(self, fails=False, answers=True):
        self.fails, self.up, self.paths = fails, answers, []
        self.base_url = f"http://server-{id(self)}"

    def reload_weights(self, path, verify=True):
        if self.fails:
            raise ServerError("gone")
        self.paths.append(path)

    def answers(self):
        return self.up


class Trainer:
    external = False

    def check_alive(self):
        pass


def written(run, version):
    FakeLearner().save_weights(run.checkpoint(version), {})


def test_a_server_that_misses_a_version_is_stale_and_none_left_raises(run):
    good, gone = Server(), Server(fails=True, answers=False)
    transport = transport_for(run, [good, gone], select(None), 5, Trainer())
    written(run, 1)
    assert transport.serve(1) == [gone.base_url] and transport.stale == {gone} and transport.served == 1
    assert good.paths == [run.checkpoint(1).resolve()]
    transport.rejoin(gone.__class__())  # another server back: it reloads the served version
    transport.servers = [gone]
    written(run, 2)
    with pytest.raises(ServerError, match="no policy server is left to serve version 2"):
        transport.serve(2)
    up_but_failing = transport_for(run, [Server(fails=True, answers=True)], select(None), 5, Trainer())
    with pytest.raises(ServerError, match="gone"):  # it is up and did not take the weights: a real error
        up_but_failing.serve(1)


def test_a_collective_that_cannot_form_falls_back_to_disk(run, capsys):
    """A server that does not tell its world size: the run goes on by the disk, the learner told so."""

    class NoWorldSize(Server):
        def get(self, route, params=None):
            raise ServerError("no such route")

    server = NoWorldSize()
    transport = transport_for(run, [server], select("gloo"), 5, Trainer())
    assert isinstance(transport, CollectiveTransport)
    transport.start()
    assert not transport.in_memory and run.read_json(run.weight_group)["backend"] == DEFAULT
    assert "gloo transfer unavailable" in capsys.readouterr().out
    assert type(publisher_for(run, run.read_json(run.weight_group)["backend"], 0)) is DiskPublisher
    written(run, 1)
    assert transport.serve(1) == [] and server.paths == [run.checkpoint(1).resolve()]


def test_a_learner_that_dies_before_joining_the_group_is_an_error_at_once(run):
    """The learner joins the weight group as rank 0: dead before it does (a bad option, out of memory), its error
    is raised within a second, not after timeout_s of servers waiting, and the servers drop their ends."""
    import threading
    import time

    from orchestrate.loop.trainer import TrainerError

    released, dropped = threading.Event(), []

    class Waiting(Server):
        def get(self, route, params=None):
            return httpx.Response(200, json={"world_size": 1})

        def _post(self, route, json=None, timeout=300):
            released.wait(timeout)  # joined: waits for the other ranks

        def drop_weight_group(self):
            dropped.append(self)
            released.set()

    class Dead(Trainer):
        def check_alive(self):
            raise TrainerError("the trainer exited with code 2")

    server = Waiting()
    transport = transport_for(run, [server], select("gloo"), 60, Dead())
    start = time.monotonic()
    with pytest.raises(TrainerError, match="exited with code 2"):
        transport.start()
    assert time.monotonic() - start < 5 and dropped == [server]


class AdapterServer(Server):
    """A server's own adapter routes over a _post that records (route, adapter name) in `posted`."""

    served_model_name = "policy"
    load_adapter, unload_adapter = VLLMServer.load_adapter, VLLMServer.unload_adapter
    reset_prefix_cache = VLLMServer.reset_prefix_cache

    def __init__(self):
        super().__init__()
        self.posted = []

    def _post(self, route, json=None, timeout=300):
        self.posted.append((route, (json or {}).get("lora_name")))


def test_only_adapters_stay_loaded_side_by_side(run):
    """unload is the loop's at every swap; it frees something only where versions stay loaded."""
    server = AdapterServer()
    posted = server.posted
    transport = transport_for(run, [server], select(None, lora_rank=4), 5, Trainer())
    for version in (1, 2):
        run.adapter(version).mkdir(parents=True)
        (run.adapter(version) / "adapter_config.json").write_text("{}")
        transport.serve(version, keep_previous=True)
    assert transport.loaded - {0} == {1, 2} and ("/v1/unload_lora_adapter", "policy-v1") not in posted  # 0: the base
    transport.unload(1)
    assert transport.loaded - {0} == {2} and ("/v1/unload_lora_adapter", "policy-v1") in posted
    disk = transport_for(run, [Server()], select(None), 5, Trainer())
    disk.unload(1)  # nothing loaded side by side: nothing to do, nothing raised


def test_roles_own_adapters_are_loaded_before_the_policys_and_unloaded_with_it(run):
    """A version with roles' own adapters (adapter/ROLE/): each loaded as policy-ROLE-vN before policy-vN (whose
    name says the version is in), each unloaded with it when the next version comes."""
    server = AdapterServer()
    transport = transport_for(run, [server], select(None, lora_rank=4), 5, Trainer())
    for version in (1, 2):
        for folder in (run.adapter(version) / "solver", run.adapter(version) / "ju.dge", run.adapter(version)):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "adapter_config.json").write_text("{}")
        transport.serve(version)
    loads = [name for route, name in server.posted if route == "/v1/load_lora_adapter"]
    assert loads == [
        "policy-ju.dge-v1",
        "policy-solver-v1",
        "policy-v1",
        "policy-ju.dge-v2",
        "policy-solver-v2",
        "policy-v2",
    ]
    unloads = [name for route, name in server.posted if route == "/v1/unload_lora_adapter"]
    assert unloads == ["policy-v1", "policy-ju.dge-v1", "policy-solver-v1"]


def test_the_plugin_entry_point_module_imports_no_vllm():
    """vLLM imports the entry point's module in each of its processes; the engine class (and vLLM's
    weight-transfer API with it) is loaded by path only where a server creates one."""
    import subprocess
    import sys

    code = "import sys, orchestrate.serving.vllm_plugin.weight_engine; print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'finetune')))"  # noqa: E501
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    module, _, cls = weight_paths.ENGINES["tapeloop"].partition(":")
    assert (ROOT / (module.replace(".", "/") + ".py")).is_file() and f"class {cls}(" in (
        ROOT / (module.replace(".", "/") + ".py")
    ).read_text()
