"""The command line: presets, dotted overrides, and bad input refused with exit status 2."""

import json
import re
import subprocess
import sys

import pytest

from orchestrate.loop.command_line import COMMON, options, parse_args, presets, resolve, resolve_from, shown, value_at
from orchestrate.loop.config import SET_BY_LOOP, RLConfig
from orchestrate.loop.config_checks import ConfigError


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "orchestrate.rl", *args], capture_output=True, text=True, timeout=120)


def test_presets_resolve():
    assert {"embedded", "gsm8k"} <= set(presets())
    embedded = resolve("embedded", {})
    assert embedded.model.policy == "smollm2" and embedded.env.id == "math:arithmetic"
    gsm8k = resolve("gsm8k", {})
    assert gsm8k.model.policy == "meta-llama/Llama-3.2-1B-Instruct"
    assert (gsm8k.rollouts.tasks_per_iteration, gsm8k.rollouts.attempts, gsm8k.rollouts.temperature) == (16, 64, 0.7)
    assert gsm8k.eval.every == 5 and gsm8k.eval.temperature == 0 and gsm8k.eval.tasks is None
    assert gsm8k.train.algorithm == "grpo" and gsm8k.train.kl_coef > 0


@pytest.mark.parametrize("name", presets())
def test_every_shipped_preset_is_written_in_todays_option_names(name):
    """Each key of a shipped preset is an option the command line takes (`--SECTION.OPTION`), and the preset
    resolves as `--preset NAME` resolves it."""
    from orchestrate.loop.command_line import load_preset
    from orchestrate.loop.resume import config_differences

    known = {dotted for dotted, _, _ in options()}

    def unknown(table: dict, prefix: str = "") -> list[str]:
        out = []
        for key, value in table.items():
            dotted = f"{prefix}{key}"
            if dotted in known:
                continue
            out += unknown(value, f"{dotted}.") if isinstance(value, dict) else [dotted]
        return out

    assert unknown(load_preset(name)) == []
    saved = resolve(name, {}).model_dump(mode="json")  # what a run saves (config.json) reads back the same
    assert config_differences(RLConfig.model_validate(saved).model_dump(mode="json"), saved) == []


def test_the_multi_turn_presets_normalise_over_the_batch():
    """game and countdown discount their turns (gamma 0.9), where a group baseline does not fit: their
    estimator is the batch's."""
    for name in ("game", "countdown"):
        train = resolve(name, {}).train
        assert (train.algorithm, train.loss, train.estimator, train.gamma) == ("grpo", "grpo", "batch", 0.9), name


def test_dotted_overrides_are_typed():
    config = resolve(
        "gsm8k",
        {
            "rollouts.attempts": "8",
            "train.lr": "2e-6",
            "model.policy": "smollm2",
            "env.id": "math:arithmetic",
            "env.options.operations": '["+", "-"]',
            "eval.tasks": "null",
        },
    )
    assert config.rollouts.attempts == 8 and config.train.lr == 2e-6 and config.model.policy == "smollm2"
    assert config.env.options == {"operations": ["+", "-"]} and config.eval.tasks is None  # the preset's were gsm8k's


def test_every_option_has_a_meaning():
    names = [name for name, field, _ in options()]
    assert "rollouts.attempts" in names and "train.kl_coef" in names and "server.kv_cache_gib" in names
    missing = [name for name, field, _ in options() if not field.description]
    assert not missing, missing


def help_text(capsys, *argv: str) -> str:
    """What `orchestrate.rl ARGV` prints for --help / --help-all (in-process; tests/test_docs.py runs the real
    process)."""
    with pytest.raises(SystemExit) as exited:
        parse_args(list(argv))
    assert exited.value.code == 0
    return capsys.readouterr().out


def listed(text: str) -> set[str]:
    return set(re.findall(r"^  --([a-z_]+\.[a-z0-9_.]+)", text, re.MULTILINE))


def test_help_lists_the_common_options_and_help_all_every_one(capsys):
    short, full = help_text(capsys, "--help"), help_text(capsys, "--help-all")
    names = {name for name, _, _ in options()}
    assert set(COMMON) <= names and listed(short) == set(COMMON) and "--help-all lists all" in short
    assert listed(full) == names and len(names) > 140
    for own in ("--preset", "--run-dir", "--iterations", "--print-config", "--help-all"):
        assert f"\n  {own}" in short and f"\n  {own}" in full


def test_help_loads_no_torch():
    """--help resolves the preset to show its values, without the checks that count this machine's GPUs: it
    answers at once, never after torch's seconds of import (tests/test_layering.py: reading the options)."""
    code = ("import contextlib, io, sys\nfrom orchestrate.loop.command_line import parse_args\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    parse_args(['--preset', 'gsm8k', '--help-all'])\nprint('torch._C' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("preset", [None, "countdown", "gsm8k"])
def test_the_defaults_help_shows_are_those_a_run_takes(preset, capsys, monkeypatch):
    """Each option's `(default: X)` in --help-all is the value a run given no such option takes: the named
    preset's, else the embedded one's (not the field's own default: lr 1e-06 where the embedded preset trains at
    1e-05)."""
    monkeypatch.setenv("COLUMNS", "100000")  # each option's help on one line
    argv = [] if preset is None else ["--preset", preset]
    values = parse_args([*argv, "--run-dir", "/nonexistent/run"])[1].model_dump(mode="json")
    shown_defaults, name = {}, None
    for line in help_text(capsys, *argv, "--help-all").splitlines():
        if m := re.match(r"^  --([a-z_]+\.[a-z0-9_.]+)", line):
            name = m.group(1)
        if name and (d := re.search(r".*\(default: (.*)\)$", line)):
            shown_defaults[name], name = d.group(1), None
    assert shown_defaults == {name: shown(value_at(values, name)) for name, _, _ in options()}
    lr, turns, tasks = {None: ("1e-05", "1", "200"), "countdown": ("2e-05", "2", "100"),
                        "gsm8k": ("1e-06", "1", "none")}[preset]  # fmt: skip
    assert (shown_defaults["train.lr"], shown_defaults["agent.max_turns"], shown_defaults["eval.tasks"]) == (
        lr, turns, tasks)  # fmt: skip


@pytest.mark.parametrize("dotted", sorted(SET_BY_LOOP))
def test_the_learners_fields_the_loop_sets_are_no_options(dotted, rl_cli):
    """train.colocated, train.teacher_coef, train.teacher_topk_coef: not listed, refused as unknown in one line
    naming the option that decides them, on the command line and in a preset (finetune.train keeps them)."""
    assert dotted not in {name for name, _, _ in options()}
    for argv in ([f"--{dotted}", "1"], [f"--{dotted}=true", "--print-config"]):
        code, line = rl_cli(argv)
        assert code == 2 and f"--{dotted}: not an option of orchestrate.rl" in line and SET_BY_LOOP[dotted] in line
    section, name = dotted.split(".")
    with pytest.raises(ConfigError, match=f"^--{dotted}: not an option.*preset 'mine' sets it"):
        resolve_from({section: {name: 1}}, {}, "preset 'mine'")
    resolve_from({section: {name: 0}}, {}, "preset 'mine'")  # a saved run's config holds it at its default


def test_the_config_page_lists_the_options_as_help_all_does():
    """docs/config.md's table of options is generated from the parser: a new option is in it once the generator
    runs, never by hand."""
    from orchestrate.loop import config_doc

    page = config_doc.PAGE.read_text(encoding="utf-8")
    assert config_doc.with_table(page) == page, "docs/config.md is stale: run `uv run -m orchestrate.loop.config_doc`"
    for name, _, _ in options():
        assert f"`--{name}`" in page


@pytest.mark.parametrize(
    "args, named",
    [
        (["--preset", "nope"], "--preset"),
        (["--rollouts.bogus", "3"], "--rollouts.bogus"),
        (["--rollouts.attempts", "0"], "--rollouts.attempts"),
        (["--rollouts.attempts", "many"], "--rollouts.attempts"),
        (["--rollouts.temperature", "-0.5"], "--rollouts.temperature"),
        (["--eval.temperature", "-1"], "--eval.temperature"),
        (["--preset", "gsm8k", "--env.options.test", "/no/such/test.jsonl"], "--env.options.test"),
        (["--env.id", "no:such"], "--env.id"),
        (["--env.options.digits", "0"], "--env.options.digits"),
        (["--env.options.nonsense", "1"], "--env.options.nonsense"),
        (["--env.id", "countdown", "--env.options.numbers", "99"], "--env.options.numbers"),
        (["--train.algorithm", "ppx"], "--train.algorithm"),
        (["--iterations", "0"], "iterations"),
        (["--preset", "nope", "--help"], "--preset"),
    ],
)
def test_bad_input_exits_2_naming_the_option(args, named, rl_cli):
    """In-process (the same main; tests/test_cli_strict.py checks the real process's one line)."""
    code, last = rl_cli(args)
    assert code == 2 and "error" in last and named in last, last


def test_print_config_round_trips():
    out = run_cli("--rollouts.attempts", "6", "--print-config")
    assert out.returncode == 0, out.stderr
    config = RLConfig.model_validate(json.loads(out.stdout))
    assert config.rollouts.attempts == 6


def test_config_error_is_one_line():
    with pytest.raises(ConfigError) as err:
        resolve("embedded", {"train.grpo.clip_eps_low": "2"})
    assert "\n" not in str(err.value) and "--train.grpo.clip_eps_low" in str(err.value)


def test_the_learner_config_is_a_section_and_a_resume_with_other_settings_is_refused(tmp_path):
    """RLConfig holds the learner's TrainConfig whole (train) and how it is run beside it (trainer); a run
    dir resumes with the settings it was started with, and one of them changed is refused, named."""
    from contract.rundir import RunDir
    from finetune.config import TrainConfig
    from orchestrate import rl

    config = resolve("embedded", {"trainer.timeout_s": "99", "train.lr": "3e-6"})
    assert type(config.train) is TrainConfig and config.trainer.timeout_s == 99
    current = config.model_dump(mode="json")
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    run_dir.metrics_path.write_text('{"iteration": 1}\n')  # it played: held to its settings
    run_dir.config_path.write_text(json.dumps(current))
    rl._check_resume(run_dir, current)  # the same settings: not refused
    saved = json.loads(json.dumps(current))
    saved["trainer"]["num_processes"] = 2
    run_dir.config_path.write_text(json.dumps(saved))
    with pytest.raises(rl._Refused, match="--trainer.num_processes"):
        rl._check_resume(run_dir, current)
    # the learner reads its train_config.json (the train section) back as the same options
    assert TrainConfig.model_validate(current["train"]) == config.train


def test_a_run_saved_with_the_programs_options_under_agent_loads_and_resumes(tmp_path):
    """Runs saved before the program section held reward, tool_parser, time_limit_s and the gateway's address
    in `agent`: their config.json loads with those options in `program`, and the run resumes unrefused."""
    from contract.rundir import RunDir
    from orchestrate import rl

    config = resolve("program_tool", {"program.time_limit_s": "42", "program.gateway_port": "8123"})
    current = config.model_dump(mode="json")
    old = json.loads(json.dumps(current))
    old["agent"].update(old.pop("program"))  # as an old run wrote it
    assert old["agent"]["time_limit_s"] == 42 and "program" not in old
    loaded = RLConfig.model_validate(old)
    assert loaded == config and loaded.program.gateway_port == 8123 and loaded.program.tool_parser == "hermes"
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    run_dir.metrics_path.write_text('{"iteration": 1}\n')  # it played: held to its settings
    run_dir.config_path.write_text(json.dumps(old))
    rl._check_resume(run_dir, current)  # not refused
    old["agent"]["time_limit_s"] = 7
    run_dir.config_path.write_text(json.dumps(old))
    with pytest.raises(rl._Refused, match="--program.time_limit_s"):
        rl._check_resume(run_dir, current)


@pytest.mark.parametrize("name", sorted(__import__("finetune.algorithms").algorithms.ALGORITHMS))
def test_each_algorithm_users_know_is_one_option(name):
    """Every registered algorithm (the README names eight) resolves (what each sets: tests/test_compare_algorithms.py); an option the
    user gives wins over the algorithm's."""
    from finetune.algorithms import ALGORITHMS

    config = resolve("embedded", {"train.algorithm": name})
    a = ALGORITHMS[name]
    assert (config.train.loss, config.train.estimator, config.train.aggregation) == (a.loss, a.estimator, a.aggregation)
    mine = resolve("embedded", {"train.algorithm": name, "train.aggregation": "sequence" if a.aggregation == "token"
                                else "token"})  # fmt: skip
    assert mine.train.aggregation != a.aggregation


def test_another_algorithm_on_a_saved_config_sets_its_own_settings():
    """Offline training on a run's tapes with --train.algorithm X: the saved dump keeps only the run's own
    choices (here lr), so X's loss, estimator and settings apply, not the old algorithm's."""
    from finetune.config import TrainConfig, own_choices

    saved = TrainConfig(algorithm="dapo", overlong_buffer=10, lr=3e-4).model_dump(mode="json")
    changed = TrainConfig.model_validate({**own_choices(saved), "algorithm": "reinforce"})
    assert (changed.loss, changed.estimator, changed.grpo.clip_eps_high, changed.overlong_buffer, changed.lr) == (
        "reinforce", "none", 0.2, 0, 3e-4)  # fmt: skip
    changed = TrainConfig.model_validate({**own_choices(TrainConfig().model_dump(mode="json")), "algorithm": "dr_grpo"})
    assert changed.normalize_std is False and changed.estimator == "group"


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"server.dtype": "nosuch"}, ["server.dtype", "'bfloat16'"]),  # was refused by vLLM after the run started
        ({"run.seed": str(2**64)}, ["run.seed", "4294967295"]),  # numpy's seeds are 32-bit
        ({"train.seed": "-1"}, ["train.seed", "0"]),
        ({"train.colocated": "true"}, ["--train.colocated", "--server.colocate"]),  # was silently overridden
    ],
)
def test_values_only_the_servers_or_numpy_refused_are_refused_before_anything_starts(overrides, words):
    from orchestrate.loop.command_line import resolve
    from orchestrate.loop.config_checks import ConfigError

    with pytest.raises((ConfigError, ValueError)) as exc:
        resolve("embedded", overrides)
    assert all(w in str(exc.value) for w in words), str(exc.value)


def test_a_run_saved_with_options_an_earlier_version_ignored_resumes(tmp_path):
    """train.colocated (the loop sets it) and teacher options without a teacher were taken and ignored; they are
    refused now, and a run saved with them resumes as it ran, without them."""
    from contract.rundir import RunDir
    from orchestrate import rl
    from orchestrate.loop.command_line import resolve

    current = resolve("embedded", {}).model_dump(mode="json")
    saved = json.loads(json.dumps(current))
    saved["train"]["colocated"] = True
    saved["teacher"]["coef"] = 0.5
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    run_dir.metrics_path.write_text('{"iteration": 1}\n')
    run_dir.config_path.write_text(json.dumps(saved))
    rl._check_resume(run_dir, current)  # not refused
