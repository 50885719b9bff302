"""Checks of the command line and of the resolved config that field types alone do not make.

Each refuses with a ConfigError whose message is one line starting with the
option (`--rollouts.attempts: ...`), before anything is loaded or written:

- the command line taken literally (finetune.cli: no abbreviations, no option
  given twice, `true`/`false` only for booleans, no Infinity / NaN anywhere);
- sizes within reason (LIMITS), and max_tokens within server.max_model_len;
- settings the learner cannot train with: one attempt per task under a group
  baseline (every advantage 0), top_p < 1 on training rollouts (the trainer
  recomputes log-probs of the whole distribution).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from finetune.cli import OptionError, check_finite

# A bad preset, option or value; the message is one line naming it. The same class as the command-line
# checks of finetune.cli raise (no abbreviations, no option twice, numbers that are numbers), so a caller
# catches one.
ConfigError = OptionError

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
    "trainer.num_processes": 4096,
    "trainer.num_machines": 4096,
    "train.epochs": 10_000,
    "train.steps_per_epoch": 1_000_000,
    "train.token_budget": 1 << 24,
}
TAPES_PER_ITERATION_LIMIT = 1 << 20  # tasks_per_iteration x attempts


def _get(config, dotted: str) -> Any:
    value = config
    for key in dotted.split("."):
        value = getattr(value, key, None)
    return value


def check_placement(config) -> None:
    """--server.cpus and --trainer.cpus name cores this process may use, and do not share any."""
    from orchestrate.processes import format_cpus, parse_cpus

    ours = os.sched_getaffinity(0)
    chosen = {}
    for dotted in ("server.cpus", "trainer.cpus"):
        text = _get(config, dotted)
        if text is None:
            continue
        cores = set(parse_cpus(text))
        missing = cores - ours
        if missing:
            raise ConfigError(
                f"--{dotted}: core(s) {format_cpus(missing)} are not among this machine's (or this "
                f"process's) cores {format_cpus(ours)}"
            )
        chosen[dotted] = cores
    if len(chosen) == 2 and chosen["server.cpus"] & chosen["trainer.cpus"]:
        shared = format_cpus(chosen["server.cpus"] & chosen["trainer.cpus"])
        raise ConfigError(
            f"--trainer.cpus: core(s) {shared} are also in --server.cpus; give the servers and the trainer "
            "disjoint cores (as separate accelerators), or leave one out"
        )


def check_config(config) -> None:
    """Cross-field checks and limits of a validated RLConfig."""
    check_finite(config.model_dump(mode="python"))
    for dotted, limit in LIMITS.items():
        value = _get(config, dotted)
        if isinstance(value, int) and value > limit:
            raise ConfigError(f"--{dotted}: {value} is more than the limit {limit}")
    r, s = config.rollouts, config.server
    if r.tasks_per_iteration * r.attempts > TAPES_PER_ITERATION_LIMIT:
        raise ConfigError(f"--rollouts.attempts: {r.tasks_per_iteration} tasks x {r.attempts} attempts = "
                          f"{r.tasks_per_iteration * r.attempts} tapes per iteration, more than the limit "
                          f"{TAPES_PER_ITERATION_LIMIT}")  # fmt: skip
    for dotted, value in (("rollouts.max_tokens", r.max_tokens), ("eval.max_tokens", config.eval.max_tokens)):
        if value >= s.max_model_len:
            raise ConfigError(f"--{dotted}: {value} new tokens do not fit in --server.max_model_len {s.max_model_len} "
                              "(prompt + completion); lower it or raise server.max_model_len")  # fmt: skip
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if s.kv_cache_gib > memory_gib:
        raise ConfigError(f"--server.kv_cache_gib: {s.kv_cache_gib} GiB is more than this machine's memory "
                          f"({memory_gib:.0f} GiB)")  # fmt: skip
    if config.train.baseline == "group" and not config.train.loss.critic and r.attempts < 2:
        raise ConfigError(f"--rollouts.attempts: {r.attempts} attempt per task leaves every group of one, so every "
                          f"group-baseline advantage ({config.train.algorithm}, train.baseline group) is 0 and nothing "
                          "is learned; use 2 or more (or --train.baseline none)")  # fmt: skip
    if r.top_p < 1:
        raise ConfigError(f"--rollouts.top_p: {r.top_p} is refused for training rollouts: the trainer computes log-probs "
                     "of the whole distribution (top_p = 1), so tokens sampled from a truncated one would get wrong "
                     "importance ratios and KL; leave it at 1")  # fmt: skip
    check_placement(config)
    lag, level = config.train.max_lag, config.run.async_level
    if lag is not None and lag < level:
        raise ConfigError(f"--train.max_lag: {lag} is below --run.async_level {level}, so batches generated "
                     f"{lag + 1}..{level} versions back would be thrown away; leave it out (it follows "
                     "run.async_level) or raise it")  # fmt: skip
    if "search" in config.env.tools and not config.env.search.corpus:
        raise ConfigError("--env.search.corpus: --env.tools search needs a corpus: a JSON lines file, one passage per "
                          "line with 'text' (and optional 'title', 'id')")  # fmt: skip
    t = config.trainer
    if t.num_machines > 1 and t.launch == "local":
        raise ConfigError(f"--trainer.num_machines: {t.num_machines} machines need --trainer.launch external (the "
                          "orchestrator starts a trainer on this machine only); see docs/multi-node.md")  # fmt: skip
    if t.num_machines > 1 and not t.main_process_ip:
        raise ConfigError(f"--trainer.main_process_ip: {t.num_machines} trainer machines need the address of "
                          "machine 0, which the others connect to")  # fmt: skip
    if t.launch == "external" and t.cpus:
        raise ConfigError("--trainer.cpus: cores of a trainer this orchestrator starts; with --trainer.launch "
                          "external the trainer runs elsewhere: leave it out")  # fmt: skip
    if t.num_processes % t.num_machines:
        raise ConfigError(f"--trainer.num_processes: {t.num_processes} processes cannot be spread evenly over "
                          f"--trainer.num_machines {t.num_machines}; give a multiple of it")  # fmt: skip
    accelerate = config.trainer.accelerate_config
    if accelerate and not Path(accelerate).expanduser().is_file():
        raise ConfigError(f"--trainer.accelerate_config: {accelerate} does not exist; give an accelerate config file "
                          "(see finetune/accelerate/) or leave it out for the default")  # fmt: skip
