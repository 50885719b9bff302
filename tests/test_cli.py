"""contract.cli: the one generator of argparse options from a config model, and the one error line."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field, ValidationError

from contract.cli import (
    OptionError,
    StrictParser,
    add_options,
    check_bools,
    check_finite,
    error_line,
    given,
    nest,  # fmt: skip
    parse_value,
    refuse_repeated,
)


class Inner(BaseModel):
    clip_eps: float = Field(0.2, gt=0, description="clip range")


class Outer(BaseModel):
    lr: float = Field(1e-6, gt=0, description="learning rate, 100% of it")
    steps: int | None = Field(None, description="steps")
    flag: bool = Field(False, description="a switch")
    mode: Literal["a", "b"] = Field("a", description="a mode")
    inner: Inner = Field(default_factory=Inner, description="a section")


def parse(argv, **kwargs):
    parser = StrictParser(prog="t")
    add_options(parser, Outer, "x.", **kwargs)
    return parser, given(parser.parse_args(argv))


def test_dotted_options_take_text_and_show_defaults():
    parser, values = parse(["--x.lr", "3e-4", "--x.inner.clip_eps", "0.3", "--x.flag", "true"])
    assert values == {"x.lr": "3e-4", "x.inner.clip_eps": "0.3", "x.flag": "true"}
    data = nest({k.removeprefix("x."): parse_value(v) for k, v in values.items()})
    assert Outer.model_validate(data) == Outer(lr=3e-4, flag=True, inner=Inner(clip_eps=0.3))
    text = parser.format_help()
    assert "--x.steps INT|none" in text and "{a,b}" in text and "100% of it (default: 1e-06)" in text


def test_dashed_options_are_flags_and_choices():
    parser = StrictParser(prog="t")
    add_options(parser, Outer, dash=True, nested=False)
    values = given(parser.parse_args(["--no-flag", "--mode", "b", "--lr", "1"]))
    assert values == {"flag": False, "mode": "b", "lr": "1"}
    assert "--inner.clip-eps" not in parser.format_help()  # nested=False: the caller adds sections
    assert "100% of it [default: 1e-06]" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "c"])


def test_only_and_note():
    parser = StrictParser(prog="t")
    add_options(parser, Outer, "x.", only=("lr",), note="ref: ", defaults=False)
    text = parser.format_help()
    assert "--x.lr" in text and "--x.steps" not in text and "ref: learning rate" in text and "default" not in text


def test_no_abbreviations_and_no_option_twice(capsys):
    with pytest.raises(SystemExit):
        parse(["--x.l", "1"])  # not --x.lr
    with pytest.raises(OptionError, match=r"^--x.lr: given twice"):
        refuse_repeated(["--x.lr", "1", "--x.lr=2"])
    with pytest.raises(OptionError, match=r"^--iterations: given twice \(--run.iterations and --iterations\)"):
        refuse_repeated(["--run.iterations", "1", "--iterations", "2"], {"--iterations": "--run.iterations"})
    refuse_repeated(["--x.lr", "1", "--", "--x.lr"])  # after `--` nothing is an option


def test_numbers_are_numbers():
    with pytest.raises(OptionError, match=r"^--x.lr: expected a number, got true"):
        check_bools({"x.lr": True}, Outer, "x.")
    check_bools({"x.flag": True, "x.lr": 1.0}, Outer, "x.")
    with pytest.raises(OptionError, match=r"^--x.inner.clip_eps: must be a finite number \(got inf\)"):
        check_finite(Outer(inner=Inner(clip_eps=float("inf"))).model_dump(), "x.")
    with pytest.raises(OptionError, match=r"^--x.lr: must be a finite number \(got nan\)"):
        check_finite({"lr": float("nan")}, "x.")
    with pytest.raises(OptionError, match=r"^--a\[1\]: must be a finite number"):
        check_finite({"a": [1.0, float("-inf")]})


def test_a_validation_error_is_one_line_naming_the_option():
    with pytest.raises(ValidationError) as exc:
        Outer.model_validate({"inner": {"clip_eps": -1}})
    assert error_line(exc.value, "train.") == "--train.inner.clip_eps: Input should be greater than 0 (got -1)"
    assert error_line(exc.value, spell=lambda d: d.replace("_", "-")) == (
        "--inner.clip-eps: Input should be greater than 0 (got -1)"
    )
    with pytest.raises(ValidationError) as exc:
        Outer.model_validate([])
    assert error_line(exc.value, whole="preset 'p'").startswith("preset 'p': ")


def test_nest_refuses_a_value_where_a_section_should_be():
    assert nest({"a.b": 1, "a.c": 2}, {"a": {"d": 0}}) == {"a": {"b": 1, "c": 2, "d": 0}}
    with pytest.raises(OptionError, match=r"^--a.b: "):
        nest({"a.b": 1}, {"a": 3})


def test_finetune_train_is_strict_too(capsys, tmp_path):
    from finetune import train

    for argv, named in [
        (["--lr", "inf"], "--lr"),
        (["--lr", "1e-5", "--lr", "2e-5"], "--lr"),
        (["--l", "1"], "--l"),
        (["--grpo.clip-eps-high", "-1"], "--grpo.clip-eps-high"),
    ]:
        with pytest.raises(SystemExit) as exc:
            train.parse_args(["--model", str(tmp_path), "--run-dir", str(tmp_path), "--print-config", *argv])
        assert exc.value.code == 2
        assert named in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_learners_options_are_the_loops_train_options(tmp_path, tiny_model_dir):
    """One TrainConfig, two spellings generated from it: every `--train.X` of orchestrate.rl is `--X` (dashed)
    of finetune.train and back, but for the fields the loop sets itself (the learner's only), and the same values
    give the same TrainConfig fields."""
    from finetune import command_line, train
    from orchestrate.loop.command_line import build_parser, resolve
    from orchestrate.loop.config import SET_BY_LOOP

    loop = {o.removeprefix("--train.") for a in build_parser()._actions for o in a.option_strings
            if o.startswith("--train.")}  # fmt: skip
    groups = [
        g for g in command_line.build_parser()._action_groups if g.title.startswith(("training", "LoRA", "options of"))
    ]
    learner = {o[2:].replace("-", "_") for g in groups for a in g._group_actions for o in a.option_strings}
    learner -= {name for name in learner if name.removeprefix("no_") != name and name[3:] in learner}  # --no-FLAG
    set_by_loop = {dotted.removeprefix("train.") for dotted in SET_BY_LOOP}
    assert len(loop) > 40 and not loop & set_by_loop and loop | set_by_loop == learner

    values = {"lr": "2e-6", "grpo.clip_eps_high": "0.3", "lora.rank": "4", "gamma": "0.8", "epochs": "3"}
    from_loop = resolve("embedded", {f"train.{k}": v for k, v in values.items()}).train
    argv = [x for k, v in values.items() for x in (f"--{k.replace('_', '-')}", v)]
    _, from_learner = train.parse_args(["--model", str(tiny_model_dir), "--run-dir", str(tmp_path), *argv])
    for key in values:
        section, _, field = key.rpartition(".")
        got = [getattr(getattr(c, section) if section else c, field) for c in (from_loop, from_learner)]
        assert got[0] == got[1] == type(got[0])(float(values[key])), key
