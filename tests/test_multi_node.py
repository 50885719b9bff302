"""The trainer on machines the orchestrator did not start it on (--trainer.launch external): the command it
prints for each machine, its wait on the trainer's heartbeat file, and two "machines" (two accelerate
launches on this host, gloo) that train to the weights of one process."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from contract.batch import Sample, write_batch
from contract.rundir import RunDir
from finetune.config import TrainConfig
from orchestrate.loop.command_line import resolve
from orchestrate.loop.config import TrainerSection
from orchestrate.loop.config_checks import ConfigError
from orchestrate.loop.trainer import TrainerError, TrainerProcess
from orchestrate.serving.vllm_server import free_port

ROOT = Path(__file__).resolve().parent.parent


def external(tmp_path, **launch) -> TrainerProcess:
    run = RunDir(tmp_path / "run")
    run.create()
    section = TrainerSection(launch="external", **launch)
    return TrainerProcess(run, tmp_path / "model", TrainConfig(), section)


def beat(run, trainer_id: str = "t1", n: int = 1, status: str = "alive") -> None:
    RunDir(run.root).write_heartbeat(trainer_id=trainer_id, beat=n, status=status, num_processes=2)


def test_external_start_prints_one_command_per_machine_and_starts_nothing(tmp_path, capsys):
    trainer = external(tmp_path, num_machines=2, num_processes=4, main_process_ip="10.0.0.1", main_process_port=29555)
    (trainer.run.trainer_stop).touch()  # left by the run's last stop
    trainer.start()
    out = capsys.readouterr().out
    assert trainer.process is None and trainer.started
    assert not trainer.run.trainer_stop.exists()  # or the trainer would exit as soon as it looks
    assert json.loads(trainer.config_path.read_text()) == json.loads(TrainConfig().model_dump_json())
    commands = trainer.external_commands()
    assert len(commands) == 2
    for rank, command in enumerate(commands):
        assert f"machine {rank}: {command}" in out
        assert f"--num_machines 2 --machine_rank {rank} --main_process_ip 10.0.0.1 --main_process_port 29555 " \
               "--num_processes 4 -m finetune.train" in command  # fmt: skip
        assert f"--run-dir {trainer.run.root.absolute()}" in command and "--parent-pid" not in command
        assert "multi_gpu_ddp.yaml" in command  # trainer machines are GPU machines unless told otherwise
    assert "--trainer.timeout_s" in out and str(trainer.run.trainer_heartbeat) in out
    trainer.stop()  # asks the trainer to exit after its batch; there is nothing to kill
    assert trainer.run.trainer_stop.exists()


def test_local_processes_meet_on_a_free_port(tmp_path):
    """One machine, several processes: the launch takes a free port, not accelerate's default 29500."""
    one, two = (TrainerProcess(RunDir(tmp_path), tmp_path, TrainConfig(), TrainerSection(num_processes=n)).command()
                for n in (1, 2))  # fmt: skip
    assert "--main_process_port" not in one
    assert int(two[two.index("--main_process_port") + 1]) != 29500


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda"])
def test_the_learner_is_launched_on_its_gpus_and_processes(tmp_path, monkeypatch, cuda):
    """--trainer.gpus reaches accelerate as --gpu_ids (its launcher sets CUDA_VISIBLE_DEVICES from them,
    overriding ours), as physical names when our own CUDA_VISIBLE_DEVICES renumbers them; several processes
    get a multi-process config, one process a single-process one."""
    import orchestrate.loop.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "cuda_available", lambda: cuda)
    monkeypatch.setattr("orchestrate.loop.config_checks.visible_gpus", lambda: ["4", "5", "6", "7"])

    def launch(**section):
        trainer = TrainerProcess(RunDir(tmp_path), tmp_path, TrainConfig(), TrainerSection(**section))
        command = trainer.command()
        config = Path(command[command.index("--config_file") + 1]).name
        gpu_ids = command[command.index("--gpu_ids") + 1] if "--gpu_ids" in command else None
        env = trainer.environment()
        assert (env.get("ACCELERATE_USE_CPU") == "true") == (config == "multi_cpu.yaml")  # else no gloo group
        return config, gpu_ids, env.get("CUDA_VISIBLE_DEVICES")

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    one, many = ("one_gpu.yaml", "multi_gpu_ddp.yaml") if cuda else ("cpu.yaml", "multi_cpu.yaml")
    assert launch() == (one, None, None)
    assert launch(num_processes=2) == (many, None, None)
    assert launch(gpus="1") == (one, "5", "5")
    assert launch(gpus="2-3", num_processes=2) == (many, "6,7", "6,7")
    assert launch(gpus="1", accelerate_config="/x/fsdp.yaml") == ("fsdp.yaml", "5", "5")
    for name in ("multi_cpu.yaml", "one_gpu.yaml"):
        text = (trainer_module.ACCELERATE_CONFIGS / name).read_text()
        assert "gpu_ids" not in text  # a config's gpu_ids would override the trainer's GPUs
    assert "distributed_type: MULTI_GPU" in (trainer_module.ACCELERATE_CONFIGS / "multi_cpu.yaml").read_text()


def test_no_heartbeat_is_an_error_naming_the_timeout_option(tmp_path, capsys):
    trainer = external(tmp_path, timeout_s=0.5)
    beat(trainer.run, "earlier-trainer", 7, "stopped")  # the last beat of a trainer gone before this start
    trainer.start()
    with pytest.raises(TrainerError) as err:
        trainer.wait_for_checkpoint(1)
    message = str(err.value)
    assert "no heartbeat from the trainer in 0 s (raise --trainer.timeout_s)" in message
    assert trainer.external_commands()[0] in message  # what to run
    assert "waiting for the trainer's heartbeat" in capsys.readouterr().out


def test_a_trainer_that_stops_beating_is_an_error(tmp_path, capsys):
    trainer = external(tmp_path, timeout_s=600, heartbeat_timeout_s=0.3)
    trainer.start()
    beat(trainer.run)  # one beat, then silence
    with pytest.raises(TrainerError, match=r"has not changed for .*--trainer.heartbeat_timeout_s 0.3"):
        trainer.wait_for_checkpoint(1)


def test_a_trainer_that_says_it_failed_is_an_error(tmp_path):
    trainer = external(tmp_path, timeout_s=600)
    trainer.start()
    beat(trainer.run, n=1)
    beat(trainer.run, n=2, status="failed")
    with pytest.raises(TrainerError, match="the trainer failed before checkpoint 1") as err:
        trainer.wait_for_checkpoint(1)
    assert "start the trainer again on each machine" in str(err.value)


def test_a_beating_trainer_s_checkpoint_is_returned(tmp_path):
    trainer = external(tmp_path, timeout_s=600)
    trainer.start()
    beat(trainer.run)
    folder = trainer.run.checkpoint(1)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert trainer.wait_for_checkpoint(1) == folder


@pytest.mark.parametrize(
    "overrides, option",
    [
        ({"trainer.num_machines": "2", "trainer.main_process_ip": "10.0.0.1"}, "--trainer.launch external"),
        ({"trainer.launch": "external", "trainer.num_machines": "2"}, "--trainer.main_process_ip"),
        ({"trainer.launch": "external", "trainer.cpus": "0"}, "--trainer.cpus"),
        ({"trainer.launch": "remote"}, "--trainer.launch"),
        (
            {
                "trainer.launch": "external",
                "trainer.num_machines": "2",
                "trainer.main_process_ip": "h",
                "trainer.num_processes": "3",
            },
            "--trainer.num_processes",
        ),  # fmt: skip
    ],
)
def test_bad_launch_options_are_refused(overrides, option):
    with pytest.raises(ConfigError, match=option):
        resolve("embedded", overrides)


# ---- two machines on this host ---------------------------------------------------------------------

CONFIG = TrainConfig(lr=1e-3, epochs=2, steps_per_epoch=2, token_budget=16)
# accelerate's multi-node launcher (torchrun) with a MULTI_GPU config; ACCELERATE_USE_CPU makes it CPU + gloo
# (`--cpu` would take accelerate's simple launcher, which starts one process per machine only under MPI)
MULTI_CPU_YAML = "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmixed_precision: 'no'\n" \
                 "num_machines: 1\nnum_processes: 2\nuse_cpu: true\n"  # fmt: skip


def hand_built_batch(tiny: Path) -> list[Sample]:
    """Three groups of four, behaviour log-probs from the initial model (ratios start at 1)."""
    from finetune.learner import Learner

    g = torch.Generator().manual_seed(0)
    samples = []
    for group in range(3):
        prompt = torch.randint(0, 256, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for k in range(4):
            n = int(torch.randint(1, 10, (1,), generator=g))
            samples.append(Sample(prompt_ids=prompt, completion_ids=torch.randint(0, 256, (n,), generator=g).tolist(),
                                  behaviour_logprobs=[0.0] * n, reward=float(k == group % 4), group_id=str(group),
                                  temperature=0.7))  # fmt: skip
    logprobs = Learner(tiny, CONFIG).logprobs(samples)
    return [s.model_copy(update={"behaviour_logprobs": lp.tolist()}) for s, lp in zip(samples, logprobs)]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


def adapter(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter" / "adapter_model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_two_machines_train_to_the_weights_of_one_process(tmp_path, tiny_model_dir, lora):
    """One process and two 'machines' (torchrun, gloo) train the same batch to the same weights: every weight,
    or with LoRA the adapter, whose trainer state rank 0 saves at the stop holds the adapters only. Without
    LoRA, two processes launched here by --trainer.num_processes 2 alone (no config file) do too."""
    train = CONFIG.model_copy(update={"lora": TrainConfig(lora={"rank": lora}).lora}) if lora else CONFIG
    samples = hand_built_batch(tiny_model_dir)
    one = RunDir(tmp_path / "one")
    two = RunDir(tmp_path / "two")
    three = RunDir(tmp_path / "three")
    for run in (one, two, three):
        run.create()
        write_batch(run.batch(1), samples)
    config = tmp_path / "multi_cpu.yaml"
    config.write_text(MULTI_CPU_YAML)
    local = TrainerProcess(one, tiny_model_dir, train, TrainerSection(timeout_s=300))
    remote = TrainerProcess(two, tiny_model_dir, train, TrainerSection(
        launch="external", accelerate_config=str(config), num_processes=2, num_machines=2,
        main_process_ip="127.0.0.1", main_process_port=free_port(), timeout_s=300))  # fmt: skip
    machines = []
    local.start()
    try:
        remote.start()
        env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
        for rank, command in enumerate(remote.external_commands()):  # as printed, one per "machine"
            log = open(tmp_path / f"machine{rank}.log", "wb")
            machines.append(subprocess.Popen(["bash", "-c", command], stdout=log, stderr=subprocess.STDOUT,
                                             env=env, start_new_session=True))  # fmt: skip
        read = adapter if lora else weights
        expected = read(local.wait_for_checkpoint(1))
        got = read(remote.wait_for_checkpoint(1))
        remote.stop()  # the stop file: both machines exit after the batch
        if not lora:  # the local multi-process launch (finetune/accelerate/multi_cpu.yaml, ACCELERATE_USE_CPU)
            local_two = TrainerProcess(three, tiny_model_dir, train, TrainerSection(num_processes=2, timeout_s=300))
            local_two.start()
            try:
                got_here = read(local_two.wait_for_checkpoint(1))
            finally:
                local_two.stop()
            assert RunDir(three.root).read_heartbeat()["num_processes"] == 2
            for name, tensor in expected.items():
                torch.testing.assert_close(got_here[name], tensor, atol=1e-5, rtol=0, msg=name)
        for rank, machine in enumerate(machines):
            assert machine.wait(timeout=120) == 0, (tmp_path / f"machine{rank}.log").read_text()[-3000:]
    finally:
        local.stop()
        for machine in machines:
            if machine.poll() is None:
                os.killpg(machine.pid, 9)
    # rank 0 alone wrote the shared files: one metrics line per step, its state and last beat
    steps = [json.loads(line) for line in two.train_metrics.read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2, 3, 4] and all(m["micro_batches"] > 2 for m in steps)
    assert json.loads(two.learner_status.read_text())["status"] == "stopped"
    last_beat = RunDir(two.root).read_heartbeat()
    assert last_beat["status"] == "stopped" and last_beat["num_processes"] == 2
    if lora:
        from safetensors import safe_open

        with safe_open(str(two.checkpoint(1) / "trainer_state" / "model.safetensors"), "pt") as f:
            assert sorted(f.keys()) and all(".lora_A." in k or ".lora_B." in k for k in f.keys())
        name = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
        assert expected[name].abs().max() > 1e-4  # the batch moved the adapter (B starts at 0)
    else:
        initial = weights(tiny_model_dir)
        name = "model.layers.1.self_attn.q_proj.weight"
        assert (expected[name] - initial[name]).abs().max() > 1e-3  # the batch moved the weights
    # same global batch, each rank's loss weighted by the step's totals, gradients summed over ranks:
    # the update of one process
    worst = max(float((got[k] - v).abs().max()) for k, v in expected.items())
    print(f"largest difference between one process and two machines: {worst:.3g}")
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, atol=1e-5, rtol=0, msg=k)
