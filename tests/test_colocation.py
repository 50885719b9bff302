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
from orchestrate.serving.vllm_server import ServerConfig


class Recorded:
    """A server stand-in that notes what it is asked, in one shared list; on a GPU (`gpus`: its own, None: the
    first visible ones) when `on_gpu`."""

    def __init__(self, name: str, calls: list, on_gpu: bool = False, gpus: list[str] | None = None, tp: int = 1):
        self.name, self.calls = name, calls
        self.on_gpu, self.gpu_ids = on_gpu, gpus
        self.config = ServerConfig(tensor_parallel_size=tp)

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
    # each started, ready and asleep before the next starts: no two measure the GPU's free memory at once
    assert calls == [("policy", "start", True), ("policy", "sleep"), ("reference", "start", True),
                     ("reference", "sleep"), ("policy", "ready"), ("reference", "ready"), ("policy", "wake")]  # fmt: skip

    calls.clear()

    @asynccontextmanager
    async def no_client(role):
        yield None

    async def scored(tapes, client, progress, field, top=0):
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


@pytest.mark.parametrize(
    "placed, after",
    [
        # policy and reference on the one GPU (nothing placed: the first visible), as with --server.colocate off
        ({"policy-0": (True, None), "reference": (True, None)}, {"reference": ["policy-0"]}),
        # two policy servers on GPUs of their own, the reference on the first's
        ({"policy-0": (True, ["4"]), "policy-1": (True, ["5"]), "reference": (True, ["4"])},
         {"reference": ["policy-0"]}),
        # tensor parallel over the first two visible GPUs, the reference on the second
        ({"policy-0": (True, None, 2), "reference": (True, ["5"])}, {"reference": ["policy-0"]}),
        ({"policy-0": (True, ["4"]), "policy-1": (True, ["5"])}, {}),  # a GPU each: at once
        ({"policy-0": (False, None), "reference": (False, None)}, {}),  # CPU: at once, as ever
    ],
)  # fmt: skip
def test_servers_on_one_gpu_start_one_after_the_other_outside_colocation(tmp_path, monkeypatch, placed, after):
    """vLLM sizes a server's KV cache from its GPU's free memory at start: a server starts only once those
    before it on any of its GPUs answer; servers on other GPUs, or on CPU, start at once."""
    monkeypatch.setattr(servers, "visible_gpus", lambda: ["4", "5"])
    calls = []
    made = {name: Recorded(name, calls, *where) for name, where in placed.items()}
    policy = [server for name, server in made.items() if name.startswith("policy")]
    group = Servers(RLConfig(), RunDir(tmp_path), None, policy, made.get("reference"))
    assert not group.colocated
    with ExitStack() as stack:
        group.launch(stack)
    starts = [call for call in calls if call[1] == "start"]
    assert starts == [(name, "start", False) for name in made]  # in order, none waited for in start
    for name in made:
        ready_before = {call[0] for call in calls[: calls.index((name, "start", False))] if call[1] == "ready"}
        assert ready_before == set(after.get(name, []))


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

        def close(self):
            calls.append("close")

    class FakeTrainer:
        def __init__(self, run, model_dir, train, launch):
            self.train = train

        def start(self):
            calls.append(("trainer", self.train.colocated))

        def stop(self):
            pass

    monkeypatch.setattr(iteration.Servers, "for_run", classmethod(lambda cls, *a, **k: FakeServers()))
    import orchestrate.loop.trainer

    monkeypatch.setattr(orchestrate.loop.trainer, "TrainerProcess", FakeTrainer)  # the run set-up builds it
    loop = iteration.Loop(RLConfig(), RunDir(tmp_path), progress=False)
    with ExitStack() as stack:
        loop._start(stack)
    trainer = ("trainer", colocated)
    expected = ["servers", trainer] if colocated else [trainer, "servers"]
    assert calls == [*expected, "use", "resume", "close"]  # the weight path closed when the run stops


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


# -- the memory plan ------------------------------------------------------------------------------------

LLAMA_1B = dict(
    parameters=1_235_814_400, layers=16, hidden=2048
)  # Llama-3.2-1B's shape (docs/weights.md, bench/bench_gpu_learner.py)


def gsm8k(**train):
    from orchestrate.loop.command_line import resolve

    config = resolve("gsm8k", {})  # the preset, as --preset gsm8k reads it
    return config.model_copy(update={"train": config.train.model_copy(update=train)}) if train else config


def test_the_learners_estimate_is_the_measured_peak():
    """Calibrated on docs/training.md's H200 figures: 1B, token budget 16384, peak 61.8 GiB eager and 45.2 GiB
    compiled (the estimate adds the CUDA context)."""
    from orchestrate.loop.memory_plan import CONTEXT_GIB, Shape, learner_gib

    train = gsm8k().train
    assert train.token_budget == 16384
    for compiled, measured in ((False, 61.8), (True, 45.2)):
        peak = learner_gib(Shape(**LLAMA_1B), train, compiled)[1] - CONTEXT_GIB
        assert abs(peak - measured) < 1.0, (compiled, peak)


def test_the_gsm8k_preset_fits_one_80_gb_gpu_colocated_and_what_does_not_is_refused():
    from orchestrate.loop.memory_plan import MemoryPlanError, Shape, check

    h100, h200 = 79.1, 139.8
    plan = check(gsm8k(), Shape(**LLAMA_1B), h100, compiled=True, colocated=True)
    assert set(plan) == {"generate", "reference", "train"}
    assert max(plan.values()) < 0.9 * h100, plan  # the target: peak under 90% of the GPU
    # the eager learner too, within the GPU (not within 90%: compile is on with CUDA by default)
    check(gsm8k(), Shape(**LLAMA_1B), h100, compiled=False, colocated=True)
    with pytest.raises(
        MemoryPlanError, match=r"^--server.colocate: the train phase needs about .* --train.token_budget"
    ):
        check(gsm8k(token_budget=65536), Shape(**LLAMA_1B), h200, compiled=False, colocated=True)  # measured: OOM
    config = gsm8k()
    config.server.gpu_memory_utilization = 0.9  # a server's share beside the learner's weights and optimizer
    with pytest.raises(MemoryPlanError, match=r"the generate phase .* --server.gpu_memory_utilization"):
        check(config, Shape(**LLAMA_1B), h100, compiled=True, colocated=True)
    with pytest.raises(MemoryPlanError, match=r"^--train.token_budget: the learner's peak is about"):
        check(gsm8k(token_budget=65536), Shape(**LLAMA_1B), h100, compiled=True, colocated=False)


LLAMA_8B = dict(parameters=8_030_261_248, layers=32, hidden=4096)  # Llama-3.1-8B's shape (its config.json)


def test_the_distillation_preset_fits_one_80_gb_gpu_with_its_8b_teacher_and_a_bigger_one_is_refused():
    """gsm8k_distill: a 1B student, an 8B teacher scored in the reference's seat (docs/training.md's plan)."""
    from orchestrate.loop.command_line import resolve
    from orchestrate.loop.memory_plan import MemoryPlanError, Shape, check

    config = resolve("gsm8k_distill", {})
    assert config.teacher.model and config.train.estimator == "zero" and not config.train.needs_reference
    h100 = 79.1
    plan = check(config, Shape(**LLAMA_1B), h100, compiled=True, colocated=True, teacher=Shape(**LLAMA_8B))
    assert set(plan) == {"generate", "reference", "train"}  # the teacher's pass is the reference's phase
    assert max(plan.values()) < 0.9 * h100, plan
    seventy = Shape(parameters=70_553_706_496, layers=80, hidden=8192)  # Llama-3.1-70B: 131 GiB of weights
    with pytest.raises(MemoryPlanError, match=r"^--teacher.model: its weights \(70.55B parameters, about 131.4 GiB"):
        check(config, Shape(**LLAMA_1B), h100, compiled=True, colocated=True, teacher=seventy)
    config.server.gpu_memory_utilization = 0.2  # 15.8 GiB: not the 8B's 15.0 GiB of weights and a KV cache
    with pytest.raises(MemoryPlanError, match="raise --server.gpu_memory_utilization"):
        check(config, Shape(**LLAMA_1B), h100, compiled=True, colocated=True, teacher=Shape(**LLAMA_8B))


def test_the_plan_is_checked_before_the_run_on_the_gpu_it_is_tightest_on(tiny_model_dir):
    """preflight's check reads the model's shape from its folder; on CPU the machine's memory is the plan's."""
    from orchestrate.loop.memory_plan import MemoryPlanError, Shape
    from orchestrate.loop.preflight import check_memory

    shape = Shape.of(tiny_model_dir)
    assert shape.parameters > 0 and shape.layers >= 1
    config = RLConfig()
    assert set(check_memory(config, tiny_model_dir)) == {"servers", "learner", "orchestrator"}  # CPU: the machine's
    assert set(check_memory(config, tiny_model_dir, totals=[80.0])) == {"generate", "train"}  # no KL: no reference
    assert set(check_memory(config.model_copy(update={"server": config.server.model_copy(update={"gpus": "1"})}),
                            tiny_model_dir, totals=[80.0, 80.0])) == {"train"}  # fmt: skip
    with pytest.raises(MemoryPlanError, match="GPU's 0.1 GiB"):
        check_memory(config, tiny_model_dir, totals=[0.1])


QWEN_05B = {"parameters": 630_167_424, "layers": 24, "hidden": 896, "intermediate": 4864}


def test_on_cpu_the_05bs_full_fine_tuning_is_refused_in_24_gib_and_lora_fits():
    """The CPU plan: one policy server (4.1 GiB measured for the 0.5B beside its 2 GiB KV cache), the learner's
    peak, the orchestrator. Full fine-tuning of the 0.5B (AdamW, 16 bytes a parameter with its gradient) does not
    fit 24 GiB beside its server; LoRA does. A plan past what is available now is a note, not a refusal."""
    from orchestrate.loop.command_line import resolve
    from orchestrate.loop.memory_plan import MemoryPlanError, Shape, check_cpu, cpu_server_gib

    shape = Shape(**QWEN_05B)
    assert 6.0 < cpu_server_gib(shape, 2) < 9.0
    lora = resolve("qwen_gsm8k", {})
    plan, note = check_cpu(lora, shape, total_gib=23.4, available=23.0)
    assert note is None and set(plan) == {"servers", "learner", "orchestrator"} and sum(plan.values()) < 23.4
    assert 11.0 < plan["learner"] < 14.0  # measured: 13.0 GiB at its peak (the process's whole RSS)
    full = resolve("qwen_gsm8k", {"train.lora.rank": "0"})
    with pytest.raises(
        MemoryPlanError, match=r"^--train.token_budget: .* this machine has 23.4 GiB .*--train.lora.rank 16"
    ):
        check_cpu(full, shape, total_gib=23.4)
    _, note = check_cpu(lora, shape, total_gib=23.4, available=8.0)
    assert note.startswith("note: the run needs about") and "8.0 GiB is available now" in note
    by_url = resolve("qwen_gsm8k", {"server.policy_urls": "http://127.0.0.1:8000"})
    assert check_cpu(by_url, shape, total_gib=23.4)[0]["servers"] == 0  # servers started elsewhere hold none here
    with_kl = resolve("qwen_gsm8k", {"train.kl_coef": "0.01", "train.lora.rank": "0", "train.token_budget": "256"})
    tiny = Shape(parameters=10_000_000, layers=2, hidden=64)  # the reference's server beside the policy's
    assert check_cpu(with_kl, tiny, total_gib=23.4)[0]["servers"] == 2 * cpu_server_gib(tiny, 2)


def test_on_cpu_the_15b_teacher_beside_the_05b_is_refused_naming_the_teacher():
    """The 1.5B teacher's server (fp32 on CPU) beside the 0.5B's and its learner passes 24 GiB: refused naming
    --teacher.model and the way out (a teacher served elsewhere, by URL, holds nothing here)."""
    from orchestrate.loop.command_line import resolve
    from orchestrate.loop.memory_plan import MemoryPlanError, Shape, check_cpu

    student, teacher = Shape(**QWEN_05B), Shape(parameters=1_777_088_000, layers=28, hidden=1536, intermediate=8960)
    with pytest.raises(MemoryPlanError, match=r"^--teacher.model: .* its server \(1.78B parameters .*--role teacher"):
        check_cpu(resolve("qwen_gsm8k", {"teacher.model": "qwen-coder-1.5b"}), student, 23.4, teacher=teacher)
    by_url = resolve("qwen_gsm8k", {"teacher.model": "http://127.0.0.1:8001"})
    assert check_cpu(by_url, student, 23.4, teacher=teacher)[0]["servers"] < 9
