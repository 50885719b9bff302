"""The command line of a Pydantic config: one generator of argparse options, one line per bad value.

finetune.train, orchestrate.rl and orchestrate.after.offline build their options here from their config models,
so all three take the command line the same literal way:

- no abbreviations (StrictParser: `--iter 7` must not silently mean --iterations) and no option given twice
  (refuse_repeated: `--x 1 --x 2` is refused, not silently the last);
- numbers that are numbers: `true` / `false` for a number is refused (check_bools; pydantic would take 1 / 0),
  and so are NaN and Infinity anywhere (check_finite);
- a pydantic ValidationError becomes one line naming the option (error_line); the callers exit 2 with it.

Two spellings of the same options: dotted (orchestrate: `--train.lr`, `--train.ppo.vf_coef`; values are
text, parsed as JSON where they can be) and dashed (finetune.train: `--lr`, `--ppo.vf-coef`; booleans are
flags `--x / --no-x`, literals are choices).

Why not pydantic-settings' CLI (CliSettingsSource): measured with pydantic-settings 2.16.3 / pydantic 2.14.4,
it refuses abbreviations, but an option given twice is silently the last (`--rollouts.attempts 8
--rollouts.attempts 9` -> 9), `inf` is taken for a float field, and settings also come from environment
variables unless told otherwise. Keeping today's strictness would need this module's checks around it anyway.

This module is part of contract (which imports nothing of the rest of tapeloop), so finetune and orchestrate
both use it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

DEST = "opt:"  # argparse dest of a generated option: DEST + its dotted name


class OptionError(ValueError):
    """A bad option or value; the message is one line starting with the option (`--train.lr: ...`). Every
    command's refusals of its input derive from it (a model that cannot be had, a run that cannot start, ...):
    its `main` catches it once, says the line on stderr and exits 2."""


class StrictParser(argparse.ArgumentParser):
    """An ArgumentParser that never takes an abbreviation for a longer option, and says what is wrong in one
    line (argparse prints its whole usage first: 5 to 80 lines before the error). listing: where that line says
    the options are listed (orchestrate.rl's --help shows the common ones, --help-all all of them)."""

    def __init__(self, listing: str = "--help lists the options", **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(**kwargs)
        self.listing = listing

    def error(self, message: str):
        self.exit(2, f"error: {message} ({self.prog} {self.listing})\n")


# -- config model -> options ------------------------------------------------------------------


def is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def leaves(model: type[BaseModel], prefix: str = "", nested: bool = True) -> list[tuple[str, Any]]:
    """(dotted name, field info) of every option of `model`; nested sections are walked into, or left out."""
    out = []
    for name, field in model.model_fields.items():
        if not is_model(field.annotation):
            out.append((f"{prefix}{name}", field))
        elif nested:
            out += leaves(field.annotation, f"{prefix}{name}.")
    return out


def type_name(annotation: Any, none: str = "|none") -> str:
    """INT, FLOAT, {a,b}, INT|none, JSON: what an option takes, for --help."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(annotation)) + "}"
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0].__name__.upper() if not none else "|".join(type_name(a) for a in args) + none
    if origin in (list, dict):
        return "JSON"
    return getattr(annotation, "__name__", "VALUE").upper()


def default_of(field) -> Any:
    value = field.default_factory() if field.default_factory is not None else field.default
    return value.model_dump() if isinstance(value, BaseModel) else value


def dashed(dotted: str) -> str:
    return dotted.replace("_", "-")


def add_options(
    group,
    model: type[BaseModel],
    prefix: str = "",
    *,
    dash: bool = False,
    nested: bool = True,
    defaults: bool = True,
    only: typing.Collection[str] | None = None,
    note: str = "",
) -> None:
    """An option for each field of `model` (`--PREFIX.FIELD`), its --help from the field's description.

    dash: finetune's spelling (`--lr-schedule`, flags for booleans, choices for literals, `[default: x]`);
    else orchestrate's (`--train.lr_schedule`, text values, `(default: json)`). nested: walk into sections
    (else they are left out, for the caller to group). defaults: show the default in --help. only: these
    field names. note: put before each help text. Parsed values: given(args).
    """
    for dotted, field in leaves(model, prefix, nested):
        if only is not None and dotted.removeprefix(prefix) not in only:
            continue
        description = note + (field.description or "")
        kwargs: dict[str, Any] = {"dest": DEST + dotted, "default": argparse.SUPPRESS}
        if dash:
            default = f" [default: {default_of(field)}]" if defaults else ""
            kwargs["help"] = (description + default).replace("%", "%%")
            if field.annotation is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif typing.get_origin(field.annotation) is Literal:
                kwargs["choices"] = list(typing.get_args(field.annotation))
            else:
                kwargs["metavar"] = type_name(field.annotation, none="")
            group.add_argument("--" + dashed(dotted), **kwargs)
        else:
            default = default_of(field)
            default = f" (default: {default if isinstance(default, str) else json.dumps(default)})" if defaults else ""
            kwargs["help"] = (description + default).replace("%", "%%")
            kwargs["metavar"] = type_name(field.annotation)
            if kwargs["metavar"].endswith("|none"):
                kwargs["type"] = none_as_null  # the `none` its --help names
            group.add_argument(f"--{dotted}", **kwargs)


def none_as_null(text: str) -> str:
    """An optional option's value: `none` (as --help writes it, any case) is JSON's null, the rest as given."""
    return "null" if text.strip().lower() == "none" else text


def given(args: argparse.Namespace) -> dict[str, Any]:
    """{dotted name: value} of the generated options given on the command line."""
    return {k.removeprefix(DEST): v for k, v in vars(args).items() if k.startswith(DEST)}


def parse_value(text: Any) -> Any:
    """A command-line value as JSON where it is JSON (numbers, true/false, null, lists), else the text."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def nest(values: dict[str, Any], tree: dict[str, Any] | None = None) -> dict[str, Any]:
    """{"a.b": 1} -> {"a": {"b": 1}}, into `tree` (a preset, a config file) when given."""
    tree = {} if tree is None else tree
    for dotted, value in values.items():
        *parents, leaf = dotted.split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {}) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            raise OptionError(f"--{dotted}: the config holds a value where a section should be; fix it")
        node[leaf] = value
    return tree


# -- strictness ---------------------------------------------------------------------------------


def parse_span(text: str) -> tuple[int, int] | None:
    """N or A-B (whole numbers, B included) as (low, high), N as (N, N); None when it is neither. An empty range
    (high < low) is the caller's to refuse, in its option's words."""
    m = re.match(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$", text)
    return (int(m.group(1)), int(m.group(2) or m.group(1))) if m else None


def checked_span(text: str, option: str, what: str, error: type[OptionError] = OptionError) -> tuple[int, int]:
    """`text` as parse_span reads it, or refused in one line naming `option`: not `what`, or an empty range."""
    span = parse_span(text)
    if span is None:
        raise error(f"{option}: {text!r} is not {what}")
    if span[1] < span[0]:
        raise error(f"{option}: {text!r} is an empty range")
    return span


def refuse_repeated(argv: list[str], aliases: dict[str, str] | None = None) -> None:
    """An option given twice (`--x 1 --x 2`, or an alias and its name) is refused, not silently the last."""
    aliases = aliases or {}
    seen: dict[str, str] = {}
    for arg in argv:
        if arg == "--":
            break
        if not arg.startswith("--") or len(arg) < 3:
            continue
        given_as = arg.split("=", 1)[0]
        name = aliases.get(given_as, given_as)
        if name in seen:
            both = given_as if seen[name] == given_as else f"{seen[name]} and {given_as}"
            raise OptionError(f"{given_as}: given twice ({both}); give each option once")
        seen[name] = given_as


def _base_types(annotation: Any) -> set[type]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return {t for a in typing.get_args(annotation) for t in _base_types(a)}
    return {annotation} if isinstance(annotation, type) else set()


def check_bools(values: dict[str, Any], model: type[BaseModel], prefix: str = "") -> None:
    """`true` / `false` for a number is refused (pydantic would take it as 1 / 0). values: {dotted: value}."""
    annotations = {dotted: field.annotation for dotted, field in leaves(model, prefix)}
    for dotted, value in values.items():
        kinds = _base_types(annotations.get(dotted))
        if isinstance(value, bool) and bool not in kinds and kinds & {int, float}:
            raise OptionError(f"--{dotted}: expected a number, got {str(value).lower()}")


def _non_finite(value: Any, path: str = "") -> tuple[str, Any] | None:
    """(dotted path, value) of the first Infinity / NaN in a dumped config."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{path}[{key}]" if isinstance(value, list) else f"{path}.{key}" if path else str(key)
        if found := _non_finite(item, where):
            return found
    return None


def check_finite(data: dict, prefix: str = "", spell=lambda dotted: dotted) -> None:
    """No Infinity / NaN anywhere in a dumped config (`--train.lr inf` is a typo, not a learning rate)."""
    if (found := _non_finite(data)) is not None:
        raise OptionError(f"--{spell(prefix + found[0])}: must be a finite number (got {found[1]})")


def error_line(exc: ValidationError, prefix: str = "", whole: str = "options", spell=lambda dotted: dotted) -> str:
    """The first error of a ValidationError as one line: `--PREFIX.FIELD: what is wrong (got VALUE)`.

    whole: what to name when the error is of the whole model (no field); spell: dotted name -> option name.
    """
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    got = ""
    if where and err.get("input") is not None and not isinstance(err["input"], dict):
        got = f" (got {err['input']!r})"
    source = f"--{spell(prefix + where)}" if where else whole
    return f"{source}: {err['msg'].removeprefix('Value error, ')}{got}"
