"""Tools an agent calls inside an episode, and the environment wrapper that answers them (GEM's ToolEnvWrapper).

The python tool (GEM's python_tool): the agent writes `<python>code</python>`; sampling stops at the
closing tag (kept in the output), the code runs in the sandbox (agents.sandbox) and its output comes
back as the next observation, `<output>...</output>`; the agent goes on until it answers without a
tool call (e.g. `\\boxed{42}`), which the wrapped environment scores, or reaches its turn limit.

A tool call costs a turn and earns reward 0. A timeout, a crash or a limit reached is part of the
observation. A sandbox that could not start raises ToolInfraError: the episode is then an
infrastructure failure (flagged on its tape, left out of training and of group statistics).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from agents.sandbox import Sandbox, SandboxConfig, SandboxInfraError, SandboxResult


class ToolInfraError(SandboxInfraError):
    """The tool itself failed (not the agent's code): an infrastructure failure of the episode."""


@dataclass
class ToolCall:
    tool: str
    text: str  # what the agent asked: the code, the query


_PYTHON = re.compile(r"<python>(.*?)</python>", re.S)


class PythonTool:
    """Runs the first complete `<python>...</python>` block of an action in the sandbox."""

    name = "python"
    stop = "</python>"

    def __init__(self, sandbox: Sandbox | None = None, observation_chars: int = 1000):
        self.sandbox = sandbox or Sandbox(SandboxConfig())
        self.observation_chars = observation_chars

    def instruction(self) -> str:
        return ("You may run Python: write <python>code</python> and you will get its output back as "
                "<output>...</output>; print what you need.")

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
            "tool": self.name, "code": call.text, "stdout": result.stdout, "stderr": result.stderr,
            "exit_code": result.exit_code, "timed_out": result.timed_out,
            "output_truncated": result.output_truncated, "tool_error": not result.ok,
        }  # fmt: skip (no run time here: the tape holds what replays the same)


class ToolEnv:
    """An environment with tools: an action holding a tool call is answered by the tool (reward 0, the
    episode goes on); any other action goes to the wrapped environment. GEM's reset / step protocol."""

    def __init__(self, env, tools: list[PythonTool]):
        self.env = env
        self.tools = tools
        self.tool_calls = 0
        self.tool_errors = 0

    @property
    def stop(self) -> list[str]:
        """Where sampling stops: the end of a tool call (kept in the output)."""
        return [t.stop for t in self.tools]

    def reset(self, seed: int | None = None):
        self.tool_calls = self.tool_errors = 0
        observation, info = self.env.reset(seed=seed)
        hints = "\n".join(t.instruction() for t in self.tools)
        return f"{observation}\n{hints}", info

    def step(self, action: str):
        for tool in self.tools:
            call = tool.parse(action)
            if call is not None:
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
        return None

    async def astep(self, action: str):
        """step() in a worker thread: a tool run blocks, the other episodes' rollouts go on meanwhile."""
        import asyncio

        return await asyncio.to_thread(self.step, action)

    def __getattr__(self, name):  # test_size and the like come from the wrapped environment
        return getattr(self.env, name)
