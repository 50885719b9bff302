"""The gateway with the client libraries agents are written in: the OpenAI Agents SDK's default model (the
Responses API, whole and streamed), LangChain's ChatOpenAI (streamed) and litellm (streamed, on OpenAI's chat
completions and on Anthropic's Messages API). Each plays two turns with a python tool against a scripted LLM
with the embedded model's real tokenizer: the tape is token-exact (the second call extends the first), the tool's
call and result are on it, the protocol it came in on is recorded, and a strict replay makes the same calls
(one mode of each client replays: each protocol's replay is also tests/test_gateway_protocols.py's).

openai-agents and litellm pin versions below the project's lock (websockets<17, openai<3), so each runs from
a venv of its own, made once with uv and kept under ~/.cache/tapeloop/clients (TAPELOOP_CLIENTS_DIR), as a
program in another process pointed at the episode's gateway URL. Making one needs PyPI once; without it these
tests fail saying so (`-m 'not clients'` deselects them)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrate.serving.recorded import ReplayLLM
from tapes.tape import ToolCallAction, ToolResultObservation
from tests.programs import ScriptedLLM, play
from tests.test_gateway_protocols import PYTHON_TOOL, same_calls_on_tapes, two_turns

pytestmark = pytest.mark.clients

AGENTS_SDK = "openai-agents==0.24.0"
LITELLM = "litellm==1.110.2"


def client_python(requirement: str) -> Path:
    """The python of a venv holding `requirement` alone, made once (uv venv + uv pip install) and kept."""
    root = Path(os.environ.get("TAPELOOP_CLIENTS_DIR") or Path.home() / ".cache" / "tapeloop" / "clients")
    folder = root / requirement.replace("==", "-")
    python, ready = folder / "bin" / "python", folder / ".ready"
    if ready.exists():
        return python
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail(f"making a venv for {requirement} needs uv on PATH (.ci/run installs it); "
                    "-m 'not clients' deselects these tests")  # fmt: skip
    shutil.rmtree(folder, ignore_errors=True)  # a venv left half made
    for command in ([uv, "venv", "--quiet", "--python", sys.executable, str(folder)],
                    [uv, "pip", "install", "--quiet", "--python", str(python), requirement]):  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            why = (out.stderr.strip().splitlines() or ["no output"])[-1].strip()
            pytest.fail(f"could not make a venv with {requirement} in {folder} ({why}): these tests need PyPI once; "
                        "-m 'not clients' deselects them")  # fmt: skip
    ready.write_text(requirement)
    return python


@pytest.fixture(scope="session")
def agents_sdk_python():
    return client_python(AGENTS_SDK)


@pytest.fixture(scope="session")
def litellm_python():
    return client_python(LITELLM)


def in_another_process(python: Path, script: str, *args: str):
    """A program that runs `script` with `python` (isolated: the repo's own `agents` package is not on its path),
    the episode's URL, key, model and task in its environment; it prints a JSON object whose "answer" goes to the
    environment. What it printed is kept on the program (`program.result`)."""

    async def program(task, client):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "OPENAI_"))}
        env.update(OPENAI_BASE_URL=task.base_url, OPENAI_API_KEY=task.api_key, MODEL=task.model,
                   TASK=task.observation, LITELLM_LOCAL_MODEL_COST_MAP="True")  # fmt: skip
        child = await asyncio.create_subprocess_exec(str(python), "-I", "-c", script, *args, env=env,
                                                     stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)  # fmt: skip
        out, err = await child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"the client exited {child.returncode}: {err.decode()[-3000:]}")
        program.result = json.loads(out.decode().strip().splitlines()[-1])
        return program.result["answer"]

    return program


def assert_two_turns_with_the_tool(tape, product, protocol: str):
    """Token-exact (the second call extends the first), the tool's call then its result, the protocol recorded."""
    assert tape.metadata.error is None, tape.metadata.error
    assert tape.metadata.reward == 1.0
    assert [c.extends_previous for c in tape.llm_calls] == [None, True]
    assert [c.protocol for c in tape.llm_calls] == [protocol] * 2
    kinds = [type(s) for s in tape.steps]
    assert ToolCallAction in kinds and ToolResultObservation in kinds
    assert kinds.index(ToolCallAction) < kinds.index(ToolResultObservation)
    call = next(s for s in tape.steps if isinstance(s, ToolCallAction))
    result = next(s for s in tape.steps if isinstance(s, ToolResultObservation))
    assert call.tool == result.tool == "python" and result.text == str(product)
    assert result.turn == 1 and tape.llm_calls[1].turn == 2


# -- the OpenAI Agents SDK ------------------------------------------------------------------

AGENTS_SDK_PROGRAM = r"""
import asyncio, contextlib, io, json, os, sys

from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

sent = []  # each request's previous_response_id and number of input items


async def seen(request):
    body = json.loads(request.content)
    sent.append([body.get("previous_response_id"), len(body["input"])])


set_tracing_disabled(True)  # no traces sent to OpenAI
# OPENAI_BASE_URL and OPENAI_API_KEY: the episode's
client = AsyncOpenAI(max_retries=0, http_client=DefaultAsyncHttpxClient(event_hooks={"request": [seen]}))
set_default_openai_client(client)


@function_tool
def python(code: str) -> str:
    "Run Python; see what it prints."
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})
    return out.getvalue().strip()


async def main(mode):
    agent = Agent(name="solver", instructions="Use the tool.", tools=[python], model=os.environ["MODEL"])
    if mode == "stream":
        result = Runner.run_streamed(agent, os.environ["TASK"])
        events = [event.type async for event in result.stream_events()]
    else:  # chained: each turn sends only what is new, with the previous response's id
        result = await Runner.run(agent, os.environ["TASK"], auto_previous_response_id=mode == "chained")
        events = []
    items = [item.type for item in result.new_items]
    print(json.dumps({"answer": result.final_output, "items": items, "events": sorted(set(events)), "sent": sent}))


asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.slow  # the SDK imported in a process of its own (twice where it replays)
@pytest.mark.parametrize("mode", ["whole", "stream", "chained"])
def test_the_agents_sdks_default_model_runs_a_tool_through_the_responses_api(
    tokenizer, agent_for, agents_sdk_python, mode
):
    product, replies = two_turns(tokenizer)
    program = in_another_process(agents_sdk_python, AGENTS_SDK_PROGRAM, mode)
    tape = play(agent_for(program), ScriptedLLM(tokenizer, replies))
    assert_two_turns_with_the_tool(tape, product, "responses+stream" if mode == "stream" else "responses")
    assert program.result["items"] == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    (first_id, first_items), (second_id, second_items) = program.result["sent"]
    assert first_id is None and first_items == 1
    if mode == "chained":  # the tool's result alone, after the stored response: the same tokens
        assert second_id is not None and second_items == 1
    else:  # the whole history: the task, the call, its result
        assert second_id is None and second_items == 3
    if mode == "stream":
        assert "raw_response_event" in program.result["events"]
    # the SDK's instructions are the system prompt
    assert tape.llm_calls[0].prompt_text.startswith("<|im_start|>system\nUse the tool.")
    if mode == "chained":  # replayed once (the SDK imported again, seconds): each protocol's replay of the other
        # modes is tests/test_gateway_protocols.py's, in-process
        again = play(agent_for(in_another_process(agents_sdk_python, AGENTS_SDK_PROGRAM, mode)),
                     ReplayLLM(tape, strict=True))  # fmt: skip
        assert same_calls_on_tapes(again, tape) and again.metadata.reward == 1.0


# -- LangChain --------------------------------------------------------------------------------


def langchain_program(responses_api: bool = False):
    async def program(task, client):
        from langchain_core.messages import HumanMessage, ToolMessage
        from langchain_openai import ChatOpenAI

        model = ChatOpenAI(model=task.model, base_url=task.base_url, api_key=task.api_key, streaming=True,
                           stream_usage=True, max_retries=0, use_responses_api=responses_api).bind_tools([PYTHON_TOOL])  # fmt: skip
        messages = [HumanMessage(task.observation)]
        program.chunks = []
        for _ in range(3):
            reply, chunks = None, 0
            async for chunk in model.astream(messages):
                reply, chunks = chunk if reply is None else reply + chunk, chunks + 1
            program.chunks.append(chunks)
            messages.append(reply)
            if not reply.tool_calls:
                program.usage = reply.usage_metadata
                return reply.text if responses_api else reply.content
            for call in reply.tool_calls:
                result = await task.run_python(call["args"]["code"])
                messages.append(ToolMessage(result.strip(), tool_call_id=call["id"]))

    return program


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_langchains_chat_openai_streams_a_tool_call_and_its_answer(tokenizer, agent_for, responses_api):
    product, replies = two_turns(tokenizer)
    program = langchain_program(responses_api)
    tape = play(agent_for(program), ScriptedLLM(tokenizer, replies))
    assert_two_turns_with_the_tool(tape, product, "responses+stream" if responses_api else "chat.completions+stream")
    assert all(n > 3 for n in program.chunks)  # streamed in pieces, not one reply
    last = tape.llm_calls[-1]
    assert program.usage["output_tokens"] == len(last.output_token_ids)
    assert program.usage["input_tokens"] == len(last.prompt_token_ids)
    again = play(agent_for(langchain_program(responses_api)), ReplayLLM(tape, strict=True))
    assert same_calls_on_tapes(again, tape)


# -- litellm ----------------------------------------------------------------------------------

LITELLM_PROGRAM = r"""
import asyncio, contextlib, io, json, os, sys

import litellm

MODE = sys.argv[1]  # openai: acompletion on chat completions; anthropic: acompletion on the Messages API;
# messages: litellm.anthropic.messages, Anthropic's request and reply as they are
TOOL = json.loads(sys.argv[2])
URL, KEY, MODEL = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["MODEL"]


def run_python(code):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})
    return out.getvalue().strip()


async def completion(messages):
    base = URL if MODE == "openai" else URL.removesuffix("/v1")  # litellm adds /v1/messages
    stream = await litellm.acompletion(
        model=f"{MODE}/{MODEL}", api_base=base, api_key=KEY, messages=messages, tools=[TOOL], stream=True,
        max_tokens=64, num_retries=0, stream_options={"include_usage": True} if MODE == "openai" else None,
    )
    chunks = [chunk async for chunk in stream]
    message = litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message
    calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
             for c in message.tool_calls or []]
    messages.append({"role": "assistant", "content": message.content, **({"tool_calls": calls} if calls else {})})
    for call in calls:
        result = run_python(json.loads(call["function"]["arguments"])["code"])
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return len(chunks), (None if calls else message.content)


async def anthropic_messages(messages):
    tool = {"name": TOOL["function"]["name"], "description": TOOL["function"]["description"],
            "input_schema": TOOL["function"]["parameters"]}
    # not streamed: litellm's streamed messages import its proxy's modules (fastapi), absent without litellm[proxy]
    message = await litellm.anthropic.messages.acreate(
        model=f"anthropic/{MODEL}", api_base=URL.removesuffix("/v1"), api_key=KEY, messages=messages,
        tools=[tool], max_tokens=64,
    )
    content = [{k: v for k, v in block.items() if v is not None} for block in message["content"]]
    messages.append({"role": "assistant", "content": content})
    uses = [b for b in content if b["type"] == "tool_use"]
    if uses:
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b["id"], "content": run_python(b["input"]["code"])} for b in uses]})
    return None, (None if uses else "".join(b["text"] for b in content if b["type"] == "text"))


async def main():
    messages = [{"role": "user", "content": os.environ["TASK"]}]
    pieces = []
    for _ in range(3):
        n, answer = await (anthropic_messages if MODE == "messages" else completion)(messages)
        pieces.append(n)
        if answer is not None:
            print(json.dumps({"answer": answer, "pieces": pieces}))
            return


asyncio.run(main())
"""


@pytest.mark.slow  # litellm imported in a process of its own (twice where it replays)
@pytest.mark.parametrize("mode", ["openai", "anthropic", "messages"])
def test_litellm_streams_a_tool_call_on_chat_completions_and_on_the_messages_api(
    tokenizer, agent_for, litellm_python, mode
):
    product, replies = two_turns(tokenizer)
    args = (mode, json.dumps(PYTHON_TOOL))
    program = in_another_process(litellm_python, LITELLM_PROGRAM, *args)
    tape = play(agent_for(program), ScriptedLLM(tokenizer, replies))
    protocol = {"openai": "chat.completions+stream", "anthropic": "messages+stream", "messages": "messages"}[mode]
    assert_two_turns_with_the_tool(tape, product, protocol)
    if mode != "messages":
        assert all(n > 3 for n in program.result["pieces"])  # streamed in pieces
    if mode == "anthropic":  # replayed once (litellm imported again, seconds); the others' protocols replay in
        # tests/test_gateway_protocols.py
        again = play(
            agent_for(in_another_process(litellm_python, LITELLM_PROGRAM, *args)), ReplayLLM(tape, strict=True)
        )
        assert same_calls_on_tapes(again, tape) and again.metadata.reward == 1.0
