"""An agent is a program: `--agent.program pkg.module:name` names an async callable that plays one episode.

    async def play(task: ProgramTask, client: openai.AsyncOpenAI) -> float | str | None: ...

`task` is the episode's task: the environment's first observation (`task.observation`), its seed and info,
and what the program may do besides calling the LLM: send an action to the environment (`await
task.step(text)`, recorded on the tape with its reward) and run Python in the run's sandbox (`await
task.run_python(code)`). `client` is an OpenAI client bound to this episode: its calls go through the
orchestrator's gateway to the policy servers and are recorded token-exactly on the episode's tape
(orchestrate.gateway). A program in another process or language uses the same gateway by URL:
`task.base_url`, `task.api_key` and `task.model` are what an OpenAI client needs.

What it returns decides the reward:
- a number: the episode's reward (on the last call's turn; with roles, on each role's last call's turn);
- with roles (`--agent.roles`, several agents in one episode, each the `model` name it sends): a dict of
  role -> number, each role's own reward (on its last call's turn);
- a string: sent to the environment as the final answer; the environment's reward;
- None: the rewards the program gave stand (`task.step`, or `task.reward(value)` for the latest call's
  turn: per-turn rewards); with none given, a reward function of the tape decides (`--program.reward
  MODULE:FUNCTION`, `def reward(tape) -> float`), else the last reply's text goes to the environment.

`load_program` checks the path before a run starts: it must import, name an `async def` taking two
positional parameters; anything else is refused in one line (exit 2 at the command line). `load_reward`
checks a reward function the same way (one parameter, async or not).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

Program = Callable[..., Awaitable[Any]]


class ProgramError(ValueError):
    """The program path cannot be used; the message says why, in one line."""


def load_program(path: str) -> Program:
    """The async callable `pkg.module:name` names, checked for its shape: (task, client)."""
    return _load(path, ("task", "client"), need_async=True)


def load_reward(path: str, workspace: bool = False) -> Callable[[Any], Any]:
    """A reward function of the tape, `pkg.module:name`: `def reward(tape) -> float` (or async); with
    `workspace`, a harness command's: `def reward(tape, workspace) -> float` (agents.harness)."""
    return _load(path, ("tape", "workspace") if workspace else ("tape",), need_async=False)


def _load(path: str, parameters: tuple[str, ...], need_async: bool) -> Callable[..., Any]:
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ProgramError(f"{path!r}: expected MODULE:CALLABLE, e.g. agents.programs.openai_tools:play")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure refuses the path, naming it
        raise ProgramError(f"{path!r}: module {module_name!r} does not import ({type(exc).__name__}: {exc})") from None
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ProgramError(f"{path!r}: module {module_name!r} has no {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ProgramError(f"{path!r}: {attribute!r} is not callable")
    call = target if inspect.isfunction(target) or inspect.ismethod(target) else type(target).__call__
    shape = f"({', '.join(parameters)})"
    if need_async and not inspect.iscoroutinefunction(call):
        raise ProgramError(f"{path!r}: {attribute!r} must be an async function (async def {attribute}{shape})")
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        raise ProgramError(f"{path!r}: the signature of {attribute!r} cannot be read") from None
    try:
        signature.bind(*[None] * len(parameters))
    except TypeError:
        count = "one argument" if len(parameters) == 1 else f"{len(parameters)} arguments"
        raise ProgramError(f"{path!r}: {attribute!r} must take {count} {shape}; it takes {signature}") from None
    return target


@dataclass
class StepResult:
    """The environment's answer to an action."""

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class ProgramTask:
    """What a program gets for one episode besides its client."""

    observation: str  # the environment's first observation: the task
    seed: int
    info: dict[str, Any]
    model: str  # the name to pass as `model` (with roles: the first role's)
    base_url: str  # this episode's OpenAI-compatible base URL (".../v1")
    api_key: str  # the run's key: `Authorization: Bearer KEY`
    _step: Callable[[str], Awaitable[StepResult]] | None = field(default=None, repr=False)
    _run_python: Callable[[str], Any] | None = field(default=None, repr=False)
    _reward: Callable[[float, str | None], None] | None = field(default=None, repr=False)
    stepped: bool = False  # the environment was stepped or a reward given: those rewards stand
    # the environment's task as files, and the action that scores a folder's work (HasWorkspace): for a harness
    files: dict[str, str] = field(default_factory=dict)
    _answer_from: Callable[[Any], str] | None = field(default=None, repr=False)
    _record: Callable[[Any], None] | None = field(default=None, repr=False)  # a step onto the tape, in order
    _calls: Callable[[], int] | None = field(default=None, repr=False)
    _tape: Any = field(default=None, repr=False)
    gateway_socket: str | None = None  # the gateway's unix socket (a harness in a network namespace reaches it)
    roles: list[str] = field(default_factory=list)  # the run's roles (agent.roles): the `model` names to send

    @property
    def tape(self) -> Any:
        """The episode's tape so far (read it; the gateway and the environment write it)."""
        return self._tape

    def calls(self) -> int:
        """The calls this episode has made through the gateway so far."""
        return self._calls() if self._calls is not None else 0

    def record(self, step: Any) -> None:
        """Put a step on the tape, in order with the episode's calls (a harness's output)."""
        if self._record is None:
            raise RuntimeError("this episode keeps no steps of the program's")
        self._record(step)

    def answer_from(self, folder: Any) -> str | None:
        """The action that scores the work in `folder` (the environment's, where it has a workspace), or None."""
        return self._answer_from(folder) if self._answer_from is not None else None

    def reward(self, value: float, role: str | None = None) -> None:
        """Give the latest call's turn a reward (per-turn rewards; they add up to the episode's); with `role`
        (agent.roles), that role's latest call's turn."""
        if self._reward is None:
            raise RuntimeError("this episode takes no rewards")
        value = finite_reward(value, "task.reward")
        if role is not None and role not in self.roles:
            raise ValueError(f"task.reward: {role!r} is not a role of this run ({', '.join(self.roles) or 'none'})")
        self.stepped = True
        self._reward(value, role)

    async def step(self, action: str) -> StepResult:
        """Send `action` to the environment; its answer and reward go on the tape."""
        if self._step is None:
            raise RuntimeError("this episode has no environment to step")
        self.stepped = True
        return await self._step(action)

    async def run_python(self, code: str, max_chars: int = 1000) -> str:
        """Run `code` in the run's sandbox (bubblewrap, limits, no network); what it printed, with its errors
        and how it ended, as `agents.sandbox.SandboxResult.observation` words it (the last `max_chars` of
        each stream). SandboxInfraError when the sandbox itself failed: left uncaught, the episode is an
        infrastructure failure (never something the model is shown or trained on)."""
        if self._run_python is None:
            raise RuntimeError("this episode has no sandbox")
        result = await asyncio.to_thread(self._run_python, code)
        if result.infra_error:  # the sandbox failed, not the code: an infrastructure failure unless caught
            from agents.sandbox import SandboxInfraError

            raise SandboxInfraError(f"the sandbox could not run the code: {result.infra_error}")
        return result.observation(max_chars).rstrip("\n")


def finite_reward(value: Any, source: str) -> float:
    """`value` as a reward: a real number (a numpy scalar too), finite; else ValueError or TypeError naming
    `source` (a NaN would spoil its group's statistics, an infinity every advantage of the batch)."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{source}: got a {type(value).__name__}; expected a number")
    if not math.isfinite(float(value)):
        raise ValueError(f"{source}: {float(value)} is not a finite number")
    return float(value)


def played_by_program(tape) -> bool:
    """Was this tape played by an agent program (its messages are on it), not by the built-in agent?"""
    from tapes.tape import AgentMessage, ProgramMessage

    return any(isinstance(step, (ProgramMessage, AgentMessage)) for step in tape.steps)
