"""Checks of the command line and of the resolved config that field types alone do not make.

Each refuses with a ConfigError whose message is one line starting with the
option (`--rollouts.attempts: ...`), before anything is loaded or written:

- a command line taken literally: no abbreviations (the parsers set
  `allow_abbrev=False`), no option given twice (`--iterations` and
  `--run.iterations` are one option), `true`/`false` only for booleans;
- numbers that are numbers: no Infinity / NaN anywhere in the config;
- sizes within reason (LIMITS), and max_tokens within server.max_model_len;
- settings the learner cannot train with: one attempt per task under a group
  baseline (every advantage 0), top_p < 1 on training rollouts (the trainer
  recomputes log-probs of the whole distribution).
"""

from __future__ import annotations

import math
import os
import types
import typing
from pathlib import Path
from typing import Any

# Upper bounds of sizes: past them a run cannot work on any machine we know (or hangs while
# it allocates), so a typo such as `--rollouts.attempts 1e9` is refused up front.
LIMITS: dict[str, int] = {
    "rollouts.attempts": 4096,
    "rollouts.tasks_per_iteration": 65536,
    "rollouts.max_concurrency": 65536,
    "rollouts.max_tokens": 1 << 20,
    "eval.tasks": 1_000_000,
    "eval.max_tokens": 1 << 20,
    "run.iterations": 1_000_000,
    "run.keep_checkpoints": 10_000,
    "run.async_level": 1000,
    "server.max_model_len": 1 << 20,
    "server.policy_servers": 256,
    "server.max_restarts": 1000,
    "train.num_processes": 4096,
    "train.epochs": 10_000,
    "train.steps_per_epoch": 1_000_000,
    "train.token_budget": 1 << 24,
}
TAPES_PER_ITERATION_LIMIT = 1 << 20  # tasks_per_iteration x attempts


def _error(message: str):
    from orchestrate.config import ConfigError

    return ConfigError(message)


# -- the command line -------------------------------------------------------------


def refuse_repeated_options(argv: list[str], aliases: dict[str, str] | None = None) -> None:
    """An option given twice (`--x 1 --x 2`, or an alias and its name) is refused, not silently the last."""
    aliases = aliases or {}
    seen: dict[str, str] = {}
    for arg in argv:
        if arg == "--":
            break
        if not arg.startswith("--") or len(arg) < 3:
            continue
        given = arg.split("=", 1)[0]
        name = aliases.get(given, given)
        if name in seen:
            both = given if seen[name] == given else f"{seen[name]} and {given}"
            raise _error(f"{given}: given twice ({both}); give each option once")
        seen[name] = given


def _base_types(annotation: Any) -> set[type]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return {t for a in typing.get_args(annotation) for t in _base_types(a)}
    return {annotation} if isinstance(annotation, type) else set()


def check_override_types(values: dict[str, Any], annotations: dict[str, Any]) -> None:
    """`true` / `false` for a number is refused (pydantic would take it as 1 / 0)."""
    for dotted, value in values.items():
        kinds = _base_types(annotations.get(dotted))
        if isinstance(value, bool) and bool not in kinds and kinds & {int, float}:
            raise _error(f"--{dotted}: expected a number, got {str(value).lower()}")


# -- the resolved config -------------------------------------------------------------


def _non_finite(value: Any, path: str = "") -> str | None:
    """Dotted path of the first Infinity / NaN in a dumped config."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    if isinstance(value, dict):
        for key, item in value.items():
            if found := _non_finite(item, f"{path}.{key}" if path else str(key)):
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            if found := _non_finite(item, f"{path}[{i}]"):
                return found
    return None


def check_finite(data: dict, prefix: str = "") -> None:
    if (where := _non_finite(data)) is not None:
        value = data
        for key in where.replace("[", ".").replace("]", "").split("."):
            value = value[int(key)] if isinstance(value, list) else value[key]
        raise _error(f"--{prefix}{where}: must be a finite number (got {value})")


def _get(config, dotted: str) -> Any:
    value = config
    for key in dotted.split("."):
        value = getattr(value, key, None)
    return value


def check_placement(config) -> None:
    """--server.cpus and --train.cpus name cores this process may use, and do not share any."""
    from orchestrate.processes import format_cpus, parse_cpus

    ours = os.sched_getaffinity(0)
    chosen = {}
    for dotted in ("server.cpus", "train.cpus"):
        text = _get(config, dotted)
        if text is None:
            continue
        cores = set(parse_cpus(text))
        missing = cores - ours
        if missing:
            raise _error(
                f"--{dotted}: core(s) {format_cpus(missing)} are not among this machine's (or this "
                f"process's) cores {format_cpus(ours)}"
            )
        chosen[dotted] = cores
    if len(chosen) == 2 and chosen["server.cpus"] & chosen["train.cpus"]:
        shared = format_cpus(chosen["server.cpus"] & chosen["train.cpus"])
        raise _error(
            f"--train.cpus: core(s) {shared} are also in --server.cpus; give the servers and the trainer "
            "disjoint cores (as separate accelerators), or leave one out"
        )


def check_config(config) -> None:
    """Cross-field checks and limits of a validated RLConfig."""
    check_finite(config.model_dump(mode="python"))
    for dotted, limit in LIMITS.items():
        value = _get(config, dotted)
        if isinstance(value, int) and value > limit:
            raise _error(f"--{dotted}: {value} is more than the limit {limit}")
    r, s = config.rollouts, config.server
    if r.tasks_per_iteration * r.attempts > TAPES_PER_ITERATION_LIMIT:
        raise _error(f"--rollouts.attempts: {r.tasks_per_iteration} tasks x {r.attempts} attempts = "
                     f"{r.tasks_per_iteration * r.attempts} tapes per iteration, more than the limit "
                     f"{TAPES_PER_ITERATION_LIMIT}")  # fmt: skip
    for dotted, value in (("rollouts.max_tokens", r.max_tokens), ("eval.max_tokens", config.eval.max_tokens)):
        if value >= s.max_model_len:
            raise _error(f"--{dotted}: {value} new tokens do not fit in --server.max_model_len {s.max_model_len} "
                         "(prompt + completion); lower it or raise server.max_model_len")  # fmt: skip
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if s.kv_cache_gib > memory_gib:
        raise _error(f"--server.kv_cache_gib: {s.kv_cache_gib} GiB is more than this machine's memory "
                     f"({memory_gib:.0f} GiB)")  # fmt: skip
    if config.train.baseline == "group" and not config.train.loss.critic and r.attempts < 2:
        raise _error(f"--rollouts.attempts: {r.attempts} attempt per task leaves every group of one, so every "
                     f"group-baseline advantage ({config.train.algorithm}, train.baseline group) is 0 and nothing "
                     "is learned; use 2 or more (or --train.baseline none)")  # fmt: skip
    if r.top_p < 1:
        raise _error(f"--rollouts.top_p: {r.top_p} is refused for training rollouts: the trainer computes log-probs "
                     "of the whole distribution (top_p = 1), so tokens sampled from a truncated one would get wrong "
                     "importance ratios and KL; leave it at 1")  # fmt: skip
    check_placement(config)
    lag, level = config.train.max_lag, config.run.async_level
    if lag is not None and lag < level:
        raise _error(f"--train.max_lag: {lag} is below --run.async_level {level}, so batches generated "
                     f"{lag + 1}..{level} versions back would be thrown away; leave it out (it follows "
                     "run.async_level) or raise it")  # fmt: skip
    if "search" in config.env.tools and not config.env.search.corpus:
        raise _error("--env.search.corpus: --env.tools search needs a corpus: a JSON lines file, one passage per "
                     "line with 'text' (and optional 'title', 'id')")  # fmt: skip
    accelerate = config.train.accelerate_config
    if accelerate and not Path(accelerate).expanduser().is_file():
        raise _error(f"--train.accelerate_config: {accelerate} does not exist; give an accelerate config file "
                     "(see finetune/accelerate/) or leave it out for the default")  # fmt: skip
