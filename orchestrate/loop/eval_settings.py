"""An evaluation's command line, checked before anything starts (orchestrate.eval): what is evaluated (the
targets: runs, versions, model folders and names, servers by URL), with which environment and agent (the
run's config, or a preset's, with overrides), on which tasks, how many samples at which temperature, and
where it is written. Every refusal is an EvalError (or a check's of orchestrate.loop.policy or preflight):
one line naming the option; the command exits 2 with it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from contract.cli import OptionError, checked_span, given
from contract.rundir import FORKS_DIR, RunDir
from orchestrate.loop.command_line import DEFAULT_PRESET, load_preset, resolve_from
from orchestrate.loop.config import RLConfig
from orchestrate.loop.policy import (
    Policy,
    checkpoint_number,
    given_policy,
    read_run_config,
    run_policy,
    servable_versions,
)
from orchestrate.loop.preflight import check_environment, remote_policy

MAX_SAMPLES = 1024  # per task (the loop's eval.samples has the same limit)
TASKS = re.compile(r"^\s*(\d+)\s*(?::\s*(\d+)\s*)?$")
VERSIONED = re.compile(r"^(.*)@(\d+)$")


class EvalError(OptionError):
    """Bad input: one line naming the option, exit 2."""


@dataclass
class Target:
    """One thing to evaluate, checked."""

    text: str
    policy: Policy
    run: RunDir | None  # the run it belongs to, if any


@dataclass
class Settings:
    """The command line, checked: what is evaluated, on which tasks, how."""

    targets: list[Target]
    config: RLConfig
    config_source: str
    seeds: list[int]
    n: int
    temperature: float
    max_tokens: int
    ks: list[int]
    out: Path
    key_file: str | None
    max_concurrency: int
    split: str
    sweep: bool = False  # --versions: the targets are versions of one run, served by one server in turn
    role: str | None = None  # --role: the figures of this role of the episodes (agent.roles)

    def record(self, target: Target) -> dict:
        """What an evaluation folder holds: a resumed one must have been started with the same."""
        c = self.config
        return {"target": target.text, "model": target.policy.name, "version": target.policy.version,
                "env": {"id": c.env.id, "options": c.env.options, "tools": c.env.tools, "split": self.split,
                        "run_seed": c.run.seed},
                "agent": c.agent.model_dump(mode="json"), "program": c.program.model_dump(mode="json"), "tasks": [self.seeds[0], self.seeds[-1] + 1],
                "n": self.n, "temperature": self.temperature, "max_tokens": self.max_tokens}  # fmt: skip


def is_run(path: Path) -> bool:
    run = RunDir(path)
    return path.is_dir() and (run.state_path.is_file() or (path / "checkpoints").is_dir() or
                              (run.config_path.is_file() and "rollouts" in read_json(run.config_path)))  # fmt: skip


def read_json(path: Path) -> dict:
    """The JSON object in `path`; {} when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def target_run(text: str) -> tuple[RunDir | None, int | None]:
    """The run a target belongs to and the version it names: RUN, RUN@N, RUN/checkpoints/N."""
    m = VERSIONED.match(text)
    path = Path(m.group(1) if m else text)
    if is_run(path):
        return RunDir(path), int(m.group(2)) if m else None
    if m:
        raise EvalError(f"target {text}: {path} is not a run directory (RUN@N names version N of a run)")
    if "@" in text and is_run(Path(text.rsplit("@", 1)[0])):
        raise EvalError(f"target {text}: {text.rsplit('@', 1)[1]!r} is not a version (RUN@N: N a checkpoint number)")
    if path.is_dir() and checkpoint_number(path) and is_run(path.parent.parent):
        return RunDir(path.parent.parent), checkpoint_number(path)  # version N of its run (LoRA: its adapter)
    return None, None


def resolve_config(args, overrides: dict[str, str], runs: list[RunDir | None]) -> tuple[RLConfig, str]:
    """The environment's and agent's settings: --config, else the first target's run, else the preset."""
    if args.config and args.preset:
        raise EvalError("--preset: give --config or --preset, not both")
    path = Path(args.config) if args.config else next((r.config_path for r in runs if r is not None), None)
    if path is not None and not args.preset:
        if not path.is_file():
            raise EvalError(f"--config: {path} not found; pass a run's config.json")
        data, whole = read_json(path), str(path)
        if "rollouts" not in data:
            raise EvalError(f"--config: {path} is not a run's config.json")
    else:
        data, whole = load_preset(args.preset or DEFAULT_PRESET), f"preset {args.preset or DEFAULT_PRESET!r}"
    return resolve_from(data, overrides, whole), whole


def parse_tasks(text: str | None, default: int, size: int | None, split: str) -> list[int]:
    if text is None:
        low, high = 0, default
    else:
        m = TASKS.match(text)
        if not m:
            raise EvalError(f"--tasks: {text!r} is not N or A:B (e.g. 200 or 0:200)")
        low, high = (0, int(m.group(1))) if m.group(2) is None else (int(m.group(1)), int(m.group(2)))
        if high <= low:
            raise EvalError(f"--tasks: {text!r} is an empty slice")
    if size is not None and high > size:
        raise EvalError(f"--tasks: the {split} split holds {size} tasks (0:{size}); {low}:{high} reaches past it")
    return list(range(low, high))


def parse_ks(text: str | None, n: int) -> list[int]:
    from orchestrate.loop.eval_stats import ks_for

    if text is None:
        return ks_for(n)
    try:
        ks = sorted({int(k) for k in text.split(",")})
    except ValueError:
        raise EvalError(f"--k: {text!r} is not a comma-separated list of whole numbers") from None
    if ks[0] < 1:
        raise EvalError(f"--k: {ks[0]}: k counts samples, 1 or more")
    if ks[-1] > n:
        raise EvalError(f"--k: pass@{ks[-1]} needs at least {ks[-1]} samples per task; --n is {n}")
    return ks


def parse_versions(text: str, on_disk: list[int], step: int | None, run: RunDir) -> list[int]:
    """--versions (all, or N,M and ranges A-B, B included) among the versions `on_disk` (0 always is), then
    --step's multiples and the newest chosen; a version named alone that is not on disk is refused."""
    available = sorted({0, *on_disk})
    have = f"versions with weights on disk: {spans(available)}"
    if text.strip() == "all":
        chosen = available
    else:
        chosen = []
        for item in text.split(","):
            low, high = checked_span(item.strip(), "--versions", "a version N or a range A-B (or all)", EvalError)
            if "-" not in item and low not in available:
                raise EvalError(f"--versions: {run.root} has no version {low} on disk; {have}")
            chosen += [v for v in available if low <= v <= high]
        chosen = sorted(set(chosen))
    if step is not None:
        if step < 1:
            raise EvalError(f"--step {step}: expected a positive integer")
        chosen = sorted({v for v in chosen if v % step == 0} | set(chosen[-1:]))
    if not chosen:
        raise EvalError(f"--versions {text}: none of {run.root}'s versions is in it; {have}")
    return chosen


def version_target(run: RunDir, version: int) -> str:
    """How --versions names one version of a run (RUN@N, the run's folder resolved): each version's target,
    and what its OUT/vN record says it evaluated."""
    return f"{run.root.resolve()}@{version}"


def spans(numbers: list[int]) -> str:
    """Sorted numbers with their consecutive runs written A-B: 0-5, 8, 10-12."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# what an evaluation's folder holds (and a comparison's or a curve's, around its evaluations' folders)
EVAL_FILES = {"config.json", "eval.json", "summary.md", "pass_at_k.png", "logs", "tapes", "curve.json", "curve.md",
              "curve.png", "compare.json", "compare.md", "compare.png"}  # fmt: skip


def folders_of(s: Settings) -> list[Path]:
    """Where each target's evaluation goes: OUT; OUT/a and OUT/b (--compare); OUT/vN (--versions)."""
    if s.sweep:
        return [s.out / f"v{t.policy.version}" for t in s.targets]
    return [s.out / "a", s.out / "b"] if len(s.targets) == 2 else [s.out]


def label(settings_like: dict) -> str:
    """A folder name that says what was evaluated and how."""
    lo, hi = settings_like["tasks"]
    env = re.sub(r"[^A-Za-z0-9_.-]", "_", settings_like["env"]["id"])
    return (f"v{settings_like['version']}-{env}-{settings_like['env']['split']}{lo}-{hi}-n{settings_like['n']}"
            f"-t{settings_like['temperature']:g}")  # fmt: skip


def resolve(args: argparse.Namespace, env_options: dict[str, str]) -> Settings:
    """Every option checked before anything starts; EvalError names the first bad one."""
    texts = list(args.compare) if args.compare else [args.target] if args.target else []
    if args.compare and args.target:
        raise EvalError("--compare: it takes the two targets; leave the lone target out")
    if not texts:
        raise EvalError("target: name what to evaluate (a run, RUN@N, a model folder or name, a URL), or --compare A B")
    if args.version is not None and (args.compare or args.version < 0):
        raise EvalError(f"--version {args.version}: a version of one run (0 or more); with --compare write RUN@N")
    if args.versions is not None and (args.compare or args.version is not None):
        raise EvalError("--versions: the versions of one run; leave --version and --compare out")
    if args.step is not None and args.versions is None:
        raise EvalError("--step: it picks among --versions; give --versions too (e.g. --versions all)")
    if not 1 <= args.n <= MAX_SAMPLES:
        raise EvalError(f"--n {args.n}: sample each task 1 to {MAX_SAMPLES} times")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise EvalError(f"--max-tokens {args.max_tokens}: expected a positive integer")
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise EvalError(f"--temperature {args.temperature}: expected a number >= 0")
    if args.temperature == 0 and args.n > 1:
        raise EvalError(f"--n {args.n}: at temperature 0 every sample is the same greedy answer; use --n 1, or a "
                        "temperature above 0 (e.g. --temperature 1.0) for pass@k")  # fmt: skip
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise EvalError(f"--max-concurrency {args.max_concurrency}: expected a positive integer")
    urls = [t for t in texts if t.startswith(("http://", "https://"))]
    if args.key_file and not urls:
        raise EvalError("--key-file: it is the key of a server given by URL; name one as the target")
    ks = parse_ks(args.k, args.n)
    runs = []
    for text in texts:
        run, version = (None, None) if text in urls else target_run(text)
        if version is not None and args.version is not None:
            raise EvalError(f"--version {args.version}: {text} names version {version} already; give one of the two")
        if version is None and args.version is not None:
            if run is None:
                raise EvalError(f"--version: {text} is not a run directory")
            version = args.version
        runs.append((run, version))
    if args.versions is not None and (runs[0][0] is None or runs[0][1] is not None):
        raise EvalError(f"--versions: {texts[0]} is not a run directory (name the run, RUN, without @N)")
    overrides = given(args)
    overrides.update({f"env.options.{k}": v for k, v in env_options.items()})
    config, source = resolve_config(args, overrides, [r for r, _ in runs])
    from agents.env_spec import EnvSpec
    from orchestrate.loop.evaluation import test_size

    check_environment(config.model_copy(update={"eval": config.eval.model_copy(update={"every": 0})}))
    from orchestrate.loop.policy import role_models, teacher_folder

    for role, binding in role_models(config).items():  # each served beside the policy (PolicyServer)
        teacher_folder(binding, f"--agent.roles {role}")

    spec = EnvSpec(config.env.id, config.env.options, args.split, config.run.seed, config.env.tools)
    size = test_size(spec) if args.split == "test" else None
    seeds = parse_tasks(args.tasks, config.eval.tasks or size or 500, size, args.split)
    max_tokens = args.max_tokens or config.eval.max_tokens
    if max_tokens >= config.server.max_model_len:
        raise EvalError(
            f"--max-tokens: {max_tokens} new tokens do not fit in --server.max_model_len "
            f"{config.server.max_model_len} (prompt + completion); lower it or raise server.max_model_len"
        )
    temperature = args.temperature if args.temperature is not None else (
        config.eval.temperature if args.n == 1 else config.rollouts.temperature)  # fmt: skip
    targets = []
    if args.versions is not None:
        run = runs[0][0]
        run_config = run_settings(run)
        if (config.train.lora.rank > 0) != (run_config.train.lora.rank > 0):
            raise EvalError(f"{'--preset' if args.preset else '--config'}: its train.lora.rank "
                            f"{config.train.lora.rank} differs from {run.root}'s "
                            f"({run_config.train.lora.rank}): a LoRA run's versions are adapters, another's whole "
                            "weights; leave --config and --preset out")  # fmt: skip
        versions = parse_versions(args.versions, servable_versions(run, run_config), args.step, run)
        texts, runs = [version_target(run, v) for v in versions], [(run, v) for v in versions]
    for text, (run, version) in zip(texts, runs):
        if text in urls:
            policy = remote_policy(text, args.key_file, option="target", key_option="--key-file")
        elif run is not None:
            policy = run_policy(run, run_settings(run), version, option="target")
        else:
            policy = given_policy(text, option="target")
        if policy.adapter is not None and not config.train.lora.rank:
            if args.compare and not (args.preset or args.config):  # the config is A's run's
                raise EvalError(f"--compare: {text} is a LoRA run's version (an adapter) and {texts[0]} is not: "
                                "both are served with the first's config; merge the adapter first (uv run -m "
                                "orchestrate.after.merge RUN --out DIR) and compare DIR")  # fmt: skip
            raise EvalError(f"{'--preset' if args.preset else '--config'}: {text} is a LoRA run's version (an "
                            "adapter), but train.lora.rank is 0 in "
                            f"{source}; leave --config and --preset out")  # fmt: skip
        targets.append(Target(text, policy, run))
    settings = Settings(targets, config, source, seeds, args.n, temperature, max_tokens,
                        ks, Path(), args.key_file, args.max_concurrency or config.rollouts.max_concurrency,
                        args.split, sweep=args.versions is not None, role=args.role)  # fmt: skip
    if args.role is not None and args.role not in config.agent.roles:
        have = f"its roles are {', '.join(config.agent.roles)}" if config.agent.roles else "it has no roles"
        raise EvalError(f"--role {args.role}: not a role of {source}; {have}")
    settings.out = Path(args.out) if args.out else default_out(settings)
    if settings.out.exists() and not settings.out.is_dir():
        raise EvalError(f"--out: {settings.out} is a file")
    folders = folders_of(settings)
    # an evaluation's files (config.json, tapes/) go into each folder: one that holds anything else (a run's
    # state and checkpoints, a model's weights, someone's files) is not written over
    for folder in dict.fromkeys([*folders, settings.out]):
        if folder.is_dir():
            top = folder == settings.out not in folders  # a comparison's or curve's: its evaluations' folders
            others = sorted(p.name for p in folder.iterdir()
                            if not (p.name in EVAL_FILES or p in folders or (top and p.is_dir())))  # fmt: skip
            if (folder / "tapes").is_dir():
                others += [f"tapes/{p.name}" for p in (folder / "tapes").iterdir()
                           if not (p.name.startswith("eval_") or p.name == FORKS_DIR)]  # fmt: skip
            if others:
                raise EvalError(f"--out: {folder} holds files an evaluation does not write ({', '.join(others[:3])}); "
                                "pass a new or empty folder")  # fmt: skip
    for folder, target in zip(folders, targets):
        saved = read_json(folder / "eval.json").get("settings")
        if saved is not None and saved != settings.record(target):
            raise EvalError(f"--out: {folder} holds an evaluation with other settings; pass a new --out")
    return settings


def run_settings(run: RunDir) -> RLConfig:
    """The config.json of a target's run."""
    return read_run_config(run.config_path, option="target")


def default_out(s: Settings) -> Path:
    records = [s.record(t) for t in s.targets]
    if s.sweep:  # the curve's folder: the label without a version (each version in OUT/vN)
        return s.targets[0].run.root / "evals" / f"curve-{label(records[0]).split('-', 1)[1]}"
    if len(s.targets) == 2:
        names = "-vs-".join(re.sub(r"[^A-Za-z0-9_.-]", "_", Path(t.text.rstrip("/")).name)[:40] for t in s.targets)
        return Path("runs") / "evals" / f"compare-{names}-{label(records[1]).split('-', 1)[1]}"
    t = s.targets[0]
    if t.run is not None:
        return t.run.root / "evals" / label(records[0])
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", t.text.rstrip("/").split("/")[-1])[:60]
    return Path("runs") / "evals" / f"{name}-{label(records[0])}"
