"""The openai_tools example written in pydantic-ai: `--agent.program agents.programs.pydantic_ai_tools:play`
(needs the `agents` extra: `uv sync --extra agents`).

The same agent as agents/programs/openai_tools.py: a `python` tool, one worked example shown as earlier
messages, at most MAX_TURNS model calls, the answer in \\boxed{} returned for the environment to score. Here
pydantic-ai runs the loop: the tool is a typed function it describes to the model and calls, the worked
example is its message history, and its OpenAI model talks to the episode's client (the gateway), so the
calls are recorded as the plain client's are.
"""

from __future__ import annotations

try:
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.exceptions import UnexpectedModelBehavior, UsageLimitExceeded
    from pydantic_ai.messages import (
        ModelRequest,
        ModelResponse,
        SystemPromptPart,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
    )
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits
except ImportError as exc:
    raise ImportError(f"{exc}: this example needs pydantic-ai, the `agents` extra: uv sync --extra agents") from exc

from agents.program import ProgramTask

SYSTEM = "Solve the task. Compute with the python tool, then give the result in \\boxed{}."
EXAMPLE = [
    ModelRequest(parts=[SystemPromptPart(SYSTEM), UserPromptPart("What is 123 * 45?")]),
    ModelResponse(parts=[ToolCallPart("python", {"code": "print(123 * 45)"}, tool_call_id="call_0")]),
    ModelRequest(parts=[ToolReturnPart("python", "5535", tool_call_id="call_0")]),
    ModelResponse(parts=[TextPart("The answer is \\boxed{5535}.")]),
]
MAX_TURNS = 3
OUTPUT_CHARS = 300  # as openai_tools: the tail of a tool's output the model reads

# retries: the call limit ends an episode, as in openai_tools, not a count of wrong calls (one by default)
agent = Agent(deps_type=ProgramTask, output_type=str, retries=MAX_TURNS)


@agent.tool
async def python(ctx: RunContext[ProgramTask], code: str) -> str:
    """Run Python code; you get back what it prints.

    Args:
        code: the code to run
    """
    return await ctx.deps.run_python(code, max_chars=OUTPUT_CHARS)


async def play(task, client):
    """One episode: pydantic-ai's loop on the episode's client; its final text is returned, or (None) the last
    reply's text when the model used up its calls or broke the tool protocol, for the environment to score."""
    model = OpenAIChatModel(task.model, provider=OpenAIProvider(openai_client=client))
    try:
        result = await agent.run(task.observation, message_history=EXAMPLE, model=model, deps=task,
                                 usage_limits=UsageLimits(request_limit=MAX_TURNS))  # fmt: skip
    except (UsageLimitExceeded, UnexpectedModelBehavior):
        return None
    return result.output
