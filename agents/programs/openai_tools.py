"""A multi-turn, tool-calling agent written against the plain `openai` client: `--agent.program
agents.programs.openai_tools:play` (the `program_tool` preset).

It solves a math task with a `python` tool: the model calls the tool (OpenAI tool calls), the code runs in the
run's sandbox (`task.run_python`), its output goes back as a tool message, and the model answers in \\boxed{};
the answer is returned and the environment scores it. One worked example is shown as earlier messages. Nothing
here knows of tapes or training: the gateway records the calls.
"""

from __future__ import annotations

import json

SYSTEM = "Solve the task. Compute with the python tool, then give the result in \\boxed{}."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code; you get back what it prints.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the code to run"}},
                "required": ["code"],
            },
        },
    }
]
EXAMPLE = [
    {"role": "user", "content": "What is 123 * 45?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "python", "arguments": json.dumps({"code": "print(123 * 45)"})},
            },
        ],
    },  # fmt: skip
    {"role": "tool", "tool_call_id": "call_0", "content": "5535"},
    {"role": "assistant", "content": "The answer is \\boxed{5535}."},
]
MAX_TURNS = 3
# a tool's output the model reads at most (its tail): a huge number printed would not fit the context,
# and a prompt past the context is an infrastructure failure, not something the model learns from
OUTPUT_CHARS = 300


async def run_tool(task, name: str, arguments: str) -> str:
    """One tool call's output, or what was wrong with the call (the model reads either)."""
    if name != "python":
        return f"error: there is no tool {name!r}; the tool is python"
    try:
        code = json.loads(arguments)["code"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return 'error: call python with {"code": "..."}'
    return await task.run_python(str(code), max_chars=OUTPUT_CHARS)


async def play(task, client):
    """One episode: tool calls until the model answers (at most MAX_TURNS calls); the answer is returned."""
    messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": task.observation}]
    answer = ""
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model=task.model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        answer = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            output = await run_tool(task, call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return answer
