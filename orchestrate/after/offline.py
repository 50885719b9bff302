"""Train from saved tapes: `uv run -m orchestrate.after.offline --tapes RUN_DIR --out OUT [...]`.

    uv run -m orchestrate.after.offline --tapes runs/embedded --iterations 3-10 --out runs/offline1
    uv run -m orchestrate.after.offline --tapes a.jsonl b.jsonl --rescore --filter 'reward>=0' --out runs/off2
    uv run -m orchestrate.after.offline --tapes runs/embedded --reference smollm2 --train.kl_coef 0.05 --out runs/off3

1. read the tapes: a run directory's rollout tapes (tapes/iter_*.jsonl, within
   `--iterations`), or tape files;
2. optionally re-score them: `--rescore` sends each episode's recorded actions
   to a fresh environment from its seed and takes the rewards it gives now;
   `--reward module:function` scores each tape with your function (its value
   becomes the last turn's reward, earlier turns get 0);
3. optionally re-annotate reference log-probs with a model served by vLLM
   (`--reference MODEL`, a server started for it; or a running reference server,
   `--server.reference_url URL`), as the RL loop's reference pass does;
4. keep those that pass `--filter` (`all`, or a reward condition such as
   `reward>0`);
5. write them to OUT/tapes/iter_000001.jsonl (browsable with orchestrate.after.browse),
   their training samples to OUT/batches/000001.jsonl, and run the same
   finetune process as the RL loop (accelerate launch -m finetune.train) on
   them: OUT/checkpoints/000001/ is the trained model (with --train.lora.rank a new
   adapter, OUT/checkpoints/000001/adapter/: `orchestrate.after.merge OUT` folds it in; with --model ADAPTER_DIR
   that adapter trained on, on its base), OUT/metrics.jsonl and
   OUT/train_metrics.jsonl its metrics, OUT/logs/ the logs.

The learner trains with the run's algorithm (or `--train.algorithm`; grpo by
default: group advantages, reward minus the group's mean over its std):
under a group baseline samples train only where the attempts at one task
earned different rewards, and the recorded behaviour log-probs make the step
off-policy-correct (grpo's clipped importance ratio). A filter that leaves
every group with equal rewards would train nothing there, and is refused,
unless the advantages are the rewards themselves: `--filter 'reward>0'
--train.algorithm reinforce` (no baseline) is rejection-sampling fine-tuning.

Bad input is refused before anything loads, with one line naming the option
(exit status 2).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from contract.adapters import adapter_mismatch, adapter_options, is_adapter
from contract.cli import (
    OptionError,
    StrictParser,
    add_options,
    check_bools,
    check_finite,
    checked_span,
    error_line,
    given,
    nest,
    parse_value,
    refuse_repeated,
)
from contract.rundir import ADAPTER_CONFIG, RunDir
from finetune.config import TrainConfig, own_choices
from finetune.estimators import ESTIMATORS
from orchestrate.loop.config import ServerSection, TrainerSection
from orchestrate.loop.config_checks import ConfigError
from orchestrate.loop.progress import progress_bar
from orchestrate.loop.samples import save_tapes
from orchestrate.loop.trainer import TrainerError, TrainerProcess
from tapes.store import TapeFileError, read_tapes
from tapes.tape import Tape

if TYPE_CHECKING:
    from orchestrate.serving.vllm_server import RemoteServer

BY_URL = ("policy_urls", "reference_url", "api_key_file")  # server options of a run that offline does not inherit
FILTER = re.compile(r"^\s*reward\s*(<=|>=|==|=|<|>|!=)\s*(-?\d+(?:\.\d+)?)\s*$")
# -- inputs ---------------------------------------------------------------------


def parse_range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    return checked_span(text, "--iterations", "N or A-B (e.g. 3 or 3-10)", ConfigError)


def parse_filter(text: str) -> Callable[[Tape], bool]:
    if text.strip() == "all":
        return lambda tape: True
    m = FILTER.match(text)
    if not m:
        raise ConfigError(f"--filter: {text!r} is not 'all' or a reward condition such as 'reward>0'")
    op, value = m.group(1), float(m.group(2))
    compare = {"<": float.__lt__, ">": float.__gt__, "<=": float.__le__, ">=": float.__ge__,
               "=": float.__eq__, "==": float.__eq__, "!=": float.__ne__}[op]  # fmt: skip
    return lambda tape: tape.metadata.reward is not None and compare(float(tape.metadata.reward), value)


def tape_files(inputs: list[str], iterations: tuple[int, int] | None) -> list[Path]:
    """The tape files named by --tapes: run directories (their rollout tapes) or files."""
    files = []
    for text in inputs:
        path = Path(text)
        if path.is_dir():
            folder = RunDir(path).tapes if RunDir(path).tapes.is_dir() else path
            found = sorted(f for f in folder.glob("iter_*.jsonl") if re.fullmatch(r"iter_\d+", f.stem))
            if iterations:
                found = [f for f in found if iterations[0] <= int(f.stem.split("_")[1]) <= iterations[1]]
            if not found:
                within = f" within iterations {iterations[0]}-{iterations[1]}" if iterations else ""
                raise ConfigError(f"--tapes: {path} holds no rollout tape files (tapes/iter_*.jsonl){within}")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"--tapes: {path} is neither a run directory nor a tape file")
    return files


def load_reward(spec: str | None, rescore: bool):
    """The re-scoring to do: None (keep recorded rewards), the environment's (replayed), or module:function."""
    if spec is None:
        if not rescore:
            return None
        from agents.env_spec import rescore_episode

        return rescore_episode
    module_name, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"--reward: cannot import {spec!r} ({exc}); give it as module:function") from None
    if not callable(fn):
        raise ConfigError(f"--reward: {spec!r} is not callable")
    return fn


def rescore(tapes: list[Tape], reward_fn, progress: bool) -> None:
    from agents.agent import summarize
    from agents.env_spec import rescore_episode
    from tapes.tape import EnvObservation

    for tape in progress_bar(tapes, desc="rescore", unit="tape", disable=not progress, leave=False):
        if reward_fn is rescore_episode:
            rescore_episode(tape)
            continue
        result = reward_fn(tape)
        value, reason = (result.value, result.reason) if hasattr(result, "value") else (float(result), "")
        answers = [s for s in tape.steps if isinstance(s, EnvObservation) and s.turn > 0]
        for step in answers:  # the function's value is the episode's: on its last turn
            step.reward = 0.0
        if answers:
            answers[-1].reward = float(value)
            answers[-1].info["reason"] = reason
        summarize(tape)
        if not answers:
            tape.metadata.reward, tape.metadata.reward_reason = float(value), reason


def annotate(tapes: list[Tape], reference, server_config: ServerSection, out: Path, progress: bool) -> None:
    """Reference log-probs from a vLLM server: `reference` is a running one (given by URL, checked), or a model
    folder served by a server started for this and stopped after (orchestrate.loop.setup)."""
    from orchestrate.loop.setup import score_reference

    score_reference(tapes, reference, server_config, out / "logs" / "reference.log", progress=progress)


def reference_name(reference: Path | RemoteServer) -> str:
    return str(reference) if isinstance(reference, Path) else reference.url


def groups_with_signal(tapes: list[Tape], train) -> int:
    """Groups whose returns differ as the learner computes them (its groups, its trained episodes, shaped and
    discounted rewards): the only ones its group advantages train on."""
    from orchestrate.loop.dynamic_sampling import groups_of, has_signal

    return sum(has_signal(members, train) for members in groups_of(tapes).values())


# -- command line -----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = StrictParser(
        prog="uv run -m orchestrate.after.offline",
        description="Train from saved tapes: read, optionally re-score and re-annotate, filter, then run the "
        "finetune process on them once, writing a checkpoint and metrics.",
        epilog="--train.* values are parsed as JSON where they can be. When the tapes come from one run "
        "directory (RUN or files under RUN/tapes/), --model, --train.* and --trainer.* default to that run's config.json.",
    )
    parser.add_argument(
        "--tapes",
        nargs="+",
        required=True,
        metavar="RUN_DIR|FILE",
        help="a run directory (its tapes/iter_*.jsonl) or tape files",
    )
    parser.add_argument("--out", required=True, help="output directory (a new one, or one without a checkpoint)")
    parser.add_argument("--iterations", help="of a run directory, only these iterations: N or A-B")
    parser.add_argument(
        "--model",
        help="model to train (default: the run's initial policy, model.policy), or an "
        "adapter folder (e.g. RUN/checkpoints/N/adapter) to train on, on its base model",
    )
    parser.add_argument(
        "--rescore",
        action="store_true",
        help="re-score each episode: replay its actions against a fresh environment from its seed",
    )
    parser.add_argument(
        "--reward",
        metavar="MODULE:FUNCTION",
        help="re-score with this function (tape -> agents.rewards.Reward or a number)",
    )
    parser.add_argument(
        "--reference", metavar="MODEL", help="re-annotate reference log-probs with this model (served by vLLM)"
    )
    parser.add_argument(
        "--filter",
        default="all",
        help="which tapes to train on: 'all', or a reward condition like 'reward>0' [default: all]",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_options(parser, TrainConfig, "train.", defaults=False)
    add_options(parser, TrainerSection, "trainer.", defaults=False)
    add_options(
        parser,
        ServerSection,
        "server.",
        defaults=False,
        only=("max_model_len", "kv_cache_gib", "dtype", "reference_url", "api_key_file"),
        note="reference server: ",
    )
    return parser


def _section(cls, base: dict, overrides: dict, prefix: str):
    """The run's section `prefix` (from its config.json) with the command line's overrides, checked."""
    data = {k: v for k, v in base.items() if k in cls.model_fields}
    values = {dotted: parse_value(text) for dotted, text in overrides.items()}
    try:
        check_bools(values, cls, f"{prefix}.")
        nest({dotted.removeprefix(f"{prefix}."): value for dotted, value in values.items()}, data)
        section = cls.model_validate(data)
        check_finite(section.model_dump(), f"{prefix}.")
        return section
    except ValidationError as exc:
        raise ConfigError(error_line(exc, f"{prefix}.")) from None


@dataclass(frozen=True)
class Inputs:
    """What the command line asks for, checked: the tape files, the filter, the output directory, the
    learner's options, the trainer's launch, the reference server's options, the models, the re-scoring."""

    files: list[Path]
    keep: Callable[[Tape], bool]
    out: Path
    train: TrainConfig
    launch: TrainerSection
    server: ServerSection
    model_dir: Path
    reference: Path | RemoteServer | None  # a model folder to serve, or a running server (checked)
    reward_fn: Callable | None
    iterations: tuple[int, int] | None


def resolve(args: argparse.Namespace) -> Inputs:
    """Check every option before anything heavy loads; ConfigError names the first bad one."""
    iterations = parse_range(args.iterations)
    keep = parse_filter(args.filter)
    files = tape_files(args.tapes, iterations)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out} is a file")
    for f in files:  # writing there would overwrite the tapes read (OUT/tapes/iter_000001.jsonl) and the config
        run = f.resolve().parent.parent
        if out.resolve() in (run, *run.parents) or out.resolve() in f.resolve().parents:
            raise ConfigError(f"--out: {out} holds the tapes it would read ({f}); pass a new directory")
    if RunDir(out).newest_checkpoint():
        raise ConfigError(f"--out: {out} already holds a trained checkpoint; pass a new directory")
    saved = RunDir(out).config_path
    if saved.is_file():  # a failed offline command's folder is its own to try again; another run's is not
        try:
            ours = "tapes" in json.loads(saved.read_text())
        except (OSError, ValueError, TypeError):
            ours = False
        if not ours:
            raise ConfigError(f"--out: {out} holds another run (its config.json is not an offline command's); pass "
                              "a new directory")  # fmt: skip
    run_config = {}
    runs = {f.resolve().parent.parent for f in files}  # RUN/tapes/iter_N.jsonl -> RUN
    if len(runs) == 1 and (config_path := RunDir(runs.pop()).config_path).is_file():
        try:
            run_config = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--tapes: cannot read the run's {config_path} ({exc})") from None
    overrides = given(args)
    train_base = dict(run_config.get("train", {}))
    if "train.algorithm" in overrides and parse_value(overrides["train.algorithm"]) != train_base.get("algorithm"):
        train_base = own_choices(train_base)  # another algorithm: its own loss, estimator and settings
    model_name = args.model or (run_config.get("model") or {}).get("policy")
    adapter = None
    if args.model and is_adapter(args.model):  # train this adapter on, on its base model
        adapter = Path(args.model)
        if given_lora := sorted(k for k in overrides if k.startswith("train.lora.")):
            raise ConfigError(f"--{given_lora[0]}: --model {adapter} is an adapter, whose folder sets the LoRA "
                               "options; leave them out (or pass its base model as --model for a new adapter)")  # fmt: skip
        model_name = json.loads((adapter / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or (
            (run_config.get("model") or {}).get("policy"))  # fmt: skip
        if not model_name:
            raise ConfigError(f"--model: {adapter}/{ADAPTER_CONFIG} names no base model and no run config does")
        train_base["lora"] = adapter_options(adapter)
    train = _section(
        TrainConfig,
        train_base,
        {k: v for k, v in overrides.items() if k.startswith("train.")},
        "train",
    )
    trainer = _section(
        TrainerSection,
        run_config.get("trainer", {}),
        {k: v for k, v in overrides.items() if k.startswith("trainer.")},
        "trainer",
    )
    server = _section(
        ServerSection,  # the run's servers by URL are not this command's: only those given here
        {k: v for k, v in run_config.get("server", {}).items() if k not in BY_URL},
        {k: v for k, v in overrides.items() if k.startswith("server.")},
        "server",
    )
    if trainer.accelerate_config and not Path(trainer.accelerate_config).is_file():
        raise ConfigError(f"--trainer.accelerate_config: {trainer.accelerate_config} does not exist")
    from orchestrate.serving.models import ModelNotAvailable, resolve_model

    if not model_name:
        raise ConfigError("--model: no run config.json to take the initial policy from; pass --model")
    try:
        model_dir = resolve_model(model_name)
    except ModelNotAvailable as exc:
        raise ConfigError(f"--model: {exc}") from None
    if adapter is not None and (problem := adapter_mismatch(adapter, model_dir)):
        raise ConfigError(f"--model: the adapter does not fit its base model: {problem}")
    reward_fn = load_reward(args.reward, args.rescore)
    return Inputs(files, keep, out, train, trainer, server, Path(model_dir), check_reference_source(args, server),
                  reward_fn, iterations)  # fmt: skip


def check_reference_source(args: argparse.Namespace, server: ServerSection) -> Path | RemoteServer | None:
    """The reference to annotate with: --reference MODEL (its folder), or the server at --server.reference_url,
    which must answer, accept the key and serve a reference (as orchestrate.rl checks its servers by URL)."""
    from orchestrate.loop.preflight import remote_server
    from orchestrate.serving.auth import read_api_key
    from orchestrate.serving.models import ModelNotAvailable, resolve_model

    if args.reference and server.reference_url:
        raise ConfigError("--server.reference_url: give the reference once: --reference MODEL starts a server for "
                          "it, --server.reference_url URL uses one that runs")  # fmt: skip
    if args.reference:
        try:
            return Path(resolve_model(args.reference))
        except ModelNotAvailable as exc:
            raise ConfigError(f"--reference: {exc}") from None
    if server.reference_url:
        return remote_server("--server.reference_url", server.reference_url, "reference",
                             read_api_key(server.api_key_file))  # fmt: skip
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        refuse_repeated(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(argv)
        start = time.perf_counter()
        given = resolve(args)
        tapes = read(given.files, given.iterations, progress=not args.no_progress)
        read_count = len(tapes)
        tapes = score_and_filter(tapes, given.reward_fn, given.keep, args.filter, given.train,
                                 progress=not args.no_progress)  # fmt: skip
        require_ref = check_reference(tapes, given.train, given.reference)
        tapes = check_teacher_logprobs(tapes, given.train)
        check_trainable(tapes, require_ref and given.reference is None)
        run = open_out(given.out)
        run.save_config({
            "tapes": [str(f) for f in given.files], "iterations": args.iterations, "filter": args.filter,
            "rescore": args.rescore, "reward": args.reward,
            "reference": reference_name(given.reference) if given.reference is not None else None,
            "model": {"policy": str(given.model_dir)}, "train": given.train.model_dump(mode="json"),
            "trainer": given.launch.model_dump(mode="json"),
        })  # fmt: skip
        trainer = TrainerProcess(run, given.model_dir, given.train, given.launch)
        train_once(trainer, tapes, require_ref, given.reference, given.server,
                   f"{read_count} tapes read, {len(tapes)} kept by --filter {args.filter!r}",
                   progress=not args.no_progress,
                   record=lambda ckpt: record_metrics(run, trainer, tapes, read_count, start, ckpt))  # fmt: skip
    except OptionError as exc:  # any refusal of the input: one line, exit 2
        parser.exit(2, f"error: {exc}\n")
    except TrainerError as exc:
        cause = str(exc).split("\nFix the cause")[0]  # the loop's resume hint does not apply here
        print(f"error: {cause}\nFix the cause, then run the same command again (nothing was trained).", file=sys.stderr)
        return 1
    return 0


def read(files: list[Path], iterations: tuple[int, int] | None, progress: bool) -> list[Tape]:
    """The tapes of `files` within `iterations`; ConfigError when there are none or they are not rollout tapes."""
    tapes: list[Tape] = []
    try:
        for path in progress_bar(files, desc="read tapes", unit="file", disable=not progress, leave=False):
            tapes += [t for t in read_tapes(path)
                      if iterations is None or iterations[0] <= t.metadata.iteration <= iterations[1]]  # fmt: skip
    except TapeFileError as exc:
        raise ConfigError(f"--tapes: {exc}") from None
    if not tapes:
        raise ConfigError("--tapes: no tapes found in the given files")
    if problem := _missing_fields(tapes):
        raise ConfigError(f"--tapes: {problem}")
    return tapes


def score_and_filter(tapes: list[Tape], reward_fn, keep, filter_text: str, train, progress: bool) -> list[Tape]:
    """Re-score (when asked), refuse what cannot train (unscored, greedy), keep what passes --filter; refuse a
    kept set in which no group has differing rewards under a group baseline (it would train nothing)."""
    from agents.env_spec import rescore_episode

    if reward_fn is rescore_episode:
        from agents.program import played_by_program

        if programs := sum(played_by_program(t) for t in tapes):
            raise ConfigError(f"--rescore: {programs} tapes were played by an agent program (--agent.program), whose "
                              "steps the environment did not answer one by one; score them with --reward "
                              "module:function instead")  # fmt: skip
    if reward_fn is not None:
        rescore(tapes, reward_fn, progress)
    if unscored := sum(t.metadata.reward is None for t in tapes):
        raise ConfigError(f"--rescore: {unscored} tapes have no reward; re-score them with --rescore or --reward")
    if greedy := sum(1 for t in tapes if any(c.sampling.temperature <= 0 for c in t.llm_calls)):
        raise ConfigError(f"--tapes: {greedy} tapes were sampled at temperature 0 (evaluation tapes?): their "
                           "log-probs are not of a distribution the learner can train against; leave them out")  # fmt: skip
    kept = [t for t in tapes if keep(t)]
    if not kept:
        raise ConfigError(f"--filter: no tape of {len(tapes)} passes {filter_text!r}")
    teacher = train.teacher_coef or train.teacher_topk_coef
    group_only = "group" in ESTIMATORS[train.estimator].needs and not train.loss_spec.critic and not teacher
    if group_only and not groups_with_signal(kept, train):  # the reward's advantage is all there is, and it is 0
        raise ConfigError(f"--filter: every group of the {len(kept)} kept tapes has equal rewards, so every "
                           "advantage is 0 and training would change nothing; keep the other attempts too "
                           "(e.g. --filter all), re-score (--rescore / --reward), or train on the rewards themselves "
                           "(--train.algorithm reinforce, no baseline: rejection-sampling fine-tuning)")  # fmt: skip
    return kept


def check_trainable(tapes: list[Tape], require_ref: bool) -> None:
    """ConfigError, before anything is written or started, when no tape gives a sample or one is malformed (the
    reference's log-probs checked when they are not to be added)."""
    from orchestrate.loop.samples import SampleError, no_samples, tapes_to_samples

    try:
        if not tapes_to_samples(tapes, require_ref):
            raise no_samples(tapes)
    except SampleError as exc:
        raise ConfigError(f"--tapes: {exc}") from None


def check_reference(tapes: list[Tape], train, reference: Path | RemoteServer | None) -> bool:
    """Whether training needs reference log-probs; ConfigError when the tapes lack them and none will be added."""
    # a tape that failed (a fork that did not come back included) is never scored nor trained
    missing = sum(1 for t in tapes if not t.metadata.error for c in t.llm_calls
                  if c.output_token_ids and c.ref_logprobs is None)  # fmt: skip
    if train.needs_reference and missing and reference is None:
        what = "--train.kl_coef" if train.kl_coef > 0 else "--train.ppo.kl_in_reward"
        raise ConfigError(f"{what}: {missing} LLM calls have no reference log-probs; pass --reference MODEL "
                           f"(or --server.reference_url URL), or "
                           f"{what} 0")  # fmt: skip
    return train.needs_reference


def check_teacher_logprobs(tapes: list[Tape], train) -> list[Tape]:
    """With --train.teacher_coef (distillation from the tapes), every sampled call has the teacher's log-probs
    (recorded by a run with --teacher.model), and with --train.teacher_topk_coef its top-k (--teacher.topk);
    ConfigError otherwise. The tapes a run left out of its batches (dynamic sampling's dropped groups: the
    teacher never scored them) are left out here too, said in a line."""
    wanted = [(option, field, what) for option, field, what, coef in (
        ("--train.teacher_coef", "teacher_logprobs", "teacher log-probs (a run with --teacher.model records them)",
         train.teacher_coef),
        ("--train.teacher_topk_coef", "teacher_top_ids", "teacher top-k (a run with --teacher.topk records it)",
         train.teacher_topk_coef),
    ) if coef]  # fmt: skip
    if not wanted:
        return tapes

    def unscored(tape: Tape, field: str) -> int:  # a failed tape (a diverged fork) is never scored nor trained
        return 0 if tape.metadata.error else sum(1 for c in tape.llm_calls if c.output_token_ids and
                                                 getattr(c, field) is None)  # fmt: skip

    from orchestrate.loop.dynamic_sampling import dropped

    option = wanted[0][0]
    kept = [t for t in tapes if not (dropped(t) and any(unscored(t, field) for _, field, _ in wanted))]
    if len(kept) < len(tapes):
        print(f"{option}: {len(tapes) - len(kept)} tapes left out: dropped from their run's batches by "
              "dynamic sampling, never scored by the teacher", file=sys.stderr)  # fmt: skip
    for option, field, what in wanted:
        if missing := sum(unscored(t, field) for t in kept):
            raise ConfigError(f"{option}: {missing} LLM calls have no {what}; train on such tapes, or set it "
                              "to 0")  # fmt: skip
    return kept


def open_out(out: Path):
    """The output run directory, created and locked (one command per directory, until this process ends)."""
    from orchestrate.loop.preflight import check_run_dir_path
    from orchestrate.loop.run_lock import RunDirInUse, RunLock

    global _lock
    try:
        check_run_dir_path(out, "--out")
        out.mkdir(parents=True, exist_ok=True)
        _lock = RunLock(out).acquire()  # released when the process exits
    except (RunDirInUse, OSError) as exc:  # check_run_dir_path's refusals name --out already
        raise ConfigError(f"--out: {exc}") from None
    run = RunDir(out)
    run.create()
    return run


_lock = None


def train_once(
    trainer,
    tapes: list[Tape],
    require_ref: bool,
    reference: Path | RemoteServer | None,
    server,
    summary: str,
    progress: bool,
    record: Callable[[Path], None] = lambda checkpoint: None,
) -> Path:
    """Annotate (with --reference or --server.reference_url), write the tapes and their samples as iteration 1, train,
    `record` the metrics line (and print the checkpoint) as soon as it is published, before the trainer is stopped
    (which can take seconds: a command stopped then keeps its line), and return the checkpoint. The trainer loads its model while
    the reference server starts and scores."""
    from orchestrate.loop.samples import SampleError, write_samples

    run = trainer.run
    tape_path = run.iteration_tapes(1)
    for stale in (tape_path, run.batch(1)):  # of an earlier attempt that never trained
        stale.unlink(missing_ok=True)
    try:
        if reference is not None:
            trainer.start()
            annotate(tapes, reference, server, run.root, progress)
        save_tapes(tape_path, tapes)
        try:
            write_samples(run.batch(1), tapes, require_ref=require_ref)
        except SampleError as exc:
            raise ConfigError(f"--tapes: {exc}") from None
        print(f"{summary} ({groups_with_signal(tapes, trainer.train)} groups with differing returns); training "
              f"{trainer.model_dir.name} ...", flush=True)  # fmt: skip
        if not trainer.started:
            trainer.start()
        checkpoint = trainer.wait_for_checkpoint(1, progress=progress, desc="train")
        record(checkpoint)
        return checkpoint
    finally:
        trainer.stop()


def record_metrics(run, trainer, tapes: list[Tape], read_count: int, start: float, checkpoint: Path) -> None:
    from orchestrate.loop.metrics import append_metrics, rollout_metrics

    record = {"iteration": 1, "tapes_read": read_count, **rollout_metrics(tapes), **trainer.iteration_metrics(1),
              "time_total": round(time.perf_counter() - start, 3)}  # fmt: skip
    append_metrics(run.metrics_path, record)
    print(
        f"checkpoint: {checkpoint}  (loss {record.get('train_loss', float('nan')):+.4f}, "
        f"{record.get('train_steps', 0)} optimizer steps)"
    )
    if (checkpoint / "adapter").is_dir():
        print(f"its LoRA adapter: {checkpoint / 'adapter'} (one model folder: uv run -m orchestrate.after.merge "
              f"{run.root} --out DIR)")  # fmt: skip


def _missing_fields(tapes: list[Tape]) -> str | None:
    """What keeps these tapes from training (no steps, no sampled LLM call), as one line; None if nothing."""
    no_steps = sum(not t.steps for t in tapes)
    no_calls = sum(not any(c.output_token_ids for c in t.llm_calls) for t in tapes)
    if no_steps or no_calls == len(tapes):
        what = f"{no_steps} of {len(tapes)} tapes have no steps" if no_steps else "no tape holds a sampled LLM call"
        return f"{what}: these are not rollout tapes of tapeloop (RUN/tapes/iter_*.jsonl); nothing to train on"
    return None


if __name__ == "__main__":
    sys.exit(main())
