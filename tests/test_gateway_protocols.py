"""The gateway's protocols with their real clients: OpenAI's chat completions streamed, OpenAI's Responses API
(whole, streamed, with previous_response_id), Anthropic's Messages API (whole, streamed, count_tokens), each
against a scripted LLM with the embedded model's real tokenizer: one tape format, token-exact, replayed."""

from __future__ import annotations

import json

import httpx
import pytest

from orchestrate.gateway.agent import MODEL_NAME
from orchestrate.serving.recorded import ReplayLLM
from tapes.tape import ToolCallAction, ToolResultObservation
from tests.programs import ScriptedLLM, answer_of, play
from tests.test_gateway import tool_reply

PYTHON_TOOL = {"type": "function", "function": {"name": "python", "description": "Run Python; see what it prints.",
               "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}  # fmt: skip
RESPONSES_TOOL = {"type": "function", **PYTHON_TOOL["function"]}
ANTHROPIC_TOOL = {"name": "python", "description": PYTHON_TOOL["function"]["description"],
                  "input_schema": PYTHON_TOOL["function"]["parameters"]}  # fmt: skip


def anthropic_client(task, **kw):
    import anthropic

    # Anthropic's clients add /v1/messages to the base URL: the episode's URL without its /v1
    return anthropic.AsyncAnthropic(base_url=task.base_url.removesuffix("/v1"), max_retries=0, **kw)


def same_calls_on_tapes(a, b):
    """Two tapes hold the same LLM calls: prompt and output ids, log-probs, turns and extension."""
    key = [(c.prompt_token_ids, c.output_token_ids, c.logprobs, c.turn, c.extends_previous) for c in a.llm_calls]
    return key == [
        (c.prompt_token_ids, c.output_token_ids, c.logprobs, c.turn, c.extends_previous) for c in b.llm_calls
    ]


def two_turns(tokenizer):
    a, b, product = answer_of()
    return product, [tool_reply(a, b), f"The answer is \\boxed{{{product}}}."]


# -- chat completions, streamed -----------------------------------------------------------


def chat_program(stream: bool):
    async def program(task, client):
        messages = [{"role": "user", "content": task.observation}]
        seen = []
        for _ in range(2):
            kwargs = dict(model=task.model, messages=messages, tools=[PYTHON_TOOL])
            if not stream:
                message = (await client.chat.completions.create(**kwargs)).choices[0].message
                content, calls, finish = message.content, message.tool_calls or [], None
                calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                        "arguments": c.function.arguments}} for c in calls]  # fmt: skip
            else:
                chunks = [c async for c in await client.chat.completions.create(
                    **kwargs, stream=True, stream_options={"include_usage": True})]  # fmt: skip
                seen.append(chunks)
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) or None
                calls: dict[int, dict] = {}
                for chunk in chunks:
                    for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                        call = calls.setdefault(d.index, {"id": d.id, "type": "function",
                                                          "function": {"name": d.function.name, "arguments": ""}})  # fmt: skip
                        call["function"]["arguments"] += d.function.arguments or ""
                calls = list(calls.values())
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            messages.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
            for call in calls:
                code = json.loads(call["function"]["arguments"])["code"]
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": (await task.run_python(code)).strip()})  # fmt: skip
            if not calls:
                program.seen = seen
                program.finish = finish
                return content

    return program


def test_a_streamed_chat_completion_records_the_same_call_as_a_whole_one(tokenizer, agent_for):
    product, replies = two_turns(tokenizer)
    whole = play(agent_for(chat_program(False)), ScriptedLLM(tokenizer, replies))
    streamed_program = chat_program(True)
    streamed = play(agent_for(streamed_program), ScriptedLLM(tokenizer, replies))
    assert whole.metadata.error is None and streamed.metadata.error is None, streamed.metadata.error
    assert streamed.metadata.reward == 1.0 and same_calls_on_tapes(whole, streamed)
    assert [c.protocol for c in whole.llm_calls] == ["chat.completions"] * 2
    assert [c.protocol for c in streamed.llm_calls] == ["chat.completions+stream"] * 2
    first, second = streamed_program.seen
    # OpenAI's chunk shape: the role first, the call's id and name then its arguments in fragments, the finish
    # reason, usage alone in the last chunk
    assert first[0].choices[0].delta.role == "assistant"
    assert first[1].choices[0].delta.tool_calls[0].function.name == "python"
    assert len([c for c in first if c.choices and c.choices[0].delta.tool_calls]) > 2  # fragments
    assert [c.choices[0].finish_reason for c in first if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert first[-1].choices == [] and first[-1].usage.completion_tokens == len(whole.llm_calls[0].output_token_ids)
    assert all(c.usage is None for c in first[:-1])
    assert len([c for c in second if c.choices and c.choices[0].delta.content]) > 3  # the text in token pieces
    assert streamed_program.finish == ["stop"]
    again = play(agent_for(chat_program(True)), ReplayLLM(streamed, strict=True))
    assert same_calls_on_tapes(again, streamed) and again.metadata.reward == 1.0


def test_a_streamed_chat_serves_log_probs_token_by_token_and_ends_with_done(tokenizer, agent_for):
    lines = {}

    async def raw(task, client):
        async with httpx.AsyncClient() as http:
            async with http.stream("POST", task.base_url + "/chat/completions", headers={"Authorization": f"Bearer {task.api_key}"},
                                   json={"model": task.model, "stream": True, "logprobs": True,
                                         "messages": [{"role": "user", "content": "A"}]}) as response:  # fmt: skip
                lines["status"], lines["type"] = response.status_code, response.headers["content-type"]
                lines["body"] = [line async for line in response.aiter_lines() if line]
        return 1.0

    tape = play(agent_for(raw), ScriptedLLM(tokenizer, ["Hello there, friend"]))
    assert lines["status"] == 200 and lines["type"].startswith("text/event-stream")
    assert lines["body"][-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines["body"][:-1]]
    pieces = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"][0]["delta"].get("content")]
    assert "".join(pieces) == "Hello there, friend"
    logprobs = [lp for c in chunks if c["choices"][0]["logprobs"] for lp in c["choices"][0]["logprobs"]["content"]]
    call = tape.llm_calls[0]
    assert [lp["logprob"] for lp in logprobs] == call.logprobs[: len(logprobs)] and len(logprobs) == len(pieces)
    assert "usage" not in chunks[0]  # only with stream_options.include_usage


# -- the Responses API ------------------------------------------------------------------


def responses_program(stream: bool, chained: bool):
    """Two turns with the python tool through /v1/responses: `chained` sends only what is new with
    previous_response_id; otherwise the whole history each turn with store false (as Codex does)."""

    async def program(task, client):
        history: list = [{"role": "user", "content": [{"type": "input_text", "text": task.observation}]}]
        previous = None
        program.events = []
        for _ in range(2):
            kwargs = dict(model=task.model, instructions="Use the tool.", tools=[RESPONSES_TOOL],
                          reasoning={"effort": "low"}, text={"verbosity": "low"}, parallel_tool_calls=False)  # fmt: skip
            if chained:
                kwargs.update(input=history[-1:] if previous else history, previous_response_id=previous)
            else:
                kwargs.update(input=history, store=False)
            if stream:
                events = [e async for e in await client.responses.create(**kwargs, stream=True)]
                program.events.append([e.type for e in events])
                response = events[-1].response
            else:
                response = await client.responses.create(**kwargs)
            previous = response.id
            calls = [item for item in response.output if item.type == "function_call"]
            history += [item.model_dump(exclude_none=True) for item in response.output]
            if not calls:
                return response.output_text
            for call in calls:
                result = await task.run_python(json.loads(call.arguments)["code"])
                history.append({"type": "function_call_output", "call_id": call.call_id, "output": result.strip()})  # fmt: skip

    return program


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_responses_api_chained_or_resent_whole_gives_the_same_tokens_as_chat(tokenizer, agent_for, stream):
    product, replies = two_turns(tokenizer)
    chat = play(agent_for(chat_program(False)), ScriptedLLM(tokenizer, replies))
    tapes = {}
    for chained in (True, False):
        program = responses_program(stream, chained)
        tapes[chained] = play(agent_for(program), ScriptedLLM(tokenizer, replies))
        assert tapes[chained].metadata.error is None, tapes[chained].metadata.error
        assert tapes[chained].metadata.reward == 1.0
    assert same_calls_on_tapes(tapes[True], tapes[False])
    assert [c.extends_previous for c in tapes[True].llm_calls] == [None, True]
    # the instructions are the system message chat would send: a system prompt, then the same turns
    first = tapes[True].llm_calls[0]
    assert (
        first.prompt_text.startswith("<|im_start|>system\nUse the tool.")
        and chat.llm_calls[0].output_token_ids == first.output_token_ids
    )
    steps = [type(s).__name__ for s in tapes[True].steps]
    assert "ToolCallAction" in steps and "ToolResultObservation" in steps
    result = next(s for s in tapes[True].steps if isinstance(s, ToolResultObservation))
    assert result.text == str(product) and result.tool == "python"
    assert {c.protocol for c in tapes[True].llm_calls} == {"responses+stream" if stream else "responses"}
    if stream:
        first_events = program.events[0]
        assert first_events[:2] == ["response.created", "response.in_progress"]
        assert (
            first_events[2] == "response.output_item.added" and "response.function_call_arguments.delta" in first_events
        )
        assert first_events[-2:] == ["response.output_item.done", "response.completed"]
        text_events = program.events[1]
        assert "response.output_text.delta" in text_events and "response.content_part.done" in text_events
    again = play(agent_for(responses_program(stream, True)), ReplayLLM(tapes[True], strict=True))
    assert same_calls_on_tapes(again, tapes[True])


def test_the_responses_api_refuses_what_needs_openais_service_naming_the_field(tokenizer, agent_for):
    import openai

    seen = {}

    async def program(task, client):
        for name, kwargs in {
            "hosted": dict(tools=[{"type": "web_search"}]),
            "background": dict(background=True),
            "unknown previous": dict(previous_response_id="resp_nope"),
            "image": dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
        }.items():
            try:
                await client.responses.create(**{"model": task.model, "input": "A", **kwargs})
            except openai.APIStatusError as exc:
                seen[name] = (exc.status_code, exc.message, exc.body)
        kept = await client.responses.create(model=task.model, input="A", store=False)
        try:
            await client.responses.create(model=task.model, input="B", previous_response_id=kept.id)
        except openai.APIStatusError as exc:
            seen["not stored"] = (exc.status_code, exc.message, exc.body)
        return 1.0

    play(agent_for(program), ScriptedLLM(tokenizer, ["ok"]))
    assert seen["hosted"][0] == 400 and "tools[0].type: 'web_search' is a hosted tool" in seen["hosted"][1]
    assert seen["background"][0] == 400 and "background: not served" in seen["background"][1]
    assert seen["unknown previous"][0] == 404 and "previous_response_id" in seen["unknown previous"][1]
    assert seen["image"][0] == 400 and "input[0].content[0]" in seen["image"][1]
    assert seen["not stored"][0] == 404 and "store false" in seen["not stored"][1]
    assert seen["hosted"][2]["type"] == "invalid_request_error"  # OpenAI's error shape


def test_custom_and_local_shell_tools_are_offered_as_functions_and_come_back_as_their_items(tokenizer, agent_for):
    got = {}

    async def program(task, client):
        response = await client.responses.create(model=task.model, input="Patch it.", tools=[
            {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}, {"type": "local_shell"}])  # fmt: skip
        got["items"] = [item.model_dump(exclude_none=True) for item in response.output]
        response = await client.responses.create(model=task.model, previous_response_id=response.id, input=[
            {"type": "custom_tool_call_output", "call_id": got["items"][0]["call_id"], "output": "Done."}], tools=[
            {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}, {"type": "local_shell"}])  # fmt: skip
        got["second"] = [item.model_dump(exclude_none=True) for item in response.output]
        return 1.0

    patch = json.dumps({"name": "apply_patch", "arguments": {"input": "*** Begin Patch"}})
    shell = json.dumps({"name": "local_shell", "arguments": {"command": ["ls", "-l"]}})
    tape = play(agent_for(program), ScriptedLLM(tokenizer, [f"<tool_call>\n{patch}\n</tool_call>",
                                                            f"<tool_call>\n{shell}\n</tool_call>"]))  # fmt: skip
    assert tape.metadata.error is None, tape.metadata.error
    (custom,) = got["items"]
    assert (
        custom["type"] == "custom_tool_call"
        and custom["name"] == "apply_patch"
        and custom["input"] == "*** Begin Patch"
    )
    (call,) = got["second"]
    assert call["type"] == "local_shell_call" and call["action"]["command"] == ["ls", "-l"]
    assert tape.llm_calls[1].extends_previous is True
    assert isinstance(tape.steps[-2], ToolCallAction) and tape.steps[-2].tool == "local_shell"


# -- Anthropic's Messages API -----------------------------------------------------------


def messages_program(stream: bool, bearer: bool = False):
    async def program(task, client):
        claude = anthropic_client(task, **({"auth_token": task.api_key} if bearer else {"api_key": task.api_key}))
        messages = [{"role": "user", "content": task.observation}]
        program.events = []
        for _ in range(2):
            kwargs = dict(model=task.model, max_tokens=64, system=[{"type": "text", "text": "Use the tool."}],
                          messages=messages, tools=[ANTHROPIC_TOOL])  # fmt: skip
            if stream:
                async with claude.messages.stream(**kwargs) as events:
                    program.events.append([e.type async for e in events])
                    message = await events.get_final_message()
            else:
                message = await claude.messages.create(**kwargs)
            messages.append(
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}
            )
            uses = [b for b in message.content if b.type == "tool_use"]
            if not uses:
                program.stop_reason = message.stop_reason
                return "".join(b.text for b in message.content if b.type == "text")
            results = []
            for use in uses:
                result = await task.run_python(use.input["code"])
                results.append({"type": "tool_result", "tool_use_id": use.id, "content": result.strip()})
            messages.append({"role": "user", "content": results})

    return program


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_messages_api_with_tools_is_token_exact_and_replays(tokenizer, agent_for, stream):
    product, replies = two_turns(tokenizer)
    program = messages_program(stream, bearer=stream)  # the key as x-api-key, and as a bearer token
    tape = play(agent_for(program), ScriptedLLM(tokenizer, replies))
    assert tape.metadata.error is None, tape.metadata.error
    assert tape.metadata.reward == 1.0 and program.stop_reason == "end_turn"
    assert [c.extends_previous for c in tape.llm_calls] == [None, True]
    assert {c.protocol for c in tape.llm_calls} == {"messages+stream" if stream else "messages"}
    result = next(s for s in tape.steps if isinstance(s, ToolResultObservation))
    assert result.text == str(product)
    if stream:
        first, second = program.events
        assert first[0] == "message_start" and "input_json" in first and first[-1] == "message_stop"
        assert "text" in second and "content_block_stop" in second and "message_delta" in second
    again = play(agent_for(messages_program(stream)), ReplayLLM(tape, strict=True))
    assert same_calls_on_tapes(again, tape)


def test_the_messages_api_counts_tokens_stops_on_a_sequence_and_answers_errors_in_its_shape(tokenizer, agent_for):
    import anthropic

    seen = {}

    async def program(task, client):
        claude = anthropic_client(task, api_key=task.api_key)
        user = [{"role": "user", "content": "A"}]
        seen["count"] = (await claude.messages.count_tokens(model=task.model, messages=user)).input_tokens
        message = await claude.messages.create(model=task.model, max_tokens=32, messages=user, stop_sequences=["END"])
        seen["stop"] = (message.stop_reason, message.stop_sequence, message.content[0].text)
        seen["input_tokens"] = message.usage.input_tokens
        async with httpx.AsyncClient() as http:  # the SDK itself requires max_tokens
            response = await http.post(task.base_url + "/messages", headers={"x-api-key": task.api_key},
                                       json={"model": task.model, "messages": user})  # fmt: skip
            seen["no max_tokens"] = (response.status_code, response.json())
        for name, kwargs in {
            "server tool": dict(
                max_tokens=8, messages=user, tools=[{"type": "web_search_20250305", "name": "web_search"}]
            ),
            "image": dict(max_tokens=8, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
        }.items():
            try:
                await claude.messages.create(model=task.model, **kwargs)
            except anthropic.APIStatusError as exc:
                seen[name] = (exc.status_code, exc.body)
        try:
            await anthropic_client(task, api_key="wrong").messages.create(model=task.model, max_tokens=8, messages=user)
        except anthropic.APIStatusError as exc:
            seen["key"] = (exc.status_code, exc.body)
        return 1.0

    play(agent_for(program), ScriptedLLM(tokenizer, ["Four. END", "unused"], eos=False))
    assert seen["count"] == seen["input_tokens"] > 0
    assert seen["stop"] == ("stop_sequence", "END", "Four. ")
    status, body = seen["no max_tokens"]
    assert status == 400 and body == {"type": "error", "error": {"type": "invalid_request_error",
                                                                "message": "max_tokens: required, a positive integer"}}  # fmt: skip
    assert seen["server tool"][0] == 400 and "tools.0.type" in seen["server tool"][1]["error"]["message"]
    assert seen["image"][0] == 400 and "messages.0.content.0.type" in seen["image"][1]["error"]["message"]
    assert seen["key"][0] == 401 and seen["key"][1]["error"]["type"] == "authentication_error"


def test_a_request_in_a_protocols_wrong_shape_gets_its_error_never_a_500(tokenizer, agent_for):
    seen = {}

    async def program(task, client):
        headers = {"Authorization": f"Bearer {task.api_key}"}
        async with httpx.AsyncClient() as http:
            for name, (path, body) in {
                "responses input": ("/responses", {"model": task.model, "input": 3}),
                "responses item": ("/responses", {"model": task.model, "input": [{"type": "teleport"}]}),
                "responses tools": ("/responses", {"model": task.model, "input": "A", "tools": "all"}),
                "messages role": ("/messages", {"model": task.model, "max_tokens": 8, "messages": [{"role": "robot", "content": "A"}]}),
                "messages blocks": ("/messages", {"model": task.model, "max_tokens": 8, "messages": [{"role": "user", "content": 7}]}),
                "messages model": ("/messages", {"model": "claude", "max_tokens": 8, "messages": [{"role": "user", "content": "A"}]}),
                "stream options": ("/chat/completions", {"model": task.model, "messages": [{"role": "user", "content": "A"}],
                                                          "stream": True, "stream_options": 3}),
            }.items():  # fmt: skip
                response = await http.post(task.base_url + path, headers=headers, json=body)
                seen[name] = (response.status_code, response.json())
        return 1.0

    tape = play(agent_for(program), ScriptedLLM(tokenizer, []))
    for name, (status, body) in seen.items():
        assert status in (400, 404), (name, status, body)
        message = body["error"]["message"]
        assert "Traceback" not in message and "\n" not in message, (name, message)
        if name.startswith("messages"):
            assert body["type"] == "error" and body["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert "input: expected a string" in seen["responses input"][1]["error"]["message"]
    assert "input[0].type" in seen["responses item"][1]["error"]["message"]
    assert "messages.0.role" in seen["messages role"][1]["error"]["message"]
    assert (
        seen["messages model"][0] == 404 and "'claude' is not served" in seen["messages model"][1]["error"]["message"]
    )
    assert tape.metadata.error is not None  # the program's fault: its episode is left out of training


def test_models_lists_the_one_model_name(tokenizer, agent_for):
    got = {}

    async def program(task, client):
        got["models"] = [m.id async for m in client.models.list()]
        return 1.0

    play(agent_for(program), ScriptedLLM(tokenizer, []))
    assert got["models"] == [MODEL_NAME]


class HeldLLM(ScriptedLLM):
    """A scripted LLM that samples only once released (`release`, a threading.Event): until then the reply does
    not exist."""

    def __init__(self, tokenizer, replies):
        import threading

        super().__init__(tokenizer, replies)
        self.release = threading.Event()

    async def complete_ids(self, *args, **kwargs):
        import asyncio

        released = await asyncio.to_thread(self.release.wait, 20)
        self.release.clear()
        if not released:
            raise AssertionError("never released: the client saw nothing before the reply was sampled")
        return await super().complete_ids(*args, **kwargs)


def test_over_a_socket_the_first_streamed_event_comes_before_the_reply_is_sampled(tokenizer, agent_for):
    """Each protocol's first event (the role chunk, response.created, message_start) is sent once the request
    is rendered: a client on a socket reads it before the reply is sampled (the LLM samples only once the client
    has read it), the rest after."""
    seen = {}
    requests = {
        "chat": ("/chat/completions", {"messages": [{"role": "user", "content": "A"}]}),
        "responses": ("/responses", {"input": "A"}),
        "messages": ("/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "A"}]}),
    }
    llm = HeldLLM(tokenizer, ["one", "two", "three"])

    async def program(task, client):
        async with httpx.AsyncClient(timeout=30) as http:  # a real socket, as a harness's client
            for name, (path, body) in requests.items():
                async with http.stream("POST", task.base_url + path, headers={"x-api-key": task.api_key},
                                       json={"model": task.model, "stream": True, **body}) as response:  # fmt: skip
                    lines = response.aiter_lines()
                    seen[name] = [await anext(lines)]  # before the reply exists
                    llm.release.set()
                    seen[name] += [line async for line in lines if line]
        return 1.0

    tape = play(agent_for(program), llm)
    assert tape.metadata.error is None and len(tape.llm_calls) == 3
    assert "chat.completion.chunk" in seen["chat"][0] and seen["chat"][-1] == "data: [DONE]"
    assert seen["responses"][0] == "event: response.created" and "response.completed" in seen["responses"][-2]
    assert seen["messages"][0] == "event: message_start" and seen["messages"][-1].endswith('{"type": "message_stop"}')
