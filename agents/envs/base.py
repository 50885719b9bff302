"""The environment protocol: GEM's (axon-rl/gem `gem/core.py`), so a GEM environment plugs in unchanged.

    observation, info = env.reset(seed)
    observation, reward, terminated, truncated, info = env.step(action_text)

An environment is seeded and deterministic given its seed and the actions it
is sent: a tape records the environment id, its options, the split, the run
seed and the episode seed, so replaying the recorded actions against a fresh
environment gives the same observations and rewards back.

Seeds. The loop asks for episode `seed = k` of a split ("train" or "test"):
train episodes are numbered 0, 1, 2, ... over the run, the held-out set is
episodes 0 .. n-1 of the test split. An environment is built knowing its
split and the run's seed (`make(options, split, run_seed)`), and keeps its
train and test episodes apart however it can (a data set's own splits, a
hash of the problem, disjoint seed ranges); `episode_seed` mixes the three
into one integer for environments that take a plain random seed.

What the loop reads from `info` (all optional):
- `success` (bool, on the last step): the episode solved its task. Without
  it, success is "the last reward was positive".
- `format_error` (bool): the action could not be parsed (no `\\boxed{}`, ...).
- anything else JSON-serialisable is kept on the tape as it is.

Exceptions raised by an environment are infrastructure failures: the
episode is flagged on its tape and left out of training and of group
statistics, never scored as wrong.

Optional capabilities. Beyond reset / step, an environment may offer:
- `test_size: int` (HasTestSize): how many distinct held-out episodes it
  has (None or absent: as many as asked for); `--eval.tasks` above it is
  refused before the run;
- `stop: list[str]` (HasStopStrings): where sampling stops (a tool call's
  closing tag, kept in the output);
- `tool_call(action) -> ToolCall | None` (ToolCalling): the tool call an
  action holds, which step() will run (agents.tools.ToolEnv);
- `async astep(action)` (SupportsAsyncStep): step() without blocking the
  event loop, for an environment whose step blocks (a tool run);
- `possible_agents` and `observe(agent)` (MultiAgent): GEM's multi-agent
  protocol, reset and step by dicts of agent ids, each agent a role of the
  run (agents.multi_agent);
- `workspace_files()` and `answer_from_workspace(folder)` (HasWorkspace):
  the episode's task as files a harness command works on
  (`--agent.command`, agents.harness), and the action that scores what it
  left in its workspace (the code environment: its solution file, tested).
They are declared as runtime-checkable Protocols (structural: an object has
a capability when it has the attribute, with a usable value), not as flags
on the registration, so a GEM environment or a user's `module:Class` needs
no change and no registration to offer one, and a wrapper offers what the
environment it wraps offers. `capabilities(env)` is the one place that
answers which ones an environment has; nothing else probes with getattr.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Env(Protocol):
    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]: ...


@runtime_checkable
class HasTestSize(Protocol):
    test_size: int | None  # distinct held-out episodes; None: as many as asked for


@runtime_checkable
class HasStopStrings(Protocol):
    stop: list[str]  # sampling stops at any of these (kept in the output)


@runtime_checkable
class ToolCalling(Protocol):
    def tool_call(self, action: str) -> Any: ...  # the ToolCall the action holds, or None


@runtime_checkable
class SupportsAsyncStep(Protocol):
    def astep(self, action: str) -> Awaitable[tuple[str, float, bool, bool, dict[str, Any]]]: ...


@runtime_checkable
class HasWorkspace(Protocol):
    def workspace_files(self) -> dict[str, str]: ...  # the episode's task files (after reset): path -> text

    def answer_from_workspace(self, folder: Any) -> str: ...  # the action that scores the folder's work


@runtime_checkable
class MultiAgent(Protocol):
    """GEM's multi-agent protocol (`gem/multiagent/`): reset and step take and give dicts by agent id, each
    agent a role of the run (agents.multi_agent plays it; --agent.roles binds each)."""

    possible_agents: list[str]

    def observe(self, agent: str) -> str: ...


@dataclass(frozen=True)
class Capabilities:
    """What an environment offers beyond reset / step (see the module docstring)."""

    test_size: int | None = None  # HasTestSize with a number
    stop: tuple[str, ...] = ()  # HasStopStrings, non-empty
    tool_calls: bool = False  # ToolCalling
    async_step: bool = False  # SupportsAsyncStep
    workspace: bool = False  # HasWorkspace
    agents: tuple[str, ...] = ()  # MultiAgent: its agent ids (GEM's possible_agents)


def capabilities(env: Any) -> Capabilities:
    """The optional capabilities `env` has. An attribute whose value cannot be used (a `stop` that is not a
    list of strings, a `test_size` that is not a positive whole number, a `tool_call` that is not callable)
    is no capability: a GEM environment's unrelated attribute of the same name is left alone."""
    size = env.test_size if isinstance(env, HasTestSize) else None
    stop = env.stop if isinstance(env, HasStopStrings) else None
    return Capabilities(
        test_size=size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None,
        stop=tuple(stop) if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop) else (),
        tool_calls=isinstance(env, ToolCalling) and callable(env.tool_call),
        async_step=isinstance(env, SupportsAsyncStep) and callable(env.astep),
        workspace=isinstance(env, HasWorkspace)
        and callable(env.workspace_files)
        and callable(env.answer_from_workspace),
        agents=tuple(env.possible_agents) if isinstance(env, MultiAgent) and callable(env.observe)
        and isinstance(env.possible_agents, (list, tuple)) and all(isinstance(a, str) for a in env.possible_agents)
        else (),
    )  # fmt: skip


class EnvError(ValueError):
    """A bad environment id or options; the message is one line naming what is wrong."""


def episode_seed(run_seed: int, split: str, seed: int, salt: str = "") -> int:
    """One 31-bit seed from (run seed, split, episode number): stable across runs and Python versions."""
    digest = hashlib.sha256(f"{salt}|{run_seed}|{split}|{seed}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def shuffled_passes(size: int, run_seed: int) -> Callable[[int], int]:
    """Train episode number -> item index for a data set of `size` items: one pass over all of them per
    epoch, in a fresh order per epoch seeded by the run seed."""
    orders: dict[int, list[int]] = {}

    def index_at(position: int) -> int:
        epoch, index = divmod(position, size)
        if epoch not in orders:
            order = list(range(size))
            random.Random(f"{run_seed}-{epoch}").shuffle(order)
            orders[epoch] = order
        return orders[epoch][index]

    return index_at


def jsonable(value: Any) -> Any:
    """`value` with everything that is not JSON turned into text (infos reach the tape)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    try:  # numpy scalars
        return value.item()
    except Exception:
        return repr(value)
