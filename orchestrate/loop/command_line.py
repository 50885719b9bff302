"""The RL command line: presets, dotted overrides, `--help`, and bad input refused with exit status 2.

    uv run -m orchestrate.rl                                   # preset "embedded"
    uv run -m orchestrate.rl --preset gsm8k --rollouts.attempts 8 --train.lr 2e-6

A preset is a TOML file in orchestrate/loop/presets/ that sets some fields of RLConfig
(orchestrate/loop/config.py); every option can then be overridden on the command line by its dotted name. A bad
value is refused with one line naming the option (exit status 2) before anything is loaded.

`--help` lists the common options (COMMON), `--help-all` every one, each with its meaning and the value a run
takes when it is not given: the named preset's (`--preset X --help`), else the embedded one's. docs/config.md's
table of options is generated from the same parser (orchestrate/loop/config_doc.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from contract.cli import (
    DEST,
    StrictParser,
    check_bools,
    error_line,
    given,
    leaves,
    nest,
    none_as_null,
    parse_value,
    refuse_repeated,
    type_name,
)
from orchestrate.loop.config import SET_BY_LOOP, RLConfig, RolloutSection
from orchestrate.loop.config_checks import ConfigError, check_config
from orchestrate.loop.resume import saved_run_base

PRESETS_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "embedded"  # with no --preset and no run of its own to resume

# What `--help` shows (`--help-all`: every option), in the order of use: what a first run or a new task is likely
# to change. The command's own options (--preset, --run-dir, --iterations, --print-config) are always shown.
COMMON = (
    "model.policy",
    "env.id",
    "env.options",
    "env.tools",
    "agent.program",
    "agent.max_turns",
    "rollouts.tasks_per_iteration",
    "rollouts.attempts",
    "rollouts.temperature",
    "rollouts.max_tokens",
    "eval.every",
    "eval.tasks",
    "server.gpus",
    "server.max_model_len",
    "server.policy_urls",
    "train.algorithm",
    "train.lr",
    "train.kl_coef",
    "train.lora.rank",
    "trainer.gpus",
    "teacher.model",
    "run.max_minutes",
    "run.seed",
    "run.async_level",
)


# -- presets ----------------------------------------------------------------------------------------


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def load_preset(name: str) -> dict[str, Any]:
    path = PRESETS_DIR / f"{name}.toml"
    if name not in presets() or not path.is_file():  # a name, never a path outside presets/
        raise ConfigError(f"--preset: unknown preset {name!r} (known: {', '.join(presets())})")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"--preset {name}: {path} is not a valid TOML preset ({exc}); fix or restore it") from None


# -- preset + overrides -> a config -----------------------------------------------------------------


def options(model: type[BaseModel] = RLConfig, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted name, field info, annotation) of every leaf option of orchestrate.rl (RLConfig's fields but the
    learner's that the loop sets itself, SET_BY_LOOP)."""
    return [(dotted, field, field.annotation) for dotted, field in leaves(model, prefix) if dotted not in SET_BY_LOOP]


def resolve(preset: str, overrides: dict[str, str]) -> RLConfig:
    """Preset + dotted overrides -> a validated config, or ConfigError naming the option."""
    return resolve_from(load_preset(preset), overrides, f"preset {preset!r}")


def resolve_from(data: dict[str, Any], overrides: dict[str, str], whole: str) -> RLConfig:
    """A config's data (a preset's, or a saved run's) + dotted overrides -> a validated config, or ConfigError
    naming the option; `whole` names the data in messages (preset 'embedded', RUN/config.json)."""
    config = _validated(data, overrides, whole)
    check_config(config)
    return config


def preset_values(preset: str) -> dict[str, Any]:
    """The values a run of `preset` takes for the options it is not given, as --help shows them: its config
    before the checks across options, which change nothing (and would load torch to count this machine's GPUs)."""
    return _validated(load_preset(preset), {}, f"preset {preset!r}").model_dump(mode="json")


def _validated(data: dict[str, Any], overrides: dict[str, str], whole: str) -> RLConfig:
    data = json.loads(json.dumps(data))  # the caller's copy stays as it was
    env = data.setdefault("env", {}) if isinstance(data.get("env", {}), dict) else data["env"]
    if isinstance(env, dict) and "env.id" in overrides and overrides["env.id"] != env.get("id"):
        env["options"] = {}  # another environment: the options were for its own
    values = {dotted: parse_value(text) for dotted, text in overrides.items()}
    for dotted in values:
        if dotted in SET_BY_LOOP:
            raise ConfigError(set_by_loop(dotted))
    check_bools(values, RLConfig)
    try:
        nest(values, data)
    except ConfigError as exc:
        dotted = str(exc).split(":")[0]
        raise ConfigError(f"{dotted}: {whole} does not hold a section there; fix it") from None
    with_rollouts_of_algorithm(data)
    try:
        config = RLConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_environment_line(exc) or error_line(exc, whole=whole)) from None
    for dotted in SET_BY_LOOP:
        section, name = dotted.split(".")
        if getattr(getattr(config, section), name) != type(getattr(config, section)).model_fields[name].default:
            raise ConfigError(f"{set_by_loop(dotted)}; {whole} sets it")
    return config


def set_by_loop(dotted: str) -> str:
    """Why a learner's field the loop sets is not an option here (one line, naming what to give instead)."""
    return f"--{dotted}: not an option of orchestrate.rl: the loop sets it from {SET_BY_LOOP[dotted]}; give that"


def with_rollouts_of_algorithm(data: dict) -> None:
    """What the chosen algorithm (finetune.algorithms) sets beyond the learner, where not given: rollouts
    options (DAPO's dynamic sampling) and its overlong buffer as a fraction of rollouts.max_tokens (in place,
    before validation; the learner's own options are set by TrainConfig)."""
    from finetune.algorithms import ALGORITHMS

    train, rollouts = data.get("train", {}), data.setdefault("rollouts", {})
    if not isinstance(train, dict) or not isinstance(rollouts, dict):
        return
    algorithm = ALGORITHMS.get(train.get("algorithm", "grpo"))
    if algorithm is None:
        return  # refused by validation, naming the algorithms
    for name, value in algorithm.rollouts.items():
        rollouts.setdefault(name, value)
    if algorithm.overlong_fraction and "overlong_buffer" not in train:
        limit = rollouts.get("max_tokens", RolloutSection.model_fields["max_tokens"].default)
        if isinstance(limit, int):
            train["overlong_buffer"] = round(limit * algorithm.overlong_fraction)


def _environment_line(exc: ValidationError) -> str | None:
    """The environment's own check of its id and options (EnvSection's validator), as `--env.options.x: ...`."""
    err = exc.errors()[0]
    msg = err["msg"].removeprefix("Value error, ")
    if tuple(err["loc"]) != ("env",) or not msg.startswith(("id: ", "options.", "options: ")):
        return None
    field, _, msg = msg.partition(": ")
    return f"--env.{field}: {msg}"


ENV_OPTION = "--env.options."


def split_env_options(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Take `--env.options.NAME VALUE` (or `--env.options.NAME=VALUE`) out of argv: each environment has
    its own options, which argparse cannot know in advance."""
    rest, found = [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(ENV_OPTION):
            name, eq, value = arg[len(ENV_OPTION) :].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{arg}: expected a value")
                value = argv[i + 1]
                i += 1
            if not name:
                raise ConfigError(f"{arg}: name the option, e.g. --env.options.digits 3")
            found[name] = value
        else:
            rest.append(arg)
        i += 1
    return rest, found


# -- the parser and its --help ---------------------------------------------------------------------


def shown(value: Any) -> str:
    """A value as the command line takes it, for --help: text as it is, `none`, JSON for the rest."""
    if value is None:
        return "none"
    return value if isinstance(value, str) and value else json.dumps(value)


def value_at(data: dict, dotted: str) -> Any:
    for key in dotted.split("."):
        data = data[key]
    return data


def build_parser(values: dict[str, Any] | None = None, full: bool = True, preset: str = DEFAULT_PRESET):
    """orchestrate.rl's parser. values: a resolved config's dump (`preset`'s), whose values --help shows as each
    option's default (None: none shown); full: every option in --help (else the COMMON ones, the others taken
    but not listed)."""
    count = len(options())
    about = ("Train an LLM agent with RL on tapes: vLLM rollouts, rewards, reference log-probs, GRPO/REINFORCE in "
             "a separate finetune process. Options override the preset.")  # fmt: skip
    if values is not None:
        about += (f" The defaults shown are the {preset} preset's (`--preset NAME --help`: another's; an existing "
                  "--run-dir with no --preset resumes with its own settings).")  # fmt: skip
    parser = StrictParser(
        prog="uv run -m orchestrate.rl",
        usage="%(prog)s [--preset NAME] [--run-dir DIR] [--iterations N] [--SECTION.OPTION VALUE ...]",
        description=textwrap.fill(about, 100),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=("" if full else f"These are the common options; --help-all lists all {count}.\n")
        + "Values are parsed as JSON where they can be (numbers, true/false, null, lists), else taken as text;\n"
        "`none` is no value.",
        add_help=False,
        listing="--help lists the options, --help-all all of them",
    )
    parser.add_argument("-h", "--help", action="help", help="show the common options and exit")
    parser.add_argument("--help-all", action="help", help="show every option and exit")
    parser.add_argument("--preset", metavar="NAME", default=None, help=f"config preset, one of: "
                        f"{', '.join(presets())} (default: {DEFAULT_PRESET}; an existing run without it: the run's "
                        "own settings)")  # fmt: skip
    parser.add_argument(
        "--run-dir",
        metavar="DIR",
        default=None,
        help="run directory; an existing one is resumed (default: runs/PRESET)",
    )
    parser.add_argument("--iterations", metavar="N", type=int, default=None, help="same as --run.iterations")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    groups = {section: parser.add_argument_group(section) for section in RLConfig.model_fields}
    for dotted, field, annotation in options():
        text = field.description or ""
        if values is not None:
            text += f" (default: {shown(value_at(values, dotted))})"
        kwargs: dict[str, Any] = {"dest": DEST + dotted, "default": argparse.SUPPRESS, "metavar": type_name(annotation)}
        kwargs["help"] = text.replace("%", "%%") if full or dotted in COMMON else argparse.SUPPRESS
        if kwargs["metavar"].endswith("|none"):
            kwargs["type"] = none_as_null  # the `none` its --help names
        groups[dotted.split(".")[0]].add_argument(f"--{dotted}", **kwargs)
    return parser


def _help_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser whose --help shows the defaults of the preset named in argv (or the embedded one's); every
    option when --help-all is asked for. A bad preset: exit 2, naming it."""
    pre = StrictParser(add_help=False)
    pre.add_argument("--preset", default=None)
    preset = pre.parse_known_args(argv)[0].preset or DEFAULT_PRESET
    try:
        values = preset_values(preset)
    except ConfigError as exc:
        pre.exit(2, f"error: {exc}\n")
    return build_parser(values, full="--help-all" in argv, preset=preset)


def parse_args(argv: list[str] | None = None, resume: bool = True) -> tuple[argparse.Namespace, RLConfig]:
    """The rl options -> (arguments, config); exits 2 naming a bad option. The base is an existing run's saved
    settings unless a preset is named or another algorithm is given (or not `resume`: the preset's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours = argv[: argv.index("--")] if "--" in argv else argv
    asked = any(arg in ("-h", "--help", "--help-all") for arg in ours)
    parser = _help_parser(argv) if asked else build_parser(full=False)
    try:
        refuse_repeated(argv, {"--iterations": "--run.iterations"})
        argv, env_options = split_env_options(argv)
        for arg in ours:
            if arg.startswith("--") and arg[2:].split("=")[0] in SET_BY_LOOP:
                raise ConfigError(set_by_loop(arg[2:].split("=")[0]))
    except ConfigError as exc:
        parser.exit(2, f"error: {exc}\n")
    args = parser.parse_args(argv)  # unknown options: argparse names them and exits 2
    overrides = given(args)
    for name, value in env_options.items():
        overrides[f"env.options.{name}"] = value
    if args.iterations is not None:
        overrides["run.iterations"] = str(args.iterations)
    # an existing run resumes from its own settings unless a preset is named: the options given change them
    # (the resume check refuses those that may not change); a new run starts from the preset
    preset_given, args.preset = args.preset is not None, args.preset or DEFAULT_PRESET
    run_dir = Path(args.run_dir or Path("runs") / args.preset)
    base = None if preset_given or not resume else saved_run_base(run_dir)
    if base is not None and "train.algorithm" in overrides:
        # another algorithm sets other defaults (its loss, estimator, sampling): the preset's, as when named
        if parse_value(overrides["train.algorithm"]) != base["train"]["algorithm"]:
            base = None
    try:
        if base is not None:
            config = resolve_from(base, overrides, str(run_dir / "config.json"))
        else:
            config = resolve(args.preset, overrides)
    except ConfigError as exc:
        parser.exit(2, f"error: {exc}\n")
    return args, config
