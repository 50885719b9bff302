"""Evaluate a policy: `uv run -m orchestrate.eval TARGET [--n 8 --temperature 1.0] [--tasks 0:200]`.

    uv run -m orchestrate.eval runs/embedded                           # its newest checkpoint, the held-out set
    uv run -m orchestrate.eval runs/embedded --version 10 --n 8 --temperature 1.0
    uv run -m orchestrate.eval smollm2 --env.id math:gsm8k --tasks 0:200
    uv run -m orchestrate.eval http://127.0.0.1:8000 --key-file KEY --config runs/embedded/config.json
    uv run -m orchestrate.eval --compare runs/embedded@0 runs/embedded --n 4 --temperature 1.0
    uv run -m orchestrate.eval runs/embedded --versions all --step 5    # a learning curve, one server

TARGET is a run directory (its newest checkpoint with weights on disk; `--version N` or RUN@N for version N,
0 the initial model), a model folder (a checkpoint RUN/checkpoints/N is version N of its run), a model by
name (smollm2, a hub id), or the URL of a policy server that runs (orchestrate.serve; used as it serves now).
The environment and the agent (built-in or `--agent.program`) are the run's (its config.json: the target's
run, or `--config`), else the preset's, with `--env.*` / `--agent.*` overrides; the tasks are a slice of a
split (`--tasks N` the first N, `A:B`; default the run's eval.tasks, else the whole test split).

Each task is played `--n` times at `--temperature` (all in flight on one vLLM server started for the target,
with the run's server settings; the loop's held-out evaluation plays with the same code,
orchestrate.loop.evaluation). Reported: mean reward, pass@k for k = 1, 2, 4, ... n (the unbiased
estimator), maj@k where the environment reports comparable answers, each with a 95% interval over tasks
(orchestrate.loop.eval_stats), and a per-task table with the failures first. Written to OUT (default
RUN/evals/LABEL for a run, else runs/evals/NAME-LABEL): tapes/eval_VVVVVV.jsonl (browse, replay and fork
them), eval.json (settings, figures, per task), summary.md, pass_at_k.png, config.json, logs/. Finished
tasks are appended as they end: the same command after a kill plays only the rest.

`--versions all|N,A-B [--step K]` evaluates versions of one run in turn on one server (each next version's
weights reloaded into it, a LoRA run's adapter loaded), each into OUT/vN, and writes their curve against the
minute each version came in the run (curve.json, curve.md, curve.png).

`--compare A B` evaluates A then B on the same tasks and seeds (OUT/a, OUT/b, resumable each) and reports
the paired difference B - A of each figure with its 95% interval and the tasks that flipped (compare.json,
compare.md, compare.png).

An evaluation of a run whose loop is running reads the run's checkpoints and writes only its own folder,
under its own lock. Exit status 0 when written; 1 when a server failed (what finished is kept); 2 for bad
input, one line naming the option, checked before anything starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from contract.cli import OptionError, StrictParser, add_options, given, parse_span, refuse_repeated
from contract.durable import atomic_write_json, atomic_write_text
from contract.rundir import FORKS_DIR, RunDir
from orchestrate.loop.command_line import DEFAULT_PRESET, load_preset, presets, resolve_from, split_env_options
from orchestrate.loop.config import EnvSection, ProgramSection, RLConfig, ServerSection
from orchestrate.loop.policy import Policy, checkpoint_number, given_policy, run_policy
from orchestrate.loop.preflight import remote_policy
from tapes.tape import Tape

SERVER_OPTIONS = ("max_model_len", "kv_cache_gib", "dtype", "gpu_memory_utilization", "enforce_eager", "cpus", "gpus",
                  "startup_timeout_s", "extra_args")  # fmt: skip
MAX_SAMPLES = 1024  # per task (the loop's eval.samples has the same limit)
TASKS = re.compile(r"^\s*(\d+)\s*(?::\s*(\d+)\s*)?$")
VERSIONED = re.compile(r"^(.*)@(\d+)$")


class EvalError(OptionError):
    """Bad input: one line naming the option, exit 2."""


# -- the command line ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = StrictParser(
        prog="uv run -m orchestrate.eval",
        description="Evaluate a checkpoint, a run, a model or a server: pass@k, maj@k, mean reward with 95% "
        "intervals, per-task results, tapes; --compare A B for a paired comparison.",
        epilog="Options --env.*, --agent.*, --program.* and --server.* override the run's config (or the preset's).",
    )
    parser.add_argument("target", nargs="?", help="RUN, RUN@N, a model folder, a model name, or a server's URL")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="evaluate A and B on the same tasks: B - A")
    parser.add_argument("--version", type=int, help="of a run: this version (0: the initial model)")
    parser.add_argument(
        "--versions",
        help="of a run: these versions one after another on one server, and their "
        "learning curve: all (those with weights on disk), or N,M and ranges A-B (B included)",
    )
    parser.add_argument(
        "--step", type=int, help="with --versions: the versions that are multiples of STEP, and the newest"
    )
    parser.add_argument("--config", help="the run config.json whose environment and agent to use [default: the target's run's]")  # fmt: skip
    parser.add_argument("--preset", help=f"this preset's environment and agent ({', '.join(presets())}) [default: the target's run's config, else embedded]")  # fmt: skip
    parser.add_argument("--split", default="test", choices=("test", "train"), help="the split [default: test]")
    parser.add_argument("--tasks", help="N (the first N) or A:B (tasks A to B-1) [default: eval.tasks, else all; 500 of a split without an end]")  # fmt: skip
    parser.add_argument("--n", type=int, default=1, help="samples per task [default: 1]")
    parser.add_argument("--temperature", type=float, help="[default: eval.temperature with --n 1, else rollouts.temperature]")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, help="new tokens per LLM call [default: eval.max_tokens]")
    parser.add_argument("--k", help="pass@k for these k, comma-separated [default: 1, 2, 4, ... n]")
    parser.add_argument("--key-file", help="a server's API key file [default: $VLLM_API_KEY]")  # fmt: skip
    parser.add_argument("--max-concurrency", type=int, help="episodes' calls in flight [default: rollouts.max_concurrency]")  # fmt: skip
    parser.add_argument("--out", help="output folder [default: RUN/evals/LABEL, else runs/evals/NAME-LABEL]")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_options(parser, EnvSection, "env.", defaults=False)
    from agents.agent import AgentConfig

    add_options(parser, AgentConfig, "agent.", defaults=False)
    add_options(parser, ProgramSection, "program.", defaults=False)
    add_options(parser, ServerSection, "server.", defaults=False, only=SERVER_OPTIONS, note="the target's server: ")
    return parser


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
                              (run.config_path.is_file() and "rollouts" in _json(run.config_path)))  # fmt: skip


def _json(path: Path) -> dict:
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
        data, whole = _json(path), str(path)
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
            span = parse_span(item)
            if span is None:
                raise EvalError(f"--versions: {item.strip()!r} is not a version N or a range A-B (or all)")
            low, high = span
            if high < low:
                raise EvalError(f"--versions: {item.strip()!r} is an empty range")
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
    from orchestrate.loop.evaluation import test_size
    from orchestrate.loop.preflight import check_environment

    check_environment(config.model_copy(update={"eval": config.eval.model_copy(update={"every": 0})}))
    from agents.env_spec import EnvSpec

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
        from orchestrate.loop.policy import servable_versions

        run = runs[0][0]
        run_config = _run_config(run)
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
            policy = run_policy(run, _run_config(run), version, option="target")
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
                        args.split, sweep=args.versions is not None)  # fmt: skip
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
        saved = _json(folder / "eval.json").get("settings")
        if saved is not None and saved != settings.record(target):
            raise EvalError(f"--out: {folder} holds an evaluation with other settings; pass a new --out")
    return settings


def _run_config(run: RunDir) -> RLConfig:
    from orchestrate.loop.policy import read_run_config

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


# -- one evaluation -------------------------------------------------------------------------------------


def tape_file(folder: Path, version: int) -> Path:
    return RunDir(folder).eval_tapes(version)


def finished(path: Path, n: int, trim: bool = False) -> dict[int, list[Tape]]:
    """The tasks whose n samples a killed evaluation wrote whole, by seed (a torn last line, or a task cut
    short, is dropped and played again); with `trim`, the file is rewritten with them alone (atomically)."""
    from tapes.store import parse_tape_line

    if not path.is_file():
        return {}
    tapes: list[Tape] = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for lineno, line in enumerate(lines, start=1):
        if line.strip():
            try:
                tapes.append(parse_tape_line(line, path, lineno))
            except Exception:  # noqa: BLE001 - a line cut by the kill: it and anything after are played again
                break
    by_seed: dict[int, list[Tape]] = {}
    for tape in tapes:
        by_seed.setdefault(int(tape.context["env"]["seed"]), []).append(tape)
    done = {seed: group for seed, group in by_seed.items() if len(group) == n}
    if trim and sum(map(len, done.values())) != len(lines):
        atomic_write_text(path, "".join(t.model_dump_json() + "\n" for group in done.values() for t in group))
    return done


class Appender:
    """Each finished task's tapes appended to the evaluation's file and synced: a kill loses no finished task."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")

    def __call__(self, seed: int, tapes: list[Tape]) -> None:
        self.file.write("".join(t.model_dump_json() + "\n" for t in tapes))
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


def evaluate(s: Settings, target: Target, folder: Path, progress: bool, serve=None) -> dict:
    """Evaluate one target into `folder` (resuming what it holds); its eval.json record. `serve(policy)`: a
    context giving the policy's PolicyServer (default: one started for it and stopped after)."""
    from agents.env_spec import EnvSpec
    from orchestrate.loop.eval_report import markdown, plot
    from orchestrate.loop.eval_stats import summarize
    from orchestrate.loop.evaluation import play_tasks, task_results
    from orchestrate.loop.run_lock import RunLock
    from orchestrate.loop.setup import PolicyServer, build_agent
    from tapes.tape import SamplingParams

    folder.mkdir(parents=True, exist_ok=True)
    lock = RunLock(folder, "an evaluation").acquire()
    try:
        atomic_write_json(folder / "config.json", s.config.model_dump(mode="json"))
        path = tape_file(folder, target.policy.version)
        done = finished(path, s.n, trim=True)
        todo = [seed for seed in s.seeds if seed not in done]
        spec = EnvSpec.from_config(s.config, s.split)
        sampling = SamplingParams(temperature=s.temperature, max_tokens=s.max_tokens)
        started = time.perf_counter()
        print(f"{target.text}: {target.policy.note}; {len(s.seeds)} tasks of {s.config.env.id} ({s.split}) x {s.n} "
              f"at temperature {s.temperature:g}" + (f"; {len(done)} done before, {len(todo)} to play" if done else ""),
              flush=True)  # fmt: skip
        if todo:

            def own_server(policy):
                return PolicyServer(policy, s.config, folder / "logs", s.key_file)

            appender = Appender(path)
            try:
                with (
                    build_agent(s.config, _tokenizer(target.policy, s.config)) as agent,
                    (serve or own_server)(target.policy) as served,
                ):

                    async def play():
                        async with served.client(s.max_concurrency) as client:
                            await play_tasks(agent, spec, todo, s.n, client, sampling=sampling, iteration=0,
                                             policy_version=target.policy.version, done=appender,
                                             progress=progress, desc=f"eval {target.text}")  # fmt: skip

                    asyncio.run(play())
            finally:
                appender.close()
        seconds = time.perf_counter() - started
        done = finished(path, s.n)
        tapes = [t for seed in s.seeds for t in done.get(seed, [])]
        in_order = "".join(t.model_dump_json() + "\n" for t in tapes)
        if path.read_text(encoding="utf-8") != in_order:  # appended as tasks ended: kept in task order
            atomic_write_text(path, in_order)
        summary = summarize(task_results(tapes), s.ks)
        record = {"settings": s.record(target), "policy": target.policy.note, "config": s.config_source,
                  "tapes": str(path), "seconds": round(seconds, 3), **summary}  # fmt: skip
        atomic_write_json(folder / "eval.json", record)
        atomic_write_text(folder / "summary.md", markdown(summary, f"{target.text} ({target.policy.note})"))
        plot(summary, folder / "pass_at_k.png")
        return record
    finally:
        lock.release()


def _tokenizer(policy: Policy, config: RLConfig):
    """The served model's tokenizer when it is a folder here that has one, else the run's policy's."""
    from transformers import AutoTokenizer

    from orchestrate.loop.setup import load_tokenizer

    if not policy.url and (policy.model / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(policy.model)
    return load_tokenizer(config)


def headline(record: dict, ks: list[int]) -> str:
    from orchestrate.loop.eval_report import over_tasks

    def figure(name: str) -> str:
        f = record.get(name)
        if not f:
            return ""
        lo, hi = f["ci95"]
        return f"{name} {f['value']:.3f} [{lo:.3f}, {hi:.3f}]{over_tasks(f, record['tasks'])}"

    names = ["mean_reward"] + [f"pass@{k}" for k in ks] + [f"maj@{k}" for k in ks if k > 1]
    return "  ".join(x for x in map(figure, names) if x)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        refuse_repeated(argv)
        argv, env_options = split_env_options(argv)
        args = parser.parse_args(argv)
        s = resolve(args, env_options)
    except OptionError as exc:  # any refusal of the input: one line, exit 2
        parser.exit(2, f"error: {str(exc).splitlines()[0]}\n")
    from orchestrate.loop.run_lock import RunDirInUse
    from orchestrate.loop.setup import interrupting_signals
    from orchestrate.serving.llm import LLMError
    from orchestrate.serving.vllm_server import ServerError

    folders = folders_of(s)
    records = []
    one = OneServer(s, s.out / "logs") if s.sweep else None
    try:
        with interrupting_signals():
            for target, folder in zip(s.targets, folders):
                records.append(evaluate(s, target, folder, progress=not args.no_progress, serve=one))
                print(f"{target.text}: {headline(records[-1], s.ks)}  ({folder / 'summary.md'})", flush=True)
    except KeyboardInterrupt:
        print("\nInterrupted. What finished is kept; run the same command again to play the rest.", file=sys.stderr)
        return 130
    except RunDirInUse as exc:
        print(f"error: --out: {exc}", file=sys.stderr)
        return 2
    except (LLMError, ServerError) as exc:
        print(f"error: {str(exc).splitlines()[0]}\nWhat finished is kept; run the same command again to play the "
              "rest.", file=sys.stderr)  # fmt: skip
        return 1
    finally:
        if one is not None:
            one.close()
    if s.sweep:
        write_curve(s, records)
    elif len(records) == 2:
        write_comparison(s, folders)
    return 0


class OneServer:
    """--versions: one server for all the versions, started for the first that has tasks to play and switched
    to each next one (PolicyServer.switch: its weights reloaded, or its adapter loaded), stopped at the end."""

    def __init__(self, s: Settings, logs: Path):
        self.s, self.logs, self.served = s, logs, None

    @contextmanager
    def __call__(self, policy: Policy):
        from orchestrate.loop.setup import PolicyServer

        if self.served is None:
            self.served = PolicyServer(policy, self.s.config, self.logs, self.s.key_file, switches=True).start()
        elif self.served.policy != policy:
            self.served.switch(policy)
        yield self.served

    def close(self) -> None:
        if self.served is not None:
            self.served.stop()


def curve_settings(record: dict) -> dict:
    """An evaluation's settings less what names its version: what every point of one curve shares."""
    return {k: v for k, v in record["settings"].items() if k not in ("target", "model", "version")}


def earlier_versions(out: Path, settings: dict, chosen: set[int], run: RunDir, names: list[str]) -> dict[int, dict]:
    """The records of `run`'s versions evaluated into OUT/vN before, with the same settings and every figure of
    `names`, that this call did not choose (a checkpoint deleted since, or a list that left them out): a
    curve's folder keeps its points. A folder whose record is of another version or run is no point."""
    found = {}
    for folder in out.glob("v*"):
        match = re.fullmatch(r"v(0|[1-9][0-9]*)", folder.name)
        if match is None or not folder.is_dir() or int(match[1]) in chosen:
            continue
        version, record = int(match[1]), _json(folder / "eval.json")
        saved = record.get("settings") or {}
        if (saved.get("version") == version and saved.get("target") == version_target(run, version)
                and curve_settings(record) == settings and all(n in record for n in names)):  # fmt: skip
            found[version] = record
    return found


def write_curve(s: Settings, records: list[dict]) -> dict:
    """--versions: each version's figures against when its checkpoint came in the run (the run's metrics'
    clock, with and without its own evaluations): OUT/curve.json, curve.md and curve.png. The versions
    evaluated into OUT before with the same settings stay on the curve (earlier_versions)."""
    from orchestrate.loop.eval_report import curve_markdown, plot_curve
    from orchestrate.loop.metrics import read_metrics, version_clock

    run = s.targets[0].run
    clock = version_clock(read_metrics(run.metrics_path))
    names = ["mean_reward"] + [f"pass@{k}" for k in s.ks] + [f"maj@{k}" for k in s.ks if k > 1]
    settings = curve_settings(records[0])
    by_version = {t.policy.version: r for t, r in zip(s.targets, records)}
    kept = earlier_versions(s.out, settings, set(by_version), run, names)
    by_version.update(kept)
    points = []
    for version, record in sorted(by_version.items()):
        seconds, training = clock.get(version, (None, None))
        points.append({"version": version,
                       "minutes": None if seconds is None else round(seconds / 60, 3),
                       "training_minutes": None if training is None else round(training / 60, 3),
                       **{n: record[n] for n in names if record.get(n)}})  # fmt: skip
    if kept:
        print(f"the curve keeps versions {spans(sorted(kept))} evaluated into {s.out} before (their weights are "
              "no longer asked for or on disk)", flush=True)  # fmt: skip
    curve = {"run": str(run.root), "settings": settings, "points": points}
    atomic_write_json(s.out / "curve.json", curve)
    atomic_write_text(s.out / "curve.md", curve_markdown(curve))
    plot_curve(curve, s.out / "curve.png")
    first = f"pass@{s.ks[0]}"
    best = max(points, key=lambda p: (p[first]["value"] if first in p else -1, -p["version"]))
    if first in best:
        print(f"curve of {len(points)} versions: best {first} {best[first]['value']:.3f} at version {best['version']} "
              f"({s.out / 'curve.md'})", flush=True)  # fmt: skip
    return curve


def write_comparison(s: Settings, folders: list[Path]) -> dict:
    from orchestrate.loop.eval_report import markdown, plot
    from orchestrate.loop.eval_stats import compare, summarize
    from orchestrate.loop.evaluation import task_results

    results = []
    for target, folder in zip(s.targets, folders):
        done = finished(tape_file(folder, target.policy.version), s.n)
        results.append(task_results([t for seed in s.seeds for t in done.get(seed, [])]))
    paired = compare(results[0], results[1], s.ks)
    summary_b = summarize(results[1], s.ks)
    a, b = s.targets
    record = {"a": s.record(a), "b": s.record(b), **paired}
    atomic_write_json(s.out / "compare.json", record)
    title = f"{b.text} against {a.text}"
    atomic_write_text(s.out / "compare.md", markdown(summary_b, title, compare=paired))
    plot(summary_b, s.out / "compare.png", compare=paired)
    for name in ["mean_reward"] + [f"pass@{k}" for k in s.ks]:
        f = paired.get(name)
        if f:
            lo, hi = f["ci95"]
            print(f"{name}: {f['a']:.3f} -> {f['b']:.3f}  B - A {f['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]")
    flipped = paired.get("flipped", {})
    print(f"flipped: {len(flipped.get('b_only', []))} tasks solved by B only, {len(flipped.get('a_only', []))} by A "
          f"only ({s.out / 'compare.md'})")  # fmt: skip
    return record


if __name__ == "__main__":
    sys.exit(main())
