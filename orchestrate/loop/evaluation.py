"""Evaluation: n samples of each held-out task, played and scored one way for the loop and for `orchestrate.eval`.

`play_tasks` plays every sample of every task at once (bounded by the client's concurrency, so vLLM batches
them and the samples of a task share their prompt's KV cache) and hands each task's tapes over as soon as
its last sample ends (eval appends them to its file, `Appender`: a killed evaluation resumes without playing
them again, `finished`). `task_results` turns tapes into what orchestrate.loop.eval_stats scores: per task, the samples'
rewards, successes and answers (an environment that puts `answer` in its last observation's info has
answers a majority vote can compare), infrastructure failures counted apart, never scored.

The loop (`Evaluation`): before the first iteration and every `eval.every` iterations, the test split's first
tasks (`eval.tasks`, else the environment's whole test set) played `eval.samples` times each at
`eval.temperature`, saved as RUN/tapes/eval_NNNNNN.jsonl and summarised as the `eval_*` metrics (with more
than one sample, `eval_pass@k` too).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

from agents.agent import role_rewards
from agents.env_spec import EnvSpec
from agents.envs import capabilities
from contract.durable import atomic_write_text
from contract.rundir import RunDir
from orchestrate.loop.config import RLConfig
from orchestrate.loop.eval_stats import NO_ANSWER, TaskResult, ks_for, summarize
from orchestrate.loop.metrics import rollout_metrics
from orchestrate.loop.progress import progress_bar
from orchestrate.loop.rollouts import RolloutContext, play
from orchestrate.loop.samples import save_tapes
from tapes.store import read_tapes
from tapes.tape import EnvObservation, SamplingParams, Tape

# play(spec, seeds, samples, iteration, sampling, desc) -> the tapes (the loop plays them on its policy servers)
Play = Callable[[EnvSpec, list[int], int, int, SamplingParams, str], list[Tape]]


def eval_size(config: RLConfig) -> int:
    """Held-out episodes per evaluation: eval.tasks, else the environment's whole test set (500 if unbounded)."""
    if config.eval.tasks is not None:
        return config.eval.tasks
    return test_size(EnvSpec.from_config(config, "test")) or 500


def test_size(spec: EnvSpec) -> int | None:
    """How many tasks the split holds, when the environment says (None: unbounded, procedural)."""
    return capabilities(spec.make()).test_size


async def play_tasks(
    context: RolloutContext,
    seeds: list[int],
    samples: int,
    *,
    done: Callable[[int, list[Tape]], None] | None = None,
    progress: bool = True,
    desc: str = "eval",
) -> list[Tape]:
    """`samples` episodes of each task seed, all in flight at once; the tapes in task order. `done(seed,
    tapes)` is called as each task's last sample ends. An environment or agent failure stays on its tape
    (metadata.error); a server failure raises (LLMError)."""
    bar = progress_bar(total=len(seeds) * samples, desc=desc, unit="episode", disable=not progress, leave=False)

    async def episode(seed: int) -> Tape:
        tape = await play(context, seed, context.new_tape(seed))
        bar.update(1)
        return tape

    async def task(seed: int) -> list[Tape]:
        tapes = list(await asyncio.gather(*(episode(seed) for _ in range(samples))))
        if done is not None:
            done(seed, tapes)
        return tapes

    try:
        per_task = await asyncio.gather(*(task(seed) for seed in seeds))
    finally:
        bar.close()
    return [tape for tapes in per_task for tape in tapes]


def final_info(tape: Tape) -> dict:
    """The info of the environment's last answer on the tape ({} if it never answered)."""
    answers = [s for s in tape.steps if isinstance(s, EnvObservation) and s.turn > 0]
    return answers[-1].info if answers else {}


def task_results(tapes: list[Tape], role: str | None = None) -> list[TaskResult]:
    """Per task (in first-seen order): the rewards, successes and answers of its samples that ran, and how many
    failed (infrastructure). Answers are compared by majority votes when the environment reports them
    (`info["answer"]` on its last observation; a sample without one, truncated say, answered nothing);
    else they are None. With `role` (several agents in one episode, agent.roles): that role's reward
    (agents.agent.role_rewards; 0 where it made no call) and success (its reward above 0), no answers."""
    by_task: dict[str, list[Tape]] = {}
    for tape in tapes:
        by_task.setdefault(tape.metadata.task_id or tape.metadata.id, []).append(tape)
    infos = {id(t): final_info(t) for t in tapes if not t.metadata.error}
    # an environment that reports answers (on any task): a sample without one (truncated, unparsable) answered
    # nothing, NO_ANSWER, which casts no vote
    comparable = any("answer" in info for info in infos.values())
    results = []
    for task_id, group in by_task.items():
        ok = [t for t in group if not t.metadata.error]
        if role is not None:
            rewards = [role_rewards(t).get(role, 0.0) for t in ok]
            results.append(TaskResult(task_id=task_id, rewards=rewards, successes=[r > 0 for r in rewards],
                                      answers=[None] * len(ok), errors=len(group) - len(ok)))  # fmt: skip
            continue
        results.append(TaskResult(
            task_id=task_id,
            rewards=[float(t.metadata.reward or 0.0) for t in ok],
            successes=[bool(t.metadata.success) if t.metadata.success is not None else (t.metadata.reward or 0) > 0
                       for t in ok],
            answers=[str(infos[id(t)].get("answer", NO_ANSWER)) if comparable else None for t in ok],
            errors=len(group) - len(ok),
        ))  # fmt: skip
    return results


def pass_metrics(tapes: list[Tape], samples: int, prefix: str = "eval_") -> dict[str, float]:
    """pass@k (and maj@k where answers compare) for k = 2, 4, ... samples, as flat metrics (pass@1 is
    success_rate); {} for one sample."""
    if samples < 2:
        return {}
    summary = summarize([r for r in task_results(tapes) if r.rewards], ks_for(samples))
    return {f"{prefix}{name}": summary[name]["value"] for name in summary
            if name.startswith(("pass@", "maj@")) and name != "pass@1" and summary[name] is not None}  # fmt: skip


class Evaluation:
    def __init__(self, config: RLConfig, run_dir: RunDir):
        self.every = config.eval.every
        self.run = run_dir
        self.spec = EnvSpec.from_config(config, "test")
        self.episodes = eval_size(config)
        self.samples = config.eval.samples
        self.sampling = SamplingParams(temperature=config.eval.temperature, max_tokens=config.eval.max_tokens)

    def due(self, iteration: int) -> bool:
        """Whether the iteration is evaluated (0: before training)."""
        return bool(self.every) and iteration % self.every == 0

    def __call__(self, iteration: int, play: Play) -> dict:
        """The eval_* metrics of the weights served after `iteration`; a resumed run reuses saved tapes."""
        path = self.run.eval_tapes(iteration)
        if path.exists():
            tapes = list(read_tapes(path))
        else:
            tapes = play(self.spec, list(range(self.episodes)), self.samples, iteration, self.sampling,
                         f"eval after {iteration}")  # fmt: skip
            save_tapes(path, tapes)
        return {**rollout_metrics(tapes, prefix="eval_"), **pass_metrics(tapes, self.samples)}


# -- orchestrate.eval's tape file: each finished task appended, the finished tasks read back on resume -----


def tape_file(folder: Path, version: int) -> Path:
    """The tapes of an evaluation of `version` written into `folder` (as the loop names its own)."""
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
