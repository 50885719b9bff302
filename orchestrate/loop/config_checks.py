"""Checks of the command line and of the resolved config that field types alone do not make.

Each refuses with a ConfigError whose message is one line starting with the
option (`--rollouts.attempts: ...`), before anything is loaded or written:

- the command line taken literally (contract.cli: no abbreviations, no option
  given twice, `true`/`false` only for booleans, no Infinity / NaN anywhere);
- sizes within reason (LIMITS), and max_tokens within server.max_model_len;
- settings the learner cannot train with: one attempt per task under a group
  baseline (every advantage 0), top_p < 1 on training rollouts (the trainer
  recomputes log-probs of the whole distribution);
- dynamic sampling where an equal-return group is not zero-advantage: an
  estimator not registered `group_relative`, a critic's advantages (GAE), or
  one attempt per task (every group would be dropped).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from agents.agent import TRAINED_BINDINGS
from contract.cli import OptionError, check_finite
from contract.weight_paths import DEFAULT, select
from finetune.estimators import ESTIMATORS

# A bad preset, option or value; the message is one line naming it. The same class as the command-line
# checks of contract.cli raise (no abbreviations, no option twice, numbers that are numbers), so a caller
# catches one.
ConfigError = OptionError

# Upper bounds of sizes: past them a run cannot work on any machine we know (or hangs while
# it allocates), so a typo such as `--rollouts.attempts 1e9` is refused up front.
LIMITS: dict[str, int] = {
    "rollouts.attempts": 4096,
    "rollouts.tasks_per_iteration": 65536,
    "rollouts.max_concurrency": 65536,
    "rollouts.max_extra_tasks": 65536,
    "rollouts.max_tokens": 1 << 20,
    "tree.width": 256,
    "tree.points": 256,
    "tree.depth": 64,
    "eval.tasks": 1_000_000,
    "eval.samples": 1024,
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
    from orchestrate.serving.processes import format_cpus, parse_cpus

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


def visible_gpus() -> list[str]:
    """This process's GPUs as children must name them in CUDA_VISIBLE_DEVICES: index i of our options is
    visible_gpus()[i] (our own CUDA_VISIBLE_DEVICES, when set, renumbers them)."""
    try:
        import torch

        count = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable torch: no GPU
        count = 0
    ours = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return ours[:count] if ours else [str(i) for i in range(count)]


def gpu_slices(text: str | None, servers: int, per_server: int) -> list[list[str]]:
    """Each server's GPUs as CUDA_VISIBLE_DEVICES names them: `per_server` consecutive ones of `text`
    ('0-3'; checked by check_gpus), else of all visible GPUs."""
    from orchestrate.serving.processes import parse_cpus

    visible = visible_gpus()
    indices = parse_cpus(text) if text else list(range(servers * per_server))
    names = [visible[i] if i < len(visible) else str(i) for i in indices]
    return [names[i * per_server : (i + 1) * per_server] for i in range(servers)]


def servers_here(config) -> bool:
    """Whether a vLLM server starts on this machine: the policy servers unless given by URL, the reference server
    (when a KL term needs one) unless given by URL, the teacher's unless given by URL."""
    s = config.server
    by_url = s.policy_urls and (s.reference_url or not config.train.needs_reference)
    return not by_url or bool(config.teacher.model and not config.teacher.url) or bool(local_role_models(config))


def local_role_models(config) -> list[str]:
    """The models roles are bound to that are served here (agent.roles: a model, not a server's URL)."""
    from orchestrate.loop.policy import role_models

    return list(role_models(config).values())


def check_gpus(config, count: int | None = None) -> None:
    """--server.gpus, --server.reference_gpus and --trainer.gpus name visible GPUs, enough of them, and
    the trainer's are not the servers'; tensor/data parallelism needs GPUs. `count`: the visible GPUs (for
    tests; default: torch's count)."""
    from orchestrate.serving.processes import format_cpus, parse_cpus

    s, t = config.server, config.trainer
    given = {d: v for d, v in (("server.gpus", s.gpus), ("server.reference_gpus", s.reference_gpus),
                               ("trainer.gpus", t.gpus)) if v is not None}  # fmt: skip
    parallel = {d: v for d, v in (("server.tensor_parallel_size", s.tensor_parallel_size),
                                  ("server.data_parallel_size", s.data_parallel_size)) if v > 1}  # fmt: skip
    if not servers_here(config):
        parallel = {}  # no server runs here: parallelism is for `orchestrate.serve` on their machines
    if local_role_models(config) and colocated(config, count):
        raise ConfigError(f"--agent.roles: a role bound to a model ({local_role_models(config)[0]}) has a server of its "
                          "own, which --server.colocate does not time-share with the learner; serve it elsewhere "
                          "(`uv run -m orchestrate.serve`) and bind the role to its URL, or --server.colocate off")  # fmt: skip
    one_rank_per_gpu = select(s.weight_transfer).one_rank_per_gpu  # our servers and trainer meet on GPUs
    if one_rank_per_gpu and not s.policy_urls:
        parallel["server.weight_transfer"] = s.weight_transfer
    if not given and not parallel:
        return
    if s.policy_urls and "server.gpus" in given:
        raise ConfigError("--server.gpus: the policy servers are given by URL (--server.policy_urls); place them "
                          "on their machines (`uv run -m orchestrate.serve` takes the same option)")  # fmt: skip
    if s.reference_url and "server.reference_gpus" in given:
        raise ConfigError("--server.reference_gpus: the reference server is given by URL (--server.reference_url); "
                          "place it on its machine")  # fmt: skip
    count = len(visible_gpus()) if count is None else count
    if count == 0:
        dotted = next(iter({**given, **parallel}))
        raise ConfigError(f"--{dotted}: no GPU is visible here (torch.cuda.device_count() is 0); this option is "
                          "for GPUs, leave it out on CPU")  # fmt: skip
    per_server = s.tensor_parallel_size * s.data_parallel_size
    chosen = {}
    for dotted, text in given.items():
        devices = set(parse_cpus(text))
        missing = {d for d in devices if d >= count}
        if missing:
            raise ConfigError(f"--{dotted}: GPU(s) {format_cpus(missing)} are not visible here; the visible GPUs are "
                              f"{format_cpus(range(count))} (CUDA_VISIBLE_DEVICES renumbers them from 0)")  # fmt: skip
        chosen[dotted] = devices
    need = {"server.gpus": s.policy_servers * per_server, "server.reference_gpus": per_server}
    for dotted, n in need.items():
        if dotted in chosen and len(chosen[dotted]) != n:
            what = f"{s.policy_servers} server(s) x " if dotted == "server.gpus" else ""
            raise ConfigError(f"--{dotted}: {len(chosen[dotted])} GPU(s) given, {what}tensor_parallel_size "
                              f"{s.tensor_parallel_size} x data_parallel_size {s.data_parallel_size} = {n} needed")  # fmt: skip
    if "trainer.gpus" in chosen and len(chosen["trainer.gpus"]) < t.num_processes:
        raise ConfigError(f"--trainer.gpus: {len(chosen['trainer.gpus'])} GPU(s) for --trainer.num_processes "
                          f"{t.num_processes}; give one GPU per process")  # fmt: skip
    for server in ("server.gpus", "server.reference_gpus"):
        if colocated(config, count):
            break  # they time-share their GPUs (check_colocation said how they may)
        if server in chosen and "trainer.gpus" in chosen and chosen[server] & chosen["trainer.gpus"]:
            shared = format_cpus(chosen[server] & chosen["trainer.gpus"])
            raise ConfigError(f"--trainer.gpus: GPU(s) {shared} are also in --{server}; give the trainer and the "
                              "servers different GPUs, or leave one out, or let them time-share the policy servers' "
                              "GPUs (--server.colocate auto or on)")  # fmt: skip
    if one_rank_per_gpu and not s.policy_urls and t.launch == "local":
        # every policy server's workers and the learner's main process are ranks of one group (NCCL), which
        # refuses two ranks on one GPU ("Duplicate GPU detected"): where nothing places them, both use GPU 0
        servers = chosen.get("server.gpus", set(range(s.policy_servers * per_server)))
        trainer = chosen.get("trainer.gpus", set(range(t.num_processes)))
        if servers & trainer:
            where = ", ".join(f"--{d} {given[d]}" for d in ("server.gpus", "trainer.gpus") if d in given)
            raise ConfigError(f"--server.weight_transfer: {s.weight_transfer} needs the learner and the policy servers on different "
                              f"GPUs, and GPU(s) {format_cpus(servers & trainer)} would hold both "
                              f"({where or 'neither is placed'}): give --server.gpus and --trainer.gpus apart "
                              f"(e.g. --server.gpus 0 --trainer.gpus 1), or leave it at {DEFAULT}")  # fmt: skip
    if not s.policy_urls and "server.gpus" not in chosen and s.policy_servers * per_server > count:
        raise ConfigError(f"--server.policy_servers: {s.policy_servers} server(s) x {per_server} GPU(s) each do not "
                          f"fit on the {count} visible GPU(s)")  # fmt: skip


def placements(config) -> tuple[set[int], set[int]]:
    """The policy servers' GPUs and the learner's, as indices of the visible GPUs: given, or the defaults (one
    after the other from GPU 0 for the servers; one per learner process from GPU 0 for the learner)."""
    from orchestrate.serving.processes import parse_cpus

    s, t = config.server, config.trainer
    per_server = s.tensor_parallel_size * s.data_parallel_size
    servers = set(parse_cpus(s.gpus)) if s.gpus else set(range(s.policy_servers * per_server))
    learner = set(parse_cpus(t.gpus)) if t.gpus else set(range(t.num_processes))
    return servers, learner


def colocated(config, count: int | None = None) -> bool:
    """Whether the policy servers and the learner time-share GPUs (--server.colocate; auto: our servers and a
    learner started here on common GPUs). `count`: the visible GPUs (for tests; default: torch's count)."""
    s, t = config.server, config.trainer
    if s.colocate != "auto":
        return s.colocate == "on"
    if s.policy_urls or t.launch != "local" or not (len(visible_gpus()) if count is None else count):
        return False
    servers, learner = placements(config)
    return bool(servers & learner)


def apart(config, count: int | None = None) -> bool:
    """Whether the policy servers and the learner compute on separate hardware, so that work on one side does
    not slow the other: servers by URL or a learner launched elsewhere; on GPUs, not colocated; on CPU, the
    cores split by --server.cpus and --trainer.cpus (kept disjoint by check_placement). `count` as in colocated."""
    s, t = config.server, config.trainer
    if s.policy_urls or t.launch != "local":
        return True
    if len(visible_gpus()) if count is None else count:
        return not colocated(config, count)
    return bool(s.cpus and t.cpus)


def overlap_eval(config, count: int | None = None) -> bool:
    """Whether the loop plays an evaluation while the trainer trains the next batch (eval.overlap): at
    async_level 0 (above it, it does anyway), never colocated, and with auto only when the two sides compute
    apart."""
    if config.run.async_level or config.eval.overlap == "off" or colocated(config, count):
        return False
    return config.eval.overlap == "on" or apart(config, count)


def check_colocation(config, count: int | None = None) -> None:
    """Colocated servers sleep while the learner trains: what that rules out, each refused in one line."""
    from orchestrate.serving.processes import format_cpus

    s, t = config.server, config.trainer
    if not colocated(config, count):
        return
    why = "--server.colocate on" if s.colocate == "on" else "the servers and the learner share GPUs"
    if not (len(visible_gpus()) if count is None else count):
        raise ConfigError("--server.colocate: on time-shares GPUs and none is visible here; on CPU the servers "
                          "and the learner share cores (--server.cpus, --trainer.cpus): leave it at auto")  # fmt: skip
    if s.policy_urls or t.launch != "local":
        where = "--server.policy_urls" if s.policy_urls else "--trainer.launch external"
        raise ConfigError(f"--server.colocate: on needs the policy servers and the learner on this machine, and "
                          f"{where} puts them elsewhere; leave it at auto")  # fmt: skip
    if config.eval.overlap == "on":
        raise ConfigError(f"--eval.overlap: on plays evaluations while the learner trains, but colocated servers "
                          f"sleep then ({why}); leave it at auto")  # fmt: skip
    if config.run.async_level:
        raise ConfigError(f"--run.async_level: {config.run.async_level} generates while the learner trains, but "
                          f"colocated servers sleep then ({why}); set 0, or give the learner GPUs of its own "
                          "(--trainer.gpus) and --server.colocate off")  # fmt: skip
    if select(s.weight_transfer).one_rank_per_gpu:
        raise ConfigError(f"--server.weight_transfer: {s.weight_transfer} needs the learner and the policy servers on "
                          f"different GPUs, and they share them ({why}); leave it at {DEFAULT} or place them "
                          "apart (--server.gpus, --trainer.gpus, --server.colocate off)")  # fmt: skip
    servers, learner = placements(config)
    if servers != learner:
        raise ConfigError(f"--trainer.gpus: colocated ({why}), the learner runs one process on each of the policy "
                          f"servers' GPUs ({format_cpus(servers)}), and it is given {format_cpus(learner)}; give "
                          "both the same GPUs (--trainer.num_processes as many), or none in common")  # fmt: skip


def check_same_machine(config) -> None:
    """A weight path through this machine's memory (shm) needs the learner and the policy servers here."""
    s, t = config.server, config.trainer
    mechanism = select(s.weight_transfer, config.train.lora.rank)
    if mechanism.same_machine and (s.policy_urls or t.launch != "local"):
        where = (
            "--server.policy_urls puts the policy servers"
            if s.policy_urls
            else "--trainer.launch external puts the learner"
        )
        raise ConfigError(f"--server.weight_transfer: {mechanism.name} passes each version through this machine's "
                          f"shared memory, and {where} elsewhere; use {DEFAULT} (a shared file system) instead")  # fmt: skip


def check_dynamic_sampling(config) -> None:
    """Dynamic sampling drops groups whose attempts all earn the same return: only where such a group has
    advantage 0 (a group-relative estimator, no critic), and with groups of two or more."""
    r, train = config.rollouts, config.train
    if not r.dynamic_sampling:
        if r.max_extra_tasks is not None:
            raise ConfigError(f"--rollouts.max_extra_tasks: {r.max_extra_tasks} bounds the extra tasks of dynamic "
                              "sampling, which is off; add --rollouts.dynamic_sampling true or leave it out")  # fmt: skip
        return
    relative = [name for name, spec in ESTIMATORS.items() if spec.group_relative]
    if not ESTIMATORS[train.estimator].group_relative:
        raise ConfigError(f"--rollouts.dynamic_sampling: train.estimator {train.estimator} is not group-relative, so "
                          "a group whose attempts all earn the same return still has advantages and dropping it "
                          f"changes training; use --train.estimator {' or '.join(relative)}, or leave it off")  # fmt: skip
    if train.loss_spec.critic:
        raise ConfigError(f"--rollouts.dynamic_sampling: train.algorithm {train.algorithm} takes its advantages from "
                          "its critic (GAE), not from the group, so a group whose attempts all earn the same return "
                          "still has advantages; leave dynamic sampling off with a critic")  # fmt: skip
    if r.attempts < 2:
        raise ConfigError(f"--rollouts.dynamic_sampling: {r.attempts} attempt per task makes every group one "
                          "episode, with no signal, so every group would be dropped; use --rollouts.attempts 2 "
                          "or more")  # fmt: skip


def episode_turns(config) -> int | None:
    """The most turns an episode of the run's built-in agent can have (the agent's max_turns, and the
    environment's own limit: its max_turns option, one answer when it has neither that option nor tools);
    none for an agent program (its own code decides)."""
    if config.agent.plays_program:
        return None
    from agents.envs import check_options

    options = check_options(config.env.id, config.env.options)
    env_turns = getattr(options, "max_turns", None)
    if env_turns is None:
        env_turns = config.agent.max_turns if config.env.tools else 1
    return min(config.agent.max_turns, env_turns)


def check_tree(config) -> None:
    """Tree rollouts need episodes of two or more turns to branch, a width of two or more, and a token budget
    that pays for one root episode at least."""
    tree, r = config.tree, config.rollouts
    if tree.width is None:
        for name in sorted(tree.model_fields_set - {"width"}):
            if getattr(tree, name) != type(tree).model_fields[name].default:
                raise ConfigError(f"--tree.{name}: is an option of tree rollouts, which are off; add --tree.width "
                                  "2 (or more) or leave it out")  # fmt: skip
        return
    if tree.width < 2:
        raise ConfigError(f"--tree.width: {tree.width} continuation per branch point is the chain itself; give 2 or "
                          "more (or leave it out for chains)")  # fmt: skip
    turns = episode_turns(config)
    if turns is not None and turns < 2:
        why = (f"--agent.max_turns {config.agent.max_turns}" if config.agent.max_turns < 2
               else f"--env.id {config.env.id} answers once")  # fmt: skip
        raise ConfigError(f"--tree.width: episodes of one turn ({why}) have no later call to branch at; tree "
                          "rollouts need a multi-turn environment (game, countdown with max_turns 2+, tools)")  # fmt: skip
    if tree.token_budget is not None:
        one_root = r.max_tokens * (turns or 1)
        if tree.token_budget < one_root:
            raise ConfigError(f"--tree.token_budget: {tree.token_budget} tokens is less than one root episode can "
                              f"generate ({turns or 1} turn(s) x --rollouts.max_tokens {r.max_tokens} = {one_root}); "
                              "raise it")  # fmt: skip


def check_lora(config) -> None:
    """A LoRA run serves each version as an adapter loaded by path, at a rank vLLM can reserve; its
    reference (the initial policy) is scored on the policy servers."""
    from orchestrate.serving.vllm_server import served_lora_rank

    lora, s = config.train.lora, config.server
    if lora.rank == 0:
        return
    try:
        served_lora_rank(lora.rank)
    except ValueError as exc:
        raise ConfigError(f"--train.lora.rank: {exc}") from None
    if s.weight_transfer != DEFAULT:
        raise ConfigError(f"--server.weight_transfer: {s.weight_transfer} sends whole weights; a LoRA run "
                          f"(--train.lora.rank) sends only the adapter, loaded by path (megabytes): leave it at "
                          f"{DEFAULT}")  # fmt: skip
    if lora.start_from:
        raise ConfigError("--train.lora.start_from: an RL run's version 0 is --model.policy; to start from an "
                          "adapter, fold it in (`uv run -m orchestrate.after.merge ADAPTER --out DIR`) and pass "
                          "--model.policy DIR (orchestrate.after.offline --model ADAPTER trains an adapter on)")  # fmt: skip
    if config.train.save_weights_every:
        raise ConfigError("--train.save_weights_every: a LoRA run publishes its adapter in every checkpoint; "
                          "write a merged model folder of any version with `uv run -m orchestrate.after.merge`")  # fmt: skip
    if s.reference_url and config.reference_on_policy and config.train.needs_reference:
        raise ConfigError("--server.reference_url: with --train.lora.rank the reference (the initial policy) is "
                          "scored on the policy servers without an adapter, so no reference server is used; leave "
                          "it out (a reference server serves a --model.reference other than the policy)")  # fmt: skip


def check_program(config) -> None:
    """An agent program's options (the program section): they need a program; the tool parser is one of vLLM's."""
    p = config.program
    if not config.agent.plays_program:
        for name in sorted(p.model_fields_set):
            if getattr(p, name) != type(p).model_fields[name].default:
                raise ConfigError(f"--program.{name}: is an agent program's option; give --agent.program "
                                  "MODULE:play (or --agent.command) or leave it out")  # fmt: skip
        return
    if p.network == "gateway":
        import shutil

        if config.agent.command is None:
            raise ConfigError("--program.network: is a harness command's option (--agent.command)")
        if shutil.which("bwrap") is None:
            raise ConfigError("--program.network gateway: needs bubblewrap (apt-get install bubblewrap)")
    if p.reward is not None and config.agent.program is not None:
        from agents.program import ProgramError, load_reward

        try:
            load_reward(p.reward)
        except ProgramError as exc:  # a (tape, workspace) reward: a harness command's
            raise ConfigError(f"--program.reward: {exc} (a reward of (tape, workspace) is a harness "
                              "command's: --agent.command)") from None  # fmt: skip
    from agents.tool_format import parser_names

    names = parser_names()
    if p.tool_parser not in names:
        raise ConfigError(f"--program.tool_parser: {p.tool_parser!r} is not one of vLLM's tool parsers "
                          f"({', '.join(names)})")  # fmt: skip


def check_roles(config) -> None:
    """Several agents in one episode (agent.roles): the trained roles are the run's; rollouts that regroup or fork
    episodes by their whole reward (dynamic sampling, trees) are not built for them."""
    roles, trained = config.agent.roles, config.train.roles
    from agents.envs.registry import entry

    registered = entry(config.env.id).agents  # a registered multi-agent environment's agents, known unbuilt
    if registered and config.agent.plays_program:
        raise ConfigError(f"--agent.program: {config.env.id} is an environment of several agents "
                          f"({', '.join(registered)}), played by the built-in agent with --agent.roles; leave the "
                          "program out")  # fmt: skip
    if config.agent.role_examples and config.agent.plays_program:
        raise ConfigError("--agent.role_examples: the multi-agent agent's worked examples; a program writes its own "
                          "prompts, leave them out")  # fmt: skip
    if registered and not roles:
        raise ConfigError(f"--agent.roles: {config.env.id} is an environment of several agents; bind each (e.g. "
                          f"--agent.roles '{json.dumps(dict.fromkeys(registered, 'policy'))}')")  # fmt: skip
    if roles and not config.agent.plays_program:  # the built-in agent: the environment's agents are the roles
        from agents.env_spec import EnvSpec
        from agents.envs.base import capabilities

        agents = registered or capabilities(EnvSpec.from_config(config, "train").make()).agents
        if not agents:
            raise ConfigError(f"--agent.roles: {config.env.id} is an environment of one agent; a role is the `model` "
                              "name an agent program or harness command sends (--agent.program, --agent.command), "
                              "or an agent of a multi-agent environment (e.g. game:hide_and_guess)")  # fmt: skip
        if set(agents) != set(roles):
            raise ConfigError(f"--agent.roles: {config.env.id}'s agents are {', '.join(agents)}; bind each of them "
                              f"and nothing else (e.g. --agent.roles '{json.dumps(dict.fromkeys(agents, 'policy'))}')")  # fmt: skip
    if unknown := [r for r in config.agent.role_examples if r not in roles]:
        raise ConfigError(f"--agent.role_examples: {unknown[0]!r} is not a role of agent.roles "
                          f"({', '.join(roles) or 'none'})")  # fmt: skip
    if config.agent.program is not None:  # a program may name the roles it calls (its module's ROLES)
        import importlib

        called = getattr(importlib.import_module(config.agent.program.partition(":")[0]), "ROLES", ())
        missing = [r for r in called if r not in roles]
        if missing:
            raise ConfigError(f"--agent.roles: the program {config.agent.program} calls the roles "
                              f"{', '.join(called)}; {missing[0]!r} is not bound (e.g. "
                              f"--agent.roles '{json.dumps(dict.fromkeys(called, 'policy'))}')")  # fmt: skip
    if trained is not None:
        unknown = [r for r in trained if r not in roles]
        if unknown:
            have = f"its roles are {', '.join(roles)}" if roles else "it has no roles (agent.roles)"
            raise ConfigError(f"--train.roles: {unknown[0]!r} is not a role of this run; {have}")
        frozen = [r for r in trained if roles[r] not in TRAINED_BINDINGS]
        if frozen:
            raise ConfigError(f"--train.roles: {frozen[0]!r} is bound to {roles[frozen[0]]!r}, which is not trained; "
                              "name roles bound to 'policy' or 'adapter'")  # fmt: skip
    base = [r for r, b in roles.items() if b == "base"]
    if base and not config.train.lora.rank:
        raise ConfigError(f"--agent.roles: {base[0]!r} is bound to 'base', the initial policy the servers serve "
                          "beside the adapters of a LoRA run; add --train.lora.rank (e.g. 16)")  # fmt: skip
    own = config.adapter_roles
    if own and not config.train.lora.rank:
        raise ConfigError(f"--agent.roles: {own[0]!r} is bound to 'adapter', a LoRA adapter of its own beside the "
                          "policy's; add --train.lora.rank (e.g. 16)")  # fmt: skip
    if config.train.lora.roles and config.train.lora.roles != own:
        raise ConfigError("--train.lora.roles: the roles with an adapter of their own are those --agent.roles binds "
                          "to 'adapter'; leave it out")  # fmt: skip
    if roles and not any(b in TRAINED_BINDINGS for b in roles.values()):
        raise ConfigError("--agent.roles: no role is bound to 'policy' or 'adapter', so nothing would be trained; "
                          "bind one")  # fmt: skip
    if roles and config.tree.width:
        raise ConfigError("--tree.width: tree rollouts of episodes with several roles (agent.roles) are not built; "
                          "leave one of them out")  # fmt: skip
    if config.rollouts.counterfactual and not roles:
        raise ConfigError("--rollouts.counterfactual: counterfactual credit is per role, and this run has one agent; "
                          "give --agent.roles, or leave it out")  # fmt: skip
    if roles and config.rollouts.dynamic_sampling:
        raise ConfigError("--rollouts.dynamic_sampling: it keeps or drops a task's episodes by their whole reward, "
                          "and with agent.roles each role is credited apart; leave it off")  # fmt: skip


def check_distillation(config) -> None:
    """Distillation options that cannot work: pure distillation (estimator zero) with no teacher; a top-k with
    no teacher; a teacher with no term (coef 0 without a top-k)."""
    t = config.train
    if t.estimator == "zero" and not config.teacher.model:
        raise ConfigError("--train.estimator zero: pure distillation (no reward advantage) needs a teacher; give "
                          "--teacher.model, or choose another estimator")  # fmt: skip
    teacher = config.teacher
    fields = type(teacher).model_fields
    if not teacher.model and (
        given := [n for n in fields if n != "model" and getattr(teacher, n) != fields[n].default]
    ):
        raise ConfigError(f"--teacher.{given[0]} {getattr(teacher, given[0])}: an option of distillation, which "
                          "has no teacher here; give --teacher.model, or leave it out")  # fmt: skip
    if teacher.model and not teacher.coef and not teacher.topk:
        raise ConfigError("--teacher.coef 0: the teacher then gives no signal; give a coefficient > 0, or "
                          "--teacher.topk K for its top-k term alone")  # fmt: skip


def check_config(config) -> None:
    """Cross-field checks and limits of a validated RLConfig."""
    check_finite(config.model_dump(mode="python"))
    for dotted, limit in LIMITS.items():
        value = _get(config, dotted)
        if isinstance(value, int) and value > limit:
            raise ConfigError(f"--{dotted}: {value} is more than the limit {limit}")
    r, s = config.rollouts, config.server
    tasks = r.tasks_per_iteration + (r.max_extra_tasks if r.dynamic_sampling else 0)  # at most, with extra tasks
    if tasks * r.attempts > TAPES_PER_ITERATION_LIMIT:
        raise ConfigError(f"--rollouts.attempts: {tasks} tasks x {r.attempts} attempts = "
                          f"{tasks * r.attempts} tapes per iteration, more than the limit "
                          f"{TAPES_PER_ITERATION_LIMIT}")  # fmt: skip
    if config.tree.width and tasks * config.tree.max_episodes(r.attempts) > TAPES_PER_ITERATION_LIMIT:
        t = config.tree
        raise ConfigError(f"--tree.depth: {tasks} tasks x up to {t.max_episodes(r.attempts)} episodes a tree "
                          f"({r.attempts} roots, {t.points} points x {t.width - 1} forks a level, {t.depth} levels) "
                          f"may play more tapes per iteration than the limit {TAPES_PER_ITERATION_LIMIT}; lower "
                          "--tree.depth, --tree.width or --tree.points")  # fmt: skip
    check_dynamic_sampling(config)
    check_tree(config)
    if config.eval.samples > 1 and config.eval.temperature == 0:
        raise ConfigError(f"--eval.samples: {config.eval.samples} samples at --eval.temperature 0 repeat one greedy "
                          "answer; sample once, or at a temperature above 0 (e.g. 1.0) for pass@k")  # fmt: skip
    for dotted, value in (("rollouts.max_tokens", r.max_tokens), ("eval.max_tokens", config.eval.max_tokens)):
        if value >= s.max_model_len:
            raise ConfigError(f"--{dotted}: {value} new tokens do not fit in --server.max_model_len {s.max_model_len} "
                              "(prompt + completion); lower it or raise server.max_model_len")  # fmt: skip
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if s.kv_cache_gib > memory_gib:
        raise ConfigError(f"--server.kv_cache_gib: {s.kv_cache_gib} GiB is more than this machine's memory "
                          f"({memory_gib:.0f} GiB)")  # fmt: skip
    estimator = config.train.estimator
    taught = bool(config.teacher.model)  # the teacher's term gives every token a signal of its own
    forked = bool(config.tree.width)  # a tree's forks join their root's group: one root is a group of several
    group_only = "group" in ESTIMATORS[estimator].needs and not config.train.loss_spec.critic and not taught
    group_only = group_only and not forked
    if group_only and r.attempts < 2:  # the reward's group advantage is all there is, and it is 0
        raise ConfigError(f"--rollouts.attempts: {r.attempts} attempt per task leaves every group of one, so every "
                          f"group-baseline advantage ({config.train.algorithm}, train.estimator {estimator}) is 0 and nothing "
                          "is learned; use 2 or more (or --train.algorithm reinforce: no baseline)")  # fmt: skip
    if r.top_p < 1:
        raise ConfigError(f"--rollouts.top_p: {r.top_p} is refused for training rollouts: the trainer computes log-probs "
                     "of the whole distribution (top_p = 1), so tokens sampled from a truncated one would get wrong "
                     "importance ratios and KL; leave it at 1")  # fmt: skip
    check_placement(config)
    check_lora(config)
    check_distillation(config)
    if config.train.overlong_buffer > r.max_tokens:
        raise ConfigError(f"--train.overlong_buffer: {config.train.overlong_buffer} tokens is more than --rollouts.max_tokens "
                          f"{r.max_tokens}, the limit it counts back from; lower it")  # fmt: skip
    if config.run.in_flight_swaps and config.server.data_parallel_size > 1:
        raise ConfigError("--run.in_flight_swaps: a server with --server.data_parallel_size "
                          f"{config.server.data_parallel_size} answers vLLM's /collective_rpc with its first engine's "
                          "result only, so the calls of its other engines would not record where their version "
                          "changed; run one server per engine (--server.policy_servers) or leave the option out")  # fmt: skip
    check_gpus(config)
    check_colocation(config)
    check_same_machine(config)
    lag, level = config.train.max_lag, config.run.async_level
    if lag is not None and lag < level:
        raise ConfigError(f"--train.max_lag: {lag} is below --run.async_level {level}, so batches generated "
                     f"{lag + 1}..{level} versions back would be thrown away; leave it out (it follows "
                     "run.async_level) or raise it")  # fmt: skip
    if config.run.in_flight_swaps and not level:
        raise ConfigError("--run.in_flight_swaps: new weights arrive while episodes run only with --run.async_level "
                          "1 or more; raise it or leave the option out")  # fmt: skip
    if config.run.in_flight_swaps and select(config.server.weight_transfer, config.train.lora.rank).adapter:
        raise ConfigError("--run.in_flight_swaps: a LoRA run never pauses its calls (each version is an adapter of "
                          "its own name: calls in flight finish under the old one); leave the option out")  # fmt: skip
    if "search" in config.env.tools and not config.env.search.corpus:
        raise ConfigError("--env.search.corpus: --env.tools search needs a corpus: a JSON lines file, one passage per "
                          "line with 'text' (and optional 'title', 'id')")  # fmt: skip
    check_program(config)
    check_roles(config)
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
