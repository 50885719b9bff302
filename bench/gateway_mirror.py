"""The programs bench/bench_gateway.py plays: the built-in agent's messages sent through the gateway, in each
protocol. A module of its own, light to import (no torch), so that the program processes the `process` side
forks cost what a user's program would: the fork server imports it (`gateway_mirror:mirror`, bench/ on the
path) and rebuilds the agent's settings from MIRROR_VAR, set by the bench."""

from __future__ import annotations

import os
import time

from agents.agent import AgentConfig, Example
from agents.env_spec import EnvSpec
from orchestrate.loop.command_line import load_preset

MIRROR_VAR = "BENCH_GATEWAY_MIRROR"  # "TURNS,MAX_TOKENS": the setting a program process rebuilds
FIRST_BYTE: list[tuple[float, float]] = []  # streamed calls: (seconds to the first byte, seconds to the last)
GATEWAY_APP = None  # the messages side's gateway app, called in-process (messages_reply)
DIRECT: dict = {}  # the direct side: the vLLM server's own OpenAI API (base_url, api_key, model, the sampling)


def setting(turns: int) -> tuple[EnvSpec, AgentConfig]:
    """The task and the built-in agent's settings every side plays: one turn of the embedded preset's
    arithmetic, or up to `turns` of the game preset's guess the number."""
    if turns == 1:
        embedded = load_preset("embedded")
        spec = EnvSpec("math:arithmetic", embedded["env"]["options"], "train", 0)
        return spec, AgentConfig(max_turns=1, instruction=embedded["agent"]["instruction"],
                                 examples=[Example(**e) for e in embedded["agent"]["examples"]])  # fmt: skip
    game = load_preset("game")
    spec = EnvSpec("game:guess_the_number", {**game["env"]["options"], "max_turns": turns}, "train", 0)
    return spec, AgentConfig(max_turns=turns, examples=[Example(**e) for e in game["agent"]["examples"]])


CONFIG: AgentConfig | None = None
MAX_TOKENS = 64
if os.environ.get(MIRROR_VAR):  # in a program process: the same settings as the bench's
    _turns, MAX_TOKENS = (int(x) for x in os.environ[MIRROR_VAR].split(","))
    CONFIG = setting(_turns)[1]


async def chat_reply(task, client, messages) -> tuple[str, bool]:
    reply = await client.chat.completions.create(model=task.model, messages=messages)
    return reply.choices[0].message.content or "", reply.choices[0].finish_reason == "length"


async def stream_reply(task, client, messages) -> tuple[str, bool]:
    start, first, text, finish = time.perf_counter(), None, [], None
    async for chunk in await client.chat.completions.create(model=task.model, messages=messages, stream=True):
        first = first or time.perf_counter()
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    FIRST_BYTE.append((first - start, time.perf_counter() - start))
    return "".join(text), finish == "length"


async def responses_reply(task, client, messages) -> tuple[str, bool]:
    response = await client.responses.create(model=task.model, input=messages)
    return response.output_text, response.status == "incomplete"


async def messages_reply(task, client, messages) -> tuple[str, bool]:
    import anthropic
    import httpx2  # anthropic's own fork of httpx

    # the gateway's app in this process, as the openai client's on the other sides (a socket would add its
    # round trip to this side alone)
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=GATEWAY_APP), timeout=600)
    claude = anthropic.AsyncAnthropic(base_url=task.base_url.removesuffix("/v1"), api_key=task.api_key,
                                      max_retries=0, http_client=http)  # fmt: skip
    system = [m["content"] for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    try:
        message = await claude.messages.create(model=task.model, max_tokens=MAX_TOKENS,
                                               system=system[0] if system else [], messages=rest)  # fmt: skip
    finally:
        await http.aclose()
    return "".join(b.text for b in message.content if b.type == "text"), message.stop_reason == "max_tokens"


async def direct_reply(task, client, messages) -> tuple[str, bool]:
    """The chat side's call sent to the vLLM server's own chat completions (a socket, no gateway, no tape), with the
    sampling the gateway would have applied: what the same program costs without tapeloop."""
    import openai

    async with openai.AsyncOpenAI(base_url=DIRECT["base_url"], api_key=DIRECT["api_key"], max_retries=0) as own:
        reply = await own.chat.completions.create(model=DIRECT["model"], messages=messages, **DIRECT["sampling"])
    return reply.choices[0].message.content or "", reply.choices[0].finish_reason == "length"


REPLIES = {"chat": chat_reply, "direct": direct_reply, "process": chat_reply, "stream": stream_reply, "responses": responses_reply,
           "messages": messages_reply}  # fmt: skip


async def mirror_with(reply, task, client):
    """The built-in agent as a program: its first messages, then each reply to the environment and its answer
    back as the next user message, until the episode ends or max_turns."""
    messages = CONFIG.first_messages(task.observation)
    for _ in range(CONFIG.max_turns):
        text, cut = await reply(task, client, messages)
        answer = await task.step(text)
        if answer.terminated or answer.truncated or cut:
            return None
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": answer.observation}]
    return None


async def mirror(task, client):
    """The chat side's program, by path (`gateway_mirror:mirror`) for a process of its own."""
    return await mirror_with(chat_reply, task, client)
