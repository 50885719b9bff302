"""The RL command line is taken literally and bad inputs are refused before anything starts (issue 13, item 1).

Each case: exit status 2, the last line of stderr names the option, and the run directory was not created.
"""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def refused(rl_cli):
    """(argv, run_dir) -> (exit status, last stderr line) of orchestrate.rl on that run directory."""
    return lambda argv, run_dir: rl_cli(["--run-dir", run_dir, *argv])


@pytest.mark.parametrize(
    "argv, named",
    [
        # abbreviations are not taken as the longer option
        (["--rollouts.attempt", "8"], "--rollouts.attempt"),
        (["--iter", "7"], "--iter"),
        (["--rollouts.temp", "3"], "--rollouts.temp"),
        # numbers that are not numbers
        (["--train.lr", "Infinity"], "--train.lr"),
        (["--train.lr", "-Infinity"], "--train.lr"),
        (["--train.lr", "NaN"], "--train.lr"),
        (["--train.lr", "inf"], "--train.lr"),
        (["--rollouts.temperature", "Infinity"], "--rollouts.temperature"),
        (["--rollouts.attempts", "true"], "--rollouts.attempts"),
        (["--run.iterations", "false"], "--run.iterations"),
        (["--train.grpo.clip_eps_high", "true"], "--train.grpo.clip_eps_high"),
        (["--train.algorithm", "ppx"], "--train.algorithm"),
        (["--train.ppo.vf_coef", "0.3"], "ppo"),  # options of an algorithm not chosen
        # an option given twice, under its two names or one
        (["--iterations", "3", "--run.iterations", "9"], "iterations"),
        (["--rollouts.attempts", "3", "--rollouts.attempts=5"], "--rollouts.attempts"),
        # what the learner cannot train with
        (["--rollouts.attempts", "1"], "--rollouts.attempts"),
        (["--rollouts.top_p", "0.9"], "--rollouts.top_p"),
        # sizes beyond reason
        (["--rollouts.attempts", "1e9"], "--rollouts.attempts"),
        (["--rollouts.tasks_per_iteration", "1e12"], "--rollouts.tasks_per_iteration"),
        (["--rollouts.max_tokens", "5000"], "--rollouts.max_tokens"),
        (["--eval.max_tokens", "1024", "--server.max_model_len", "1024"], "--eval.max_tokens"),
        (["--server.kv_cache_gib", "1000000"], "--server.kv_cache_gib"),
        # files that are not there
        (["--trainer.accelerate_config", "/no/such/accelerate.yaml"], "--trainer.accelerate_config"),
        (["--server.extra_args", '["--host", "0.0.0.0"]'], "--server.extra_args"),
    ],
)
def test_refused_naming_the_option(argv, named, tmp_path, folder_model, refused):
    run_dir = tmp_path / "run"
    code, line = refused(["--model.policy", str(folder_model), *argv], run_dir)
    assert code == 2 and named in line, line
    assert not run_dir.exists()


def test_size_limit_is_named(tmp_path, folder_model, refused):
    code, line = refused(["--model.policy", str(folder_model), "--rollouts.attempts", "1e9"], tmp_path / "r")
    assert code == 2 and "limit 4096" in line, line


def test_top_p_message_says_why(tmp_path, folder_model, refused):
    code, line = refused(["--model.policy", str(folder_model), "--rollouts.top_p", "0.5"], tmp_path / "r")
    assert code == 2 and "trainer" in line and "top_p = 1" in line, line


def test_a_group_of_one_is_fine_without_a_group_baseline(folder_model):
    from orchestrate.loop.command_line import resolve

    config = resolve("embedded", {"rollouts.attempts": "1", "train.algorithm": "reinforce"})
    assert config.rollouts.attempts == 1


def test_strict_values_still_take_what_is_right():
    from orchestrate.loop.command_line import resolve

    config = resolve("embedded", {"rollouts.attempts": "8", "train.lr": "2e-5", "run.wandb": "false",
                                  "eval.tasks": "null", "rollouts.top_p": "1"})  # fmt: skip
    assert (config.rollouts.attempts, config.train.lr, config.run.wandb, config.eval.tasks) == (8, 2e-5, False, None)


@pytest.mark.parametrize(
    "make, named",
    [
        (lambda d: d / "nothing-here", "--model.policy"),
        (lambda d: (d / "empty").mkdir() or d / "empty", "--model.policy"),  # no config.json
        (
            lambda d: (
                (d / "cfg").mkdir() or (d / "cfg" / "config.json").write_text('{"model_type": "llama"}') and d / "cfg"
            ),
            "--model.policy",
        ),  # config, no weights
        (
            lambda d: (d / "bad").mkdir() or (d / "bad" / "config.json").write_text("not json") and d / "bad",
            "--model.policy",
        ),
    ],
)
def test_model_that_is_not_there_is_refused_first(make, named, tmp_path, refused):
    model = make(tmp_path)
    run_dir = tmp_path / "run"
    code, line = refused(["--model.policy", str(model)], run_dir)
    assert code == 2 and named in line, line
    assert not run_dir.exists()


def _gsm8k(tmp_path, name, content: bytes):
    path = tmp_path / name
    path.write_bytes(content)
    return path


GOOD = b'{"question": "What is 1 + 1?", "answer": "1 + 1 = 2\\n#### 2"}\n'


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("missing.jsonl", None, "does not exist"),
        ("missing.csv", None, "does not exist"),
        ("data.csv", b"question,answer\nq,#### 1\n", "unknown kind"),
        ("data.txt", GOOD, "unknown kind"),
        ("corrupt.jsonl", b"\xff\xfe\x00{{{ not json", "cannot read"),
        ("fields.jsonl", b'{"q": "x", "a": "#### 1"}\n', "question"),
        ("nohash.jsonl", b'{"question": "x", "answer": "1"}\n', "####"),
        ("list.json", b"[1, 2, 3]", "cannot read"),
    ],
)
def test_task_data_is_checked_before_anything_starts(name, content, words, tmp_path, folder_model, refused):
    path = tmp_path / name if content is None else _gsm8k(tmp_path, name, content)
    good = _gsm8k(tmp_path, "good.jsonl", GOOD)
    run_dir = tmp_path / "run"
    for option, other in (("--env.options.train", "--env.options.test"), ("--env.options.test", "--env.options.train")):
        code, line = refused(["--model.policy", str(folder_model), "--env.id", "math:gsm8k",
                              option, str(path), other, str(good)], run_dir)  # fmt: skip
        assert code == 2 and option in line and words in line, line
        assert not run_dir.exists()


def test_subprocess_refusal_is_one_line(tmp_path, folder_model):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "orchestrate.rl", "--run-dir", str(tmp_path / "run"),
                          "--model.policy", str(folder_model), "--train.lr", "Infinity"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--train.lr" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()


def test_offline_is_strict_too(tmp_path, capsys):
    from orchestrate.after import offline

    tapes = tmp_path / "t.jsonl"
    tapes.write_text("")
    for argv, named in [
        (["--train.lr", "Infinity"], "--train.lr"),
        (["--train.epochs", "true"], "--train.epochs"),
        (["--train.lr", "1e-5", "--train.lr", "2e-5"], "--train.lr"),
        (["--filt", "all"], "--filt"),
    ]:
        with pytest.raises(SystemExit) as exc:
            offline.main(["--tapes", str(tapes), "--out", str(tmp_path / "out"), "--model", "x/y", *argv])
        assert exc.value.code == 2
        assert named in capsys.readouterr().err.strip().splitlines()[-1]


def test_config_json_never_holds_infinity():
    from orchestrate.loop.command_line import resolve
    from orchestrate.loop.config_checks import ConfigError

    with pytest.raises(ConfigError, match="finite"):
        resolve("embedded", {"train.adam_eps": "Infinity"})
    assert json.dumps(resolve("embedded", {}).model_dump(mode="json"), allow_nan=False)


def test_an_environment_that_cannot_start_is_refused_before_the_run(tmp_path, folder_model, refused):
    """One-digit addition has about 10 held-out problems: evaluating 500 of them is refused up front, naming
    the environment, and nothing is written."""
    run_dir = tmp_path / "run"
    code, line = refused(["--model.policy", str(folder_model), "--env.options.digits", "1",
                          "--eval.tasks", "500"], run_dir)  # fmt: skip
    assert code == 2 and "--env.id math:arithmetic" in line and "--eval.tasks" in line, line
    assert not run_dir.exists()
