"""What used to end in a traceback ends in one clear line and exit status 2 (issue 13, item 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from contract.weight_paths import options as weight_options
from tests.test_layering import commands


def one_line_error(out: subprocess.CompletedProcess, *words: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout[-1500:], out.stderr[-1500:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    for word in words:
        assert word in line, line
    return line


def in_process(module, *args, capsys):
    """`python -m module args` in this process (the same main; no traceback can hide: an exception fails the
    test), as (exit status, stderr); a subprocess pays seconds of imports for each call."""
    import importlib

    try:
        code = importlib.import_module(module).main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess([module, *map(str, args)], code, captured.out, captured.err)


def run(module, *args, timeout=180):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_model_that_cannot_be_had_leaves_no_run_directory(tmp_path, rl_cli, folder_model):
    run_dir = tmp_path / "run"
    code, line = rl_cli(["--run-dir", str(run_dir), "--model.policy", str(tmp_path / "no-such-model")])
    assert code == 2 and "--model.policy" in line
    assert not run_dir.exists()  # so the right command afterwards is a new run, not a "changed settings" resume


def test_a_refused_resume_changes_nothing(tmp_path, rl_cli, folder_model):
    run_dir = tmp_path / "run"
    (run_dir / "tapes").mkdir(parents=True)
    (run_dir / "state.json").write_text('{"completed_iteration": 2, "evaluated": [0]}')
    (run_dir / "metrics.jsonl").write_text('{"iteration": 1}\n{"iteration": 2}\n{"iteration": 3, "to')
    before = snapshot(run_dir)
    code, line = rl_cli(["--run-dir", str(run_dir), "--model.policy", str(tmp_path / "gone")])
    assert code == 2 and "--model.policy" in line
    assert snapshot(run_dir) == before


def test_a_folder_of_other_files_is_not_taken_for_a_run_directory(tmp_path, rl_cli, folder_model):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "notes.txt").write_text("mine")
    before = snapshot(project)
    code, line = rl_cli(["--run-dir", str(project), "--model.policy", str(folder_model)])
    assert code == 2 and "--run-dir" in line and "(src)" in line and "no run" in line, line
    assert snapshot(project) == before and sorted(p.name for p in project.iterdir()) == ["notes.txt", "src"]
    # a loose file is not a mark of someone's folder: the log a shell opened before the run (`> RUN/train.log`)
    logged = tmp_path / "logged"
    logged.mkdir()
    (logged / "train.log").write_text("")
    code, line = rl_cli(["--run-dir", logged, "--model.policy", tmp_path / "gone"])
    assert code == 2 and "--model.policy" in line, line  # past the run directory's check, to the model's


def test_a_run_that_played_nothing_starts_again_with_other_settings(tmp_path, rl_cli, folder_model):
    """A run whose servers refused an option (the run directory written, no episode played) is not held to
    that option: the next command may change it. One that played is (the refusal names the option)."""
    run_dir = tmp_path / "run"
    (run_dir / "tapes").mkdir(parents=True)
    (run_dir / "logs").mkdir()
    (run_dir / "config.json").write_text(json.dumps({"run": {"seed": 7}}))
    code, line = rl_cli(["--run-dir", str(run_dir), "--model.policy", str(tmp_path / "gone")])
    assert code == 2 and "--model.policy" in line, line  # past the settings check, to the model's
    (run_dir / "tapes" / "iter_000001.jsonl").write_text("")
    code, line = rl_cli(["--run-dir", str(run_dir), "--model.policy", str(tmp_path / "gone")])
    assert code == 2 and "was started with other settings (--model.policy);" in line, line  # its seed is its own


def test_a_run_resumes_with_its_own_settings_when_no_preset_is_named(tmp_path, folder_model, capsys):
    """`--run-dir RUN` alone (the command Ctrl-C prints) resumes RUN with the settings it was started with,
    whatever its preset and options: an option given changes one of them (one that may not change is the only
    one named), and a preset named is the base again (its differences named)."""
    from contract.rundir import RunDir
    from orchestrate.loop.command_line import resolve

    run = tmp_path / "run"
    started = resolve("game", {"train.lr": "3e-6", "model.policy": str(folder_model)}).model_dump(mode="json")
    RunDir(run).create()
    RunDir(run).save_config(started)
    (run / "tapes" / "iter_000001.jsonl").write_text("")  # it played: held to its settings
    out = in_process("orchestrate.rl", "--run-dir", run, "--print-config", capsys=capsys)
    assert out.returncode == 0 and json.loads(out.stdout) == started
    out = in_process("orchestrate.rl", "--run-dir", run, "--iterations", 99, "--print-config", capsys=capsys)
    assert json.loads(out.stdout) == {**started, "run": {**started["run"], "iterations": 99}}
    line = one_line_error(in_process("orchestrate.rl", "--run-dir", run, "--train.lr", "1e-5", capsys=capsys))
    assert "started with other settings (--train.lr);" in line, line
    line = one_line_error(in_process("orchestrate.rl", "--run-dir", run, "--preset", "game", capsys=capsys))
    assert "--model.policy" in line and "--train.lr" in line, line
    assert RunDir(run).saved_config() == started  # nothing written by the refusals
    # another algorithm sets its own loss, estimator and sampling: the preset is the base then, as when named
    out = in_process("orchestrate.rl", "--run-dir", run, "--train.algorithm", "reinforce", "--print-config",
                     capsys=capsys)  # fmt: skip
    assert json.loads(out.stdout)["train"] == resolve("embedded", {"train.algorithm": "reinforce"}).train.model_dump(
        mode="json")  # fmt: skip


def test_a_teacher_given_by_url_may_move_on_resume_and_a_served_one_may_not(
    tmp_path, folder_model, capsys, monkeypatch
):
    """As servers by URL may (`RESUMABLE`): the teacher's URL changes on resume (the run goes on to check the
    server there), a URL in place of a teacher the run served does not (refused, naming the option)."""
    from contract.rundir import RunDir
    from orchestrate.loop.command_line import resolve

    monkeypatch.setenv("VLLM_API_KEY", "k")
    run = tmp_path / "run"
    started = resolve("embedded", {"model.policy": str(folder_model), "teacher.model": "http://127.0.0.1:9"})
    RunDir(run).create()
    RunDir(run).save_config(started.model_dump(mode="json"))
    (run / "tapes" / "iter_000001.jsonl").write_text("")
    line = one_line_error(in_process("orchestrate.rl", "--run-dir", run, "--teacher.model", "http://127.0.0.1:7",
                                     capsys=capsys))  # fmt: skip
    assert "other settings" not in line and "http://127.0.0.1:7" in line, line  # past the settings check
    line = one_line_error(in_process("orchestrate.rl", "--run-dir", run, "--teacher.model", folder_model,
                                     capsys=capsys))  # fmt: skip
    assert "started with other settings (--teacher.model)" in line, line


def test_an_optional_option_takes_none_as_its_help_writes_it(capsys):
    """--help writes an optional option's values as TYPE|none: `none` (any case) is no value, as JSON's null."""
    from orchestrate.loop.command_line import parse_args

    _, config = parse_args(["--run.max_minutes", "none", "--server.reference_url", "None", "--agent.system_prompt",
                            "NONE", "--run-dir", "/nonexistent/run"])  # fmt: skip
    assert config.run.max_minutes is None and config.server.reference_url is None
    assert config.agent.system_prompt is None
    line = one_line_error(in_process("orchestrate.rl", "--rollouts.temperature", "none", capsys=capsys))
    assert line.startswith("error: --rollouts.temperature:"), line  # not optional: refused


# -- the run directory itself ---------------------------------------------------------------------


def test_run_dir_that_is_a_file(tmp_path, rl_cli, folder_model):
    (tmp_path / "f").write_text("x")
    for target in (tmp_path / "f", tmp_path / "f" / "run"):
        code, line = rl_cli(["--run-dir", str(target), "--model.policy", str(folder_model)])
        assert code == 2 and "--run-dir" in line and "file" in line, line


def test_run_dir_not_writable(tmp_path, rl_cli, folder_model, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    os.chmod(parent, 0o555)
    real_access = os.access
    if os.geteuid() == 0:  # root may write anywhere: ask as a normal user would be answered
        monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(parent) else real_access(p, mode))
    code, line = rl_cli(["--run-dir", str(parent / "run"), "--model.policy", str(folder_model)])
    assert code == 2 and "--run-dir" in line and "not writable" in line, line
    os.chmod(parent, 0o755)


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("config.json", b"{not json", "config.json"),
        ("config.json", b"[1, 2]", "config.json"),
        ("config.json", b"\xff\xfe\x00\x00", "config.json"),
        ("state.json", b"{not json", "state.json"),
        ("state.json", b"[]", "state.json"),
        ("state.json", b'{"completed_iteration": "three"}', "state.json"),
        ("state.json", b'{"completed_iteration": -4}', "state.json"),
    ],
)
def test_corrupt_run_files(name, content, words, tmp_path, rl_cli, folder_model):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).write_bytes(content)
    code, line = rl_cli(["--run-dir", str(run_dir), "--model.policy", str(folder_model)])
    assert code == 2 and words in line and "--run-dir" in line, line
    assert sorted(p.name for p in run_dir.iterdir()) == [name]


# -- presets ------------------------------------------------------------------------------------------


def test_malformed_preset(tmp_path, monkeypatch, rl_cli):
    from orchestrate.loop import command_line

    (tmp_path / "broken.toml").write_text("[rollouts\nattempts = ")
    (tmp_path / "shape.toml").write_text("rollouts = 3\n")
    monkeypatch.setattr(command_line, "PRESETS_DIR", tmp_path)
    with pytest.raises(command_line.ConfigError, match="broken.toml is not a valid TOML preset"):
        command_line.resolve("broken", {})
    with pytest.raises(command_line.ConfigError, match="--rollouts.attempts"):
        command_line.resolve("shape", {"rollouts.attempts": "3"})
    code, line = rl_cli(["--preset", "broken", "--print-config"])
    assert code == 2 and "--preset" in line


def test_preset_path_outside_the_presets(tmp_path, rl_cli):
    (tmp_path / "evil.toml").write_text("[run]\niterations = 1\n")
    for name in (str(tmp_path / "evil"), "../../../../" + str(tmp_path / "evil"), "../presets/embedded"):
        code, line = rl_cli(["--preset", name, "--print-config"])
        assert code == 2 and "--preset" in line and "unknown preset" in line, line


# -- tape tools on what is not a tape file ----------------------------------------------------------------


@pytest.fixture
def bad_run(tmp_path):
    """A run directory with a binary tape file, a Latin-1 one, tapes missing what tools need, and odd names."""
    from orchestrate.loop.command_line import resolve

    run_dir = tmp_path / "run"
    (run_dir / "tapes").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(resolve("embedded", {}).model_dump(mode="json")))
    (run_dir / "tapes" / "iter_000001.jsonl").write_bytes(
        b"\xff\xd8\xff\xe0" + bytes(range(256)) + b"\n"
    )  # a JPEG's head
    (run_dir / "tapes" / "iter_000002.jsonl").write_bytes('{"metadata": {"task_id": "caf\xe9"}}\n'.encode("latin-1"))
    (run_dir / "tapes" / "iter_000003.jsonl").write_text('{"metadata": {"reward": 1.0, "iteration": 3}, "steps": []}\n'
                                                         '{"metadata": {"reward": 0.0, "iteration": 3}, "steps": []}\n')  # fmt: skip
    (run_dir / "tapes" / "iter_000004.jsonl").write_text("")
    (run_dir / "tapes" / "iter_last.jsonl").write_text("whatever")
    (run_dir / "tapes" / "iter_.jsonl").write_text("whatever")
    return run_dir


def test_show_on_binary_and_non_utf8(bad_run, capsys):
    for name in ("iter_000001.jsonl", "iter_000002.jsonl"):
        one_line_error(in_process("orchestrate.after.show", bad_run / "tapes" / name, capsys=capsys), name, "UTF-8")
    # a folder, an empty file, a JSON line that is no episode's tape: each said as it is
    one_line_error(in_process("orchestrate.after.show", bad_run, capsys=capsys), "a folder", "iter_000001.jsonl")
    one_line_error(in_process("orchestrate.after.show", bad_run / "tapes" / "iter_000004.jsonl", capsys=capsys),
                   "holds no tapes")  # fmt: skip
    one_line_error(in_process("orchestrate.after.show", bad_run / "tapes" / "iter_000003.jsonl", capsys=capsys),
                   "iter_000003.jsonl:1", "not a tape of an episode")  # fmt: skip


def test_replay_on_binary_missing_fields_and_empty(bad_run, capsys):
    tapes = bad_run / "tapes"
    one_line_error(
        in_process("orchestrate.after.replay", tapes / "iter_000001.jsonl", capsys=capsys),
        "iter_000001.jsonl:1",
        "UTF-8",
    )
    one_line_error(
        in_process("orchestrate.after.replay", tapes / "iter_000003.jsonl", capsys=capsys),
        "iter_000003.jsonl:1",
        "cannot replay",
    )
    one_line_error(in_process("orchestrate.after.replay", tapes / "iter_000004.jsonl", capsys=capsys), "no tapes")


def test_offline_on_binary_missing_fields_and_odd_names(bad_run, tmp_path, folder_model, capsys):
    tapes = bad_run / "tapes"
    common = ["--model", folder_model, "--no-progress"]
    one_line_error(in_process("orchestrate.after.offline", "--tapes", tapes / "iter_000002.jsonl", "--out", tmp_path / "o1",
                       *common, capsys=capsys), "UTF-8")  # fmt: skip
    one_line_error(in_process("orchestrate.after.offline", "--tapes", tapes / "iter_000003.jsonl", "--out", tmp_path / "o2",
                       *common, capsys=capsys), "--tapes", "no steps")  # fmt: skip
    # --iterations over a folder that also holds iter_last.jsonl and iter_.jsonl
    one_line_error(in_process("orchestrate.after.offline", "--tapes", bad_run, "--iterations", "3-4", "--out", tmp_path / "o3",
                       *common, capsys=capsys), "--tapes", "no steps")  # fmt: skip
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


@pytest.mark.parametrize("port", ["99999", "-1", "65536", "http"])
def test_browse_port_out_of_range(bad_run, port):
    one_line_error(run("orchestrate.after.browse", bad_run, "--port", port, timeout=60), "--port")


@pytest.mark.parametrize("argv, words", [
    (["--server.cpus", "0-", ], ["--server.cpus", "core list"]),
    (["--trainer.cpus", "4096"], ["--trainer.cpus", "4096", "not among"]),
    (["--server.cpus", "0", "--trainer.cpus", "0"], ["--trainer.cpus", "also in --server.cpus"]),
    (["--run.async_level", "2", "--train.max_lag", "1"], ["--train.max_lag", "async_level"]),
    (["--run.in_flight_swaps", "true"], ["--run.in_flight_swaps", "--run.async_level 1 or more"]),
    (["--run.in_flight_swaps", "true", "--run.async_level", "1", "--train.lora.rank", "4"],
     ["--run.in_flight_swaps", "LoRA run never pauses"]),
    (["--run.in_flight_swaps", "true", "--run.async_level", "1", "--server.data_parallel_size", "2"],
     ["--run.in_flight_swaps", "data_parallel_size 2", "first engine's result only"]),
    (["--train.tis_cap", "0"], ["--train.tis_cap"]),
    (["--train.tis_cap", "nan"], ["--train.tis_cap"]),
    (["--train.lora.rank", "-1"], ["--train.lora.rank"]),
    (["--train.lora.alpha", "8"], ["lora.alpha", "lora.rank is 0"]),
    (["--train.lora.rank", "4", "--train.lora.target_modules", "q_proj,qkv_proj"],
     ["--train.lora.target_modules", "qkv_proj is not a matrix inside the layers", "v_proj"]),
    (["--train.lora.rank", "4", "--train.lora.target_modules", "lm_head"], ["lm_head is not a matrix inside"]),
    (["--train.lora.rank", "600"], ["--train.lora.rank", "above the largest rank vLLM serves (512)"]),
    (["--train.lora.rank", "8", "--server.weight_transfer", "gloo"], ["--server.weight_transfer", "only the adapter"]),
    (["--train.lora.rank", "8", "--train.save_weights_every", "2"], ["--train.save_weights_every", "orchestrate.after.merge"]),
    (["--train.lora.rank", "8", "--train.lora.start_from", "/tmp"], ["--train.lora.start_from", "orchestrate.after.merge"]),
    (["--train.lora.rank", "8", "--server.reference_url", "http://127.0.0.1:9", "--train.kl_coef", "0.01"],
     ["--server.reference_url", "scored on the policy servers"]),
    (["--server.weight_transfer", "nccl"], ["--server.weight_transfer", "no GPU"]),
    (["--server.weight_transfer", "tcp"], ["--server.weight_transfer", *(f"'{name}'" for name in weight_options())]),
])  # fmt: skip
def test_placement_staleness_lora_and_weight_options_are_checked_before_anything_starts(
    tmp_path, rl_cli, tiny_model_dir, argv, words
):
    run_dir = tmp_path / "run"
    code, line = rl_cli(["--run-dir", str(run_dir), "--model.policy", str(tiny_model_dir), *argv])
    assert code == 2, line
    for word in words:
        assert word in line, line
    assert not run_dir.exists()


# -- options that need what the environment declares (agents.envs.capabilities) -------------------


def test_more_eval_tasks_than_held_out_episodes_is_refused(tmp_path, rl_cli, folder_model):
    """game:guess_the_number from 1 to 20 has 20 distinct held-out episodes (its test_size)."""
    run_dir = tmp_path / "run"
    game = ["--env.id", "game:guess_the_number", "--env.options.low", "1", "--env.options.high", "20"]
    code, line = rl_cli(["--run-dir", run_dir, "--model.policy", folder_model, *game, "--eval.tasks", "21"])
    assert code == 2 and "--eval.tasks" in line and "--env.id game:guess_the_number" in line and "20" in line, line
    assert not run_dir.exists()
    # evaluation off: the number is not used, so it is not refused for this
    code, line = rl_cli(["--run-dir", run_dir, "--model.policy", folder_model, *game, "--eval.tasks", "21",
                         "--eval.every", "0", "--model.reference", tmp_path / "gone"])  # fmt: skip
    assert code == 2 and "--model.reference" in line, line


def test_tools_with_one_turn_are_refused(tmp_path, rl_cli, folder_model):
    run_dir = tmp_path / "run"
    code, line = rl_cli(["--run-dir", run_dir, "--model.policy", folder_model, "--env.tools", "python",
                         "--agent.max_turns", "1"])  # fmt: skip
    assert code == 2 and "--agent.max_turns" in line and "--env.tools python" in line, line
    assert not run_dir.exists()


@pytest.mark.parametrize("version", ["0.25.2", "0.33.0", None])
def test_a_vllm_outside_the_range_is_refused_before_the_run_directory(tmp_path, rl_cli, monkeypatch, version):
    """Servers start here only on the vLLM releases our engine and routes are written for (VLLM_RANGE)."""
    from orchestrate.serving import vllm_server

    low, high = vllm_server.VLLM_RANGE
    assert vllm_server.vllm_problem(f"{low}.0") is None and vllm_server.vllm_problem(f"{high}.9+cpu") is None
    monkeypatch.setattr(vllm_server, "vllm_version", lambda: version)
    run_dir = tmp_path / "run"
    code, line = rl_cli(["--run-dir", str(run_dir)])
    assert code == 2 and f"{low}" in line and f"{high}" in line and (version or "not installed") in line, line
    assert not run_dir.exists()


@pytest.mark.parametrize("module", sorted(commands()))  # every command, a new one too
def test_an_unknown_option_is_one_line_not_the_whole_usage(module, capsys):
    out = in_process(module, "x", "--no-such-option", "1", capsys=capsys)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("error: ") and "--help lists the options" in out.stderr


def test_merge_and_serve_refuse_unreadable_configs_in_one_line(tmp_path, capsys):
    garbage, listed, run = tmp_path / "garbage", tmp_path / "listed", tmp_path / "run"
    for folder, name, text in ((garbage, "adapter_config.json", "{oops"), (listed, "adapter_config.json", "[1]"),
                               (run, "config.json", "not json")):  # fmt: skip
        folder.mkdir()
        (folder / name).write_text(text)
        out = in_process("orchestrate.after.merge", folder, "--out", tmp_path / f"out-{folder.name}", capsys=capsys)
        one_line_error(out, str(folder / name))
    one_line_error(in_process("orchestrate.serve", "--run-dir", run, "--print", capsys=capsys), "not a run config")
    one_line_error(in_process("orchestrate.serve", "--port", 1, "--port", 2, "--print", capsys=capsys), "given twice")


def test_serve_takes_a_runs_settings_with_the_options_given_on_top(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """The teacher's server of a run that names its teacher by URL (as docs/config.md shows): the run's settings
    (its context length), the teacher's model from the command line; with no model given, refused in one line.
    A preset named for an existing run (one job script starts a run and resumes it) is not used: its servers
    serve the run's own settings."""
    from contract.rundir import RunDir
    from orchestrate.loop.command_line import resolve

    monkeypatch.setenv("VLLM_API_KEY", "k")
    run = tmp_path / "run"
    started = resolve("embedded", {"model.policy": str(tiny_model_dir), "teacher.model": "http://node7:8000",
                                   "server.max_model_len": "512"})  # fmt: skip
    RunDir(run).create()
    RunDir(run).save_config(started.model_dump(mode="json"))
    out = in_process("orchestrate.serve", "--run-dir", run, "--role", "teacher", "--teacher.model", tiny_model_dir,
                     "--print", capsys=capsys)  # fmt: skip
    assert out.returncode == 0, out.stderr
    command = out.stdout.strip().splitlines()[-1]
    assert f"--model {tiny_model_dir} --served-model-name teacher" in command and "--max-model-len 512" in command
    one_line_error(in_process("orchestrate.serve", "--run-dir", run, "--role", "teacher", "--print", capsys=capsys),
                   "--role teacher", "--teacher.model MODEL")  # fmt: skip
    out = in_process("orchestrate.serve", "--run-dir", run, "--preset", "gsm8k", "--print", capsys=capsys)
    assert out.returncode == 0 and "--served-model-name policy" in out.stdout, out.stderr
    assert "--max-model-len 512" in out.stdout and "Llama" not in out.stdout  # the run's, not the preset's
    # a run that uses its servers by URL (as the Slurm script of docs/multi-node.md starts it), pinned to other
    # cores: its reference server placed on this machine's core as given here, not refused by the run's URLs
    urls = {"server.policy_urls": "http://a:8000", "server.reference_url": "http://a:8001", "server.cpus": "1"}
    RunDir(run).save_config(resolve("embedded", {"model.policy": str(tiny_model_dir), **urls}).model_dump(mode="json"))
    out = in_process("orchestrate.serve", "--run-dir", run, "--role", "reference", "--server.cpus", "0", "--print",
                     capsys=capsys)  # fmt: skip
    assert out.returncode == 0 and "--served-model-name reference" in out.stdout, out.stderr
    assert "VLLM_CPU_OMP_THREADS_BIND=0 " in out.stdout, out.stdout
    monkeypatch.setattr("orchestrate.loop.config_checks.visible_gpus", lambda: ["0", "1"])  # as on a GPU node
    out = in_process("orchestrate.serve", "--run-dir", run, "--role", "reference", "--server.reference_gpus", "1",
                     "--print", capsys=capsys)  # fmt: skip
    assert out.returncode == 0 and "--served-model-name reference" in out.stdout, out.stderr


def test_browse_refuses_a_tokenizer_that_is_not_there(tmp_path, capsys):
    (tmp_path / "run" / "tapes").mkdir(parents=True)
    out = in_process("orchestrate.after.browse", tmp_path / "run", "--tokenizer", tmp_path / "none", capsys=capsys)
    one_line_error(out, "--tokenizer", "no tokenizer")


def test_a_finished_run_asked_for_fewer_iterations_changes_nothing(tmp_path, folder_model, capsys):
    from orchestrate.loop.command_line import parse_args

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _, config = parse_args(["--run-dir", str(run_dir), "--model.policy", str(folder_model), "--iterations", "30"])
    (run_dir / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
    (run_dir / "state.json").write_text('{"completed_iteration": 30, "evaluated": [0]}')
    (run_dir / "metrics.jsonl").write_text('{"iteration": 30}\n')
    before = snapshot(run_dir)
    from orchestrate import rl

    code = rl.main(["--run-dir", str(run_dir), "--model.policy", str(folder_model), "--iterations", "5"])
    assert code == 0 and "30 iterations are done, --iterations 5 asks for no more" in capsys.readouterr().out
    assert snapshot(run_dir) == before  # its config still says 30 (it said 5, and "Resuming", before)


def test_a_model_folder_given_as_run_directory_is_refused_and_untouched(tmp_path, rl_cli, folder_model):
    """Its config.json is a model's: neither resumed nor (the folder having played nothing) written over."""
    before = snapshot(folder_model)
    code, line = rl_cli(["--run-dir", folder_model, "--model.policy", folder_model])
    assert code == 2 and "--run-dir" in line and "is not a run's config" in line, line
    assert snapshot(folder_model) == before
