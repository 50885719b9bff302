"""Tools an agent calls inside an episode, and the environment wrapper that answers them (GEM's ToolEnvWrapper).

The python tool (GEM's python_tool): the agent writes `<python>code</python>`; sampling stops at the
closing tag (kept in the output), the code runs in the sandbox (agents.sandbox) and its output comes
back as the next observation, `<output>...</output>`; the agent goes on until it answers without a
tool call (e.g. `\\boxed{42}`), which the wrapped environment scores, or reaches its turn limit.

The search tool (GEM's search_tool, Search-R1's format): `<search>query</search>` is answered with the
best passages of a local corpus (agents.search, BM25), `<information>Doc 1 (Title: ...) text
Doc 2 ...</information>`. It runs in-process: the query is only text to look up.

A replay re-runs the python tool (the sandbox is deterministic given the code) but answers searches from
the results the tape recorded (`RecordedTool`): the corpus may have changed or be elsewhere, and a tape
must replay the same.

A model tuned for its chat template's tool calls (Qwen2.5's, Hermes's) may write one in that format instead:
`<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>` naming one of the episode's tools,
its one string argument being the code or the query. ToolEnv takes that too (sampling also stops at
`</tool_call>`), so the same tools serve both kinds of model.

A tool call costs a turn and earns reward 0. A timeout, a crash or a limit reached is part of the
observation. A sandbox that could not start raises ToolInfraError: the episode is then an
infrastructure failure (flagged on its tape, left out of training and of group statistics).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from agents.sandbox import Sandbox, SandboxConfig, SandboxInfraError, SandboxResult
from agents.search import Retriever, SearchConfig

if TYPE_CHECKING:
    from tapes.tape import Tape


class ToolInfraError(SandboxInfraError):
    """The tool itself failed (not the agent's code): an infrastructure failure of the episode."""


@dataclass
class ToolCall:
    tool: str
    text: str  # what the agent asked: the code, the query


class Tool(Protocol):
    """What ToolEnv needs of a tool."""

    name: str
    stop: str  # where sampling stops: the end of a call (kept in the output)
    answered_from_tape: bool  # a replay answers its calls from the tape's results (RecordedTool), not re-run

    def instruction(self) -> str: ...

    def parse(self, action: str) -> ToolCall | None: ...

    def execute(self, call: ToolCall) -> tuple[str, dict[str, Any]]: ...

    # and, for a tool that a replay runs (PythonTool, RecordedTool): replay_note(calls) -> how it answered them


TOOLS: dict[str, type] = {}  # name -> tool class: the one list of tools (--env.tools, EnvSpec.make, --help)


def register_tool(cls: type) -> type:
    """A tool class into TOOLS under its `name`. It says what it does (`summary`, for --help), whether it runs
    model-written code (`runs_code`: the sandbox is checked before a run), and how a spec builds it
    (`for_spec(spec, load)`, `load` False when a replay answers it from the tape)."""
    if cls.name in TOOLS:
        raise ValueError(f"tool {cls.name!r} is registered twice")
    TOOLS[cls.name] = cls
    return cls


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


_PYTHON = re.compile(r"<python>(.*?)</python>", re.DOTALL)


@register_tool
class PythonTool:
    """Runs the first complete `<python>...</python>` block of an action in the sandbox."""

    name = "python"
    summary = "<python>code</python>, run in the sandbox, its output as the next observation"
    runs_code = True
    stop = "</python>"
    answered_from_tape = False  # a replay re-runs the code: the sandbox is deterministic given it

    def __init__(self, sandbox: Sandbox | None = None, observation_chars: int = 1000):
        self.sandbox = sandbox or Sandbox(SandboxConfig())
        self.observation_chars = observation_chars

    @classmethod
    def for_spec(cls, spec, load: bool = True) -> PythonTool:
        return cls(spec.sandbox())

    def instruction(self) -> str:
        return (
            "You may run Python: write <python>code</python> and you will get its output back as "
            "<output>...</output>; print what you need."
        )

    def parse(self, action: str) -> ToolCall | None:
        match = _PYTHON.search(action)
        return ToolCall(self.name, match.group(1).strip("\n")) if match else None

    def execute(self, call: ToolCall) -> tuple[str, dict[str, Any]]:
        """(observation, info) for one call; ToolInfraError when the sandbox could not run it."""
        result: SandboxResult = self.sandbox.run(call.text)
        if result.infra_error:
            raise ToolInfraError(f"python tool: {result.infra_error}")
        text = result.observation(self.observation_chars).rstrip("\n")
        observation = f"<output>\n{text}\n</output>"
        return observation, {
            "tool": self.name,
            "code": call.text,
            "stdout": result.stdout,
            "stderr": result.stderr,
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
            "output_truncated": result.output_truncated,
            "tool_error": not result.ok,
        }  # fmt: skip (no run time here: the tape holds what replays the same)

    def replay_note(self, calls: int) -> str:
        return f"re-ran {_plural(calls, 'python tool call')} (deterministic, in the sandbox)"


_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
_EMPTY_QUERY = "[empty query: write what to look up between <search> and </search>]"


@register_tool
class SearchTool:
    """Answers the first complete `<search>query</search>` of an action with the best passages of a corpus."""

    name = "search"
    summary = "<search>query</search>, the best passages of --env.search.corpus as the next observation"
    runs_code = False
    stop = "</search>"
    answered_from_tape = True  # on replay: see RecordedTool

    def __init__(self, retriever: Retriever | None, config: SearchConfig | None = None):
        self.retriever = retriever  # None: parse only (a replay answers from the tape)
        self.config = config or SearchConfig()

    @classmethod
    def for_spec(cls, spec, load: bool = True) -> SearchTool:
        """The spec's corpus, loaded once per spec (and per process for an unchanged corpus: agents.search);
        not loaded when a replay answers every search from the tape."""
        from agents.search import load_retriever

        config = SearchConfig(**spec.search_options)
        if load and spec._retriever is None:
            if not config.corpus:
                raise ValueError("the search tool needs a corpus: set --env.search.corpus")
            spec._retriever = load_retriever(config.corpus, config.cache_dir)
        return cls(spec._retriever if load else None, config)

    def instruction(self) -> str:
        return (
            "You may search a knowledge source: write <search>query</search> and you will get the best "
            "passages back as <information>...</information>."
        )

    def parse(self, action: str) -> ToolCall | None:
        match = _SEARCH.search(action)
        return ToolCall(self.name, match.group(1).strip()) if match else None

    def execute(self, call: ToolCall) -> tuple[str, dict[str, Any]]:
        """(observation, info) for one query; an empty query is an error observation for the agent."""
        info: dict[str, Any] = {"tool": self.name, "query": call.text, "ids": [], "scores": [],
                                "output_truncated": False, "tool_error": False}  # fmt: skip
        if not call.text:
            info["tool_error"] = True
            return f"<information>{_EMPTY_QUERY}</information>", info
        if self.retriever is None:
            raise ToolInfraError("search tool: no corpus loaded")
        hits = self.retriever.search(call.text, self.config.top_k)
        info.update(ids=[p.id for p, _ in hits], scores=[s for _, s in hits])
        body = (
            "\n".join(
                f"Doc {i} (Title: {p.title}) {p.text}" if p.title else f"Doc {i} {p.text}"
                for i, (p, _) in enumerate(hits, start=1)
            )
            or "[no passage matches the query]"
        )
        if len(body) > self.config.observation_chars:
            body, info["output_truncated"] = body[: self.config.observation_chars] + " [... cut]", True
        return f"<information>{body}</information>", info


class RecordedTool:
    """A tool whose calls are answered from the results a tape recorded, in order (a replay of tools that are
    not re-run, e.g. search). A call that is not the one recorded raises ToolInfraError: the replay differs.
    `live_after` (a fork, whose tape is cut where it goes live): the calls after the recorded ones go to the
    tool itself."""

    answered_from_tape = True

    def __init__(self, tool: Tool, tape: Tape, live_after: bool = False):
        from tapes.tape import ToolCallAction, ToolResultObservation

        self.tool, self.name, self.stop, self.live_after = tool, tool.name, tool.stop, live_after
        calls = {s.turn: s.call for s in tape.steps if isinstance(s, ToolCallAction) and s.tool == tool.name}
        self.results = [
            (calls[s.turn], s.text, s.info)
            for s in tape.steps
            if isinstance(s, ToolResultObservation) and s.tool == tool.name and s.turn in calls
        ]
        self.position = 0

    def instruction(self) -> str:
        return self.tool.instruction()

    def parse(self, action: str) -> ToolCall | None:
        return self.tool.parse(action)

    def execute(self, call: ToolCall) -> tuple[str, dict[str, Any]]:
        if self.position >= len(self.results):
            if self.live_after:
                return self.tool.execute(call)
            raise ToolInfraError(f"replay: {self.name} call {self.position + 1} ({call.text!r}) is not on the tape, "
                                 f"which recorded {len(self.results)}")  # fmt: skip
        recorded, observation, info = self.results[self.position]
        if recorded != call.text:
            raise ToolInfraError(f"replay: {self.name} call {self.position + 1} asks {call.text!r}; the tape "
                                 f"recorded {recorded!r}")  # fmt: skip
        self.position += 1
        info = {k: v for k, v in info.items() if k not in ("tool_calls", "tool_errors")}  # ToolEnv counts anew
        return observation, info

    def replay_note(self, calls: int) -> str:
        return f"answered {_plural(calls, self.name + ' call')} from the recorded results"


_TEMPLATE_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
TEMPLATE_STOP = "</tool_call>"  # where a call in the chat template's format ends


def template_call(action: str, names: set[str]) -> ToolCall | None:
    """The first `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` of an action that names one of
    `names` with one string argument (the arguments as an object or as a JSON string), as a ToolCall; else None."""
    for match in _TEMPLATE_CALL.finditer(action):
        try:
            call = json.loads(match.group(1))
            arguments = call.get("arguments", call.get("parameters"))
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except (json.JSONDecodeError, AttributeError):
            continue
        if not isinstance(arguments, dict) or call.get("name") not in names:
            continue
        texts = [v for v in arguments.values() if isinstance(v, str)]
        if len(texts) == 1:
            return ToolCall(call["name"], texts[0].strip("\n"))
    return None


class ToolEnv:
    """An environment with tools: an action holding a tool call (the tool's own tags, or the chat template's
    `<tool_call>` JSON) is answered by the tool (reward 0, the episode goes on); any other action goes to the
    wrapped environment. GEM's reset / step protocol."""

    def __init__(self, env, tools: list[Tool]):
        self.env = env
        self.tools = tools
        self.tool_calls = 0
        self.tool_errors = 0

    @property
    def stop(self) -> list[str]:
        """Where sampling stops: the end of a tool call (kept in the output)."""
        return [t.stop for t in self.tools] + [TEMPLATE_STOP]

    def reset(self, seed: int | None = None):
        self.tool_calls = self.tool_errors = 0
        observation, info = self.env.reset(seed=seed)
        hints = "\n".join(t.instruction() for t in self.tools)
        return f"{observation}\n{hints}", info

    def step(self, action: str):
        call = self.tool_call(action)
        if call is not None:
            tool = next(t for t in self.tools if t.name == call.tool)
            observation, info = tool.execute(call)
            self.tool_calls += 1
            self.tool_errors += bool(info["tool_error"])
            info.update(tool_calls=self.tool_calls, tool_errors=self.tool_errors)
            return observation, 0.0, False, False, info
        observation, reward, terminated, truncated, info = self.env.step(action)
        info = dict(info or {})
        info.update(tool_calls=self.tool_calls, tool_errors=self.tool_errors)
        return observation, reward, terminated, truncated, info

    def tool_call(self, action: str) -> ToolCall | None:
        """The tool call an action holds (what step() will run), or None."""
        for tool in self.tools:
            call = tool.parse(action)
            if call is not None:
                return call
        return template_call(action, {t.name for t in self.tools})

    async def astep(self, action: str):
        """step() in a worker thread: a tool run blocks, the other episodes' rollouts go on meanwhile."""
        import asyncio

        return await asyncio.to_thread(self.step, action)

    def __getattr__(self, name):  # test_size and the like come from the wrapped environment
        return getattr(self.env, name)
