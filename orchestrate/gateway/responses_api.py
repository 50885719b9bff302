"""OpenAI's Responses API (POST /v1/responses), translated to the gateway's chat path and back.

The request's `instructions` become the system message and its `input` items the chat messages: a message
(text parts), a `function_call` (an assistant message's tool call; calls that follow an assistant message or
one another join it), a `function_call_output` (a tool message); `custom_tool_call` and `local_shell_call`
items and their outputs likewise; reasoning items sent back are dropped (the policy wrote none). With
`previous_response_id` the episode's stored conversation comes first (the responses this episode made with
`store` not false; the earlier `instructions` are not carried over, as OpenAI does), so a harness that sends
only what is new and one that resends its whole history (Codex) render the same tokens.

Tools: `function` tools as they are; `custom` tools (free-form input, Codex's apply_patch) as a function of one
string `input`, their calls sent back as `custom_tool_call` items; `local_shell` as a function of `command`
(a list of strings), sent back as `local_shell_call`. Tools that need a service (web and file search, computer
use, code interpreter, image generation, MCP), `background`, `conversation`, `prompt` and `truncation: auto`
are refused naming the field. `reasoning`, `text` (verbosity, a JSON format: not enforced, no guided
decoding), `include`, `parallel_tool_calls`, `temperature` and `top_p` are accepted; the run's sampling is the
behaviour policy the learner corrects for, as on the chat path.

Streamed: `response.created`, `response.in_progress` once the request is checked and rendered; after
sampling each output item's `response.output_item.added`, its text deltas (`response.content_part.added`,
`response.output_text.delta`, `.done`, `response.content_part.done`) or argument deltas
(`response.function_call_arguments.delta`, `.done`), `response.output_item.done`; then `response.completed`
(or `response.incomplete` where the reply was cut by `max_output_tokens`) with usage.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from orchestrate.gateway.chat_api import argument_pieces, openai_error, sse, text_pieces
from orchestrate.gateway.session import ChatAnswer, EpisodeSession, GatewayError, PreparedChat, listed, text_parts

HOSTED = {"web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search", "computer_use",
          "computer_use_preview", "code_interpreter", "image_generation", "mcp"}  # fmt: skip
REFUSED = {  # request fields a policy server cannot honour: field -> why
    "background": "background mode needs a response service; this gateway answers in the request",
    "conversation": "conversations are kept by OpenAI's service; send previous_response_id or the whole input",
    "prompt": "prompt templates are kept by OpenAI's service; send instructions and input",
}
SHELL = "local_shell"  # the function a local_shell tool is offered to the model as


def _text_of(content: Any, where: str) -> str:
    """A message item's content as text: a string, or input_text / output_text / refusal parts."""
    if content is None:
        raise GatewayError(400, f"{where}.content: expected a string or a list of content parts")
    return text_parts(content, f"{where}.content", ("input_text", "output_text", "text"), refusals=True)


def _output_text(output: Any, where: str) -> str:
    """A tool call's output: a string, or a list of text parts."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _text_of(output, where)
    raise GatewayError(400, f"{where}.output: expected a string or a list of text parts")


class ResponsesCall:
    """One POST /v1/responses."""

    name = "responses"
    error = staticmethod(openai_error)

    def __init__(self, body: dict[str, Any], session: EpisodeSession):
        self.body, self.session = body, session
        for field, why in REFUSED.items():
            if body.get(field):
                raise GatewayError(400, f"{field}: not served ({why})")
        if body.get("truncation") not in (None, "disabled"):
            raise GatewayError(400, "truncation: only 'disabled' is served (the gateway never drops input items)")
        if body.get("top_logprobs"):
            raise GatewayError(400, "top_logprobs: alternatives are not served")
        self.streamed = bool(body.get("stream"))
        self.store = body.get("store") is not False
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.kinds: dict[str, str] = {}  # a chat tool's name -> the Responses tool type it stands for
        self.tools = self._tools(body.get("tools"))
        self.conversation = self._conversation()
        self._sequence = 0

    # -- the request as chat ----------------------------------------------------------

    def _tools(self, tools: Any) -> list[dict[str, Any]]:
        out = []
        for i, tool in enumerate(listed(tools, "tools", "tools")):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind == "function":
                name = tool.get("name")
                function = {"name": name, "description": tool.get("description") or "",
                            "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}  # fmt: skip
            elif kind == "custom":
                name = tool.get("name")
                about = tool.get("description") or ""
                grammar = (tool.get("format") or {}).get("definition") if isinstance(tool.get("format"), dict) else None
                function = {"name": name, "description": about + (f"\nInput grammar:\n{grammar}" if grammar else ""),
                            "parameters": {"type": "object", "properties": {"input": {"type": "string", "description":
                                           "the tool's free-form input"}}, "required": ["input"]}}  # fmt: skip
            elif kind == "local_shell":
                name = SHELL
                function = {"name": name, "description": "Run a command on the local machine; its output comes back.",
                            "parameters": {"type": "object", "properties": {"command": {"type": "array", "items":
                                           {"type": "string"}, "description": "the program and its arguments"},
                                           "workdir": {"type": "string"}, "timeout_ms": {"type": "integer"}},
                                           "required": ["command"]}}  # fmt: skip
            elif kind in HOSTED:
                raise GatewayError(400, f"tools[{i}].type: {kind!r} is a hosted tool that needs OpenAI's service; "
                                        "a policy server serves function, custom and local_shell tools")  # fmt: skip
            else:
                raise GatewayError(400, f"tools[{i}].type: {kind!r} is not served (function, custom, local_shell)")
            if not isinstance(name, str) or not name:
                raise GatewayError(400, f"tools[{i}].name: expected a name")
            self.kinds[name] = kind
            out.append({"type": "function", "function": function})
        return out

    def _tool_choice(self) -> Any:
        choice = self.body.get("tool_choice")
        if choice is None or choice in ("auto", "none", "required"):
            return choice
        if (
            isinstance(choice, dict)
            and choice.get("type") in ("function", "custom")
            and isinstance(choice.get("name"), str)
        ):
            return {"type": "function", "function": {"name": choice["name"]}}
        if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
            return "required" if choice.get("mode") == "required" else "auto"
        raise GatewayError(400, "tool_choice: expected 'auto', 'none', 'required' or "
                                '{"type": "function", "name": ...}')  # fmt: skip

    def _conversation(self) -> list[dict[str, Any]]:
        """The chat messages of the stored conversation (previous_response_id) and this request's input."""
        previous = self.body.get("previous_response_id")
        before: list[dict[str, Any]] = []
        if previous is not None:
            if previous not in self.session.responses:
                raise GatewayError(404, f"previous_response_id: no response {previous!r} stored in this episode "
                                        "(made with store false, or another episode's)", "not_found_error")  # fmt: skip
            before = [dict(m) for m in self.session.responses[previous]]
        items = self.body.get("input")
        if isinstance(items, str):
            return [*before, {"role": "user", "content": items}]
        if not isinstance(items, list) or (not items and not before):
            raise GatewayError(400, "input: expected a string or a non-empty list of items")
        out = before
        calls_open = False  # the last message is an assistant message that later calls join
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise GatewayError(400, f"input[{i}]: expected an item object")
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise GatewayError(400, f"input[{i}].role: expected user, system, developer or assistant")
                text = _text_of(item.get("content"), f"input[{i}]")
                out.append({"role": "system" if role == "developer" else role, "content": text})
                calls_open = role == "assistant"
            elif kind in ("function_call", "custom_tool_call", "local_shell_call"):
                call = self._call_item(item, kind, f"input[{i}]")
                if not calls_open:
                    out.append({"role": "assistant", "content": ""})
                    calls_open = True
                out[-1].setdefault("tool_calls", []).append(call)
            elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
                call_id = item.get("call_id") or item.get("id")
                if not isinstance(call_id, str):
                    raise GatewayError(400, f"input[{i}].call_id: expected the call's id")
                out.append({"role": "tool", "tool_call_id": call_id,
                            "content": _output_text(item.get("output"), f"input[{i}]")})  # fmt: skip
                calls_open = False
            elif kind == "reasoning":
                continue  # the policy wrote no reasoning items: one sent back carries nothing to render
            else:
                raise GatewayError(400, f"input[{i}].type: items of type {kind!r} are not served")
        return out

    def _call_item(self, item: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
        call_id = item.get("call_id") or item.get("id") or ""
        if kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments", "{}")
        elif kind == "custom_tool_call":
            name, arguments = item.get("name"), json.dumps({"input": item.get("input", "")}, ensure_ascii=False)
        else:
            action = item.get("action") or {}
            name = SHELL
            arguments = json.dumps({k: action[k] for k in ("command", "workdir", "timeout_ms") if k in action},
                                   ensure_ascii=False)  # fmt: skip
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise GatewayError(400, f"{where}: expected a call with a name and its arguments as a string")
        return {"id": str(call_id), "type": "function", "function": {"name": name, "arguments": arguments}}

    def chat_body(self) -> dict[str, Any]:
        instructions = self.body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise GatewayError(400, "instructions: expected a string")
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + self.conversation
        limit = self.body.get("max_output_tokens")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise GatewayError(400, "max_output_tokens: expected a positive integer")
        body: dict[str, Any] = {"model": self.body.get("model"), "messages": messages, "max_tokens": limit}
        if self.tools:
            body["tools"] = self.tools
            body["tool_choice"] = self._tool_choice()
        return body

    # -- the reply --------------------------------------------------------------------

    def _items(self, answer: ChatAnswer) -> list[dict[str, Any]]:
        items = []
        if answer.content:
            items.append({"type": "message", "id": f"msg_{answer.call.id}", "status": "completed",
                          "role": "assistant", "content": [{"type": "output_text", "text": answer.content,
                                                            "annotations": [], "logprobs": []}]})  # fmt: skip
        for i, call in enumerate(answer.tool_calls):
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            kind, item_id = self.kinds.get(name, "function"), f"fc_{answer.call.id}_{i}"
            if kind == "custom":
                items.append({"type": "custom_tool_call", "id": item_id, "call_id": call["id"], "name": name,
                              "input": _custom_input(arguments), "status": "completed"})  # fmt: skip
            elif kind == "local_shell":
                action = _json_object(arguments)
                items.append({"type": "local_shell_call", "id": item_id, "call_id": call["id"], "status": "completed",
                              "action": {"type": "exec", "command": action.get("command", []), "env": {},
                                         **{k: action[k] for k in ("workdir", "timeout_ms") if k in action}}})  # fmt: skip
            else:
                items.append({"type": "function_call", "id": item_id, "call_id": call["id"], "name": name,
                              "arguments": arguments, "status": "completed"})  # fmt: skip
        return items

    def _response(self, status: str, output: list[dict[str, Any]], answer: ChatAnswer | None) -> dict[str, Any]:
        b = self.body
        usage = None
        if answer is not None:
            prompt, generated = answer.usage
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt + generated}  # fmt: skip
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.session.echo(self.body), "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "metadata": b.get("metadata") or {}, "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"), "reasoning": b.get("reasoning"),
            "store": self.store, "temperature": self.session.sampling.temperature,
            "text": b.get("text") or {"format": {"type": "text"}}, "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [], "top_p": self.session.sampling.top_p, "truncation": "disabled",
        }  # fmt: skip

    def _finish(self, answer: ChatAnswer) -> tuple[str, list[dict[str, Any]]]:
        """The response's status and output items; the conversation stored for a later previous_response_id."""
        if self.store:
            reply: dict[str, Any] = {"role": "assistant", "content": answer.content or ""}
            if answer.tool_calls:
                reply["tool_calls"] = answer.tool_calls
            self.session.responses[self.id] = [*self.conversation, reply]
        return ("incomplete" if answer.finish_reason == "length" else "completed"), self._items(answer)

    def reply(self, answer: ChatAnswer) -> dict[str, Any]:
        status, items = self._finish(answer)
        return self._response(status, items, answer)

    # -- streamed ---------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._sequence += 1
        return sse({"type": kind, "sequence_number": self._sequence - 1, **fields}, kind)

    def head(self, prepared: PreparedChat) -> list[bytes]:
        started = self._response("in_progress", [], None)
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]  # fmt: skip

    def tail(self, answer: ChatAnswer) -> list[bytes]:
        status, items = self._finish(answer)
        out = []
        for n, item in enumerate(items):
            started = {**item, "status": "in_progress"}
            if item["type"] == "message":
                started["content"] = []
            elif item["type"] == "function_call":
                started["arguments"] = ""
            out.append(self._event("response.output_item.added", output_index=n, item=started))
            if item["type"] == "message":
                at = {"item_id": item["id"], "output_index": n, "content_index": 0}
                out.append(self._event("response.content_part.added", **at,
                                       part={"type": "output_text", "text": "", "annotations": []}))  # fmt: skip
                for text, _ in text_pieces(self.session, answer):
                    out.append(self._event("response.output_text.delta", **at, delta=text, logprobs=[]))
                text = item["content"][0]["text"]
                out.append(self._event("response.output_text.done", **at, text=text, logprobs=[]))
                out.append(self._event("response.content_part.done", **at, part=item["content"][0]))
            elif item["type"] == "function_call":
                for piece in argument_pieces(item["arguments"]):
                    out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                           output_index=n, delta=piece))  # fmt: skip
                out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=n,
                                       name=item["name"], arguments=item["arguments"]))  # fmt: skip
            elif item["type"] == "custom_tool_call":
                out.append(self._event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=n,
                                       delta=item["input"]))  # fmt: skip
                out.append(self._event("response.custom_tool_call_input.done", item_id=item["id"], output_index=n,
                                       input=item["input"]))  # fmt: skip
            out.append(self._event("response.output_item.done", output_index=n, item=item))
        final = self._response(status, items, answer)
        return [*out, self._event(f"response.{status}", response=final)]

    def failed(self, exc: GatewayError) -> list[bytes]:
        failed = {**self._response("failed", [], None),
                  "error": {"code": exc.code or exc.kind, "message": str(exc)}}  # fmt: skip
        return [self._event("error", code=exc.code or exc.kind, message=str(exc), param=None),
                self._event("response.failed", response=failed)]  # fmt: skip


def _json_object(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _custom_input(arguments: str) -> str:
    """A custom tool's free-form input from the function call the model wrote (`{"input": ...}`)."""
    value = _json_object(arguments).get("input")
    return value if isinstance(value, str) else arguments
