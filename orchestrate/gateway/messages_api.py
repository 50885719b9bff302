"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), translated to the gateway's chat path.

`system` (a string or text blocks) is the system message; each message's content blocks become chat messages:
`text` blocks its text, an assistant's `tool_use` blocks its tool calls (the input as JSON arguments), a user's
`tool_result` blocks tool messages (before the user's own text, as they come first in the message);
`thinking` and `redacted_thinking` blocks sent back are dropped (the policy wrote none); images and documents
are refused. `tools` (`input_schema`) are offered as functions; tools that need Anthropic's service (web
search, code execution: a `type` other than `custom`) are refused naming the field. `tool_choice` auto / any /
tool / none; `max_tokens` (required, as Anthropic's API has it), `stop_sequences`; `temperature`, `top_p`,
`top_k`, `thinking` and `metadata` are accepted and the run's sampling is used (the behaviour policy the
learner corrects for).

Streamed: `message_start` once the request is checked and rendered; after sampling, each block's
`content_block_start`, its `text_delta` or `input_json_delta` deltas, `content_block_stop`; then
`message_delta` (stop_reason, usage) and `message_stop`. A failure after the start is an `error` event.
Errors are in Anthropic's shape: `{"type": "error", "error": {"type": ..., "message": ...}}`.
"""

from __future__ import annotations

import json
from typing import Any

from orchestrate.gateway.chat_api import argument_pieces, sse, text_pieces
from orchestrate.gateway.session import ChatAnswer, EpisodeSession, GatewayError, PreparedChat, listed, text_parts

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def anthropic_error(exc: GatewayError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": str(exc)}}


def _blocks_text(content: Any, where: str) -> str:
    """Text of a string or of a list of text blocks (a system prompt, a tool's result)."""
    return text_parts(content, where, sep="\n", dotted=True)


class MessagesCall:
    """One POST /v1/messages (or /v1/messages/count_tokens: `counting`)."""

    name = "messages"
    error = staticmethod(anthropic_error)

    def __init__(self, body: dict[str, Any], session: EpisodeSession, counting: bool = False):
        self.body, self.session = body, session
        self.streamed = bool(body.get("stream")) and not counting
        limit = body.get("max_tokens")
        if not counting and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise GatewayError(400, "max_tokens: required, a positive integer")
        self.stops = body.get("stop_sequences") or []
        if not isinstance(self.stops, list) or not all(isinstance(s, str) for s in self.stops):
            raise GatewayError(400, "stop_sequences: expected a list of strings")
        self.tools = self._tools(body.get("tools"))
        self.messages = self._messages()
        self.id = ""

    def _tools(self, tools: Any) -> list[dict[str, Any]]:
        out = []
        for i, tool in enumerate(listed(tools, "tools", "tools")):
            if not isinstance(tool, dict):
                raise GatewayError(400, f"tools.{i}: expected a tool object")
            if tool.get("type") not in (None, "custom"):
                raise GatewayError(400, f"tools.{i}.type: {tool['type']!r} is a tool of Anthropic's service; a policy "
                                        "server serves custom tools (name, description, input_schema)")  # fmt: skip
            if not isinstance(tool.get("input_schema"), dict):
                raise GatewayError(400, f"tools.{i}.input_schema: required, a JSON schema")
            out.append({"type": "function", "function": {"name": tool.get("name"),
                        "description": tool.get("description") or "", "parameters": tool["input_schema"]}})  # fmt: skip
        return out

    def _tool_choice(self) -> Any:
        choice = self.body.get("tool_choice")
        kind = choice.get("type") if isinstance(choice, dict) else None
        if choice is None or kind == "auto":
            return "auto"
        if kind == "any":
            return "required"
        if kind == "none":
            return "none"
        if kind == "tool" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise GatewayError(400, "tool_choice.type: expected auto, any, tool (with a name) or none")

    def _messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        system = self.body.get("system")
        if system:
            out.append({"role": "system", "content": _blocks_text(system, "system")})
        messages = self.body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise GatewayError(400, "messages: expected a non-empty list of messages")
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ("user", "assistant"):
                raise GatewayError(400, f"messages.{i}.role: expected user or assistant")
            content = message.get("content")
            if isinstance(content, str):
                out.append({"role": role, "content": content})
                continue
            if not isinstance(content, list):
                raise GatewayError(400, f"messages.{i}.content: expected a string or a list of content blocks")
            texts, calls = [], []
            for j, block in enumerate(content):
                kind = block.get("type") if isinstance(block, dict) else None
                where = f"messages.{i}.content.{j}"
                if kind == "text" and isinstance(block.get("text"), str):
                    texts.append(block["text"])
                elif kind == "tool_use" and role == "assistant":
                    calls.append({"id": str(block.get("id", "")), "type": "function", "function": {
                        "name": block.get("name"), "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})  # fmt: skip
                elif kind == "tool_result" and role == "user":
                    result = block.get("content")
                    out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                                "content": "" if result is None else _blocks_text(result, f"{where}.content")})  # fmt: skip
                elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                    continue
                else:
                    raise GatewayError(400, f"{where}.type: a {kind!r} block is not served in a {role} message")
            if texts or calls or not content:
                message_out: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
                if calls:
                    message_out["tool_calls"] = calls
                out.append(message_out)
        return out

    def chat_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.body.get("model"), "messages": self.messages,
                                "max_tokens": self.body.get("max_tokens"), "stop": self.stops}  # fmt: skip
        if self.tools:
            body["tools"], body["tool_choice"] = self.tools, self._tool_choice()
        return body

    # -- the reply --------------------------------------------------------------------

    def _blocks(self, answer: ChatAnswer) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = [{"type": "text", "text": answer.content}] if answer.content else []
        for call in answer.tool_calls:
            try:
                arguments = json.loads(call["function"]["arguments"])
            except json.JSONDecodeError:
                arguments = None
            blocks.append({"type": "tool_use", "id": call["id"],
                           "name": call["function"]["name"], "input": arguments if isinstance(arguments, dict) else {}})  # fmt: skip
        return blocks

    def _message(self, answer: ChatAnswer | None, content: list[dict[str, Any]]) -> dict[str, Any]:
        prompt, generated = answer.usage if answer is not None else (self.prompt_tokens, 0)
        stop_reason = stop_sequence = None
        if answer is not None:
            stop_reason = STOP_REASONS.get(answer.finish_reason, "end_turn")
            if answer.stop_sequence is not None and answer.stop_sequence in self.stops:
                stop_reason, stop_sequence = "stop_sequence", answer.stop_sequence
        return {"id": self.id or f"msg_{answer.call.id}", "type": "message", "role": "assistant",
                "model": self.session.echo(self.body), "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": {"input_tokens": prompt, "output_tokens": generated,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}  # fmt: skip

    def reply(self, answer: ChatAnswer) -> dict[str, Any]:
        return self._message(answer, self._blocks(answer))

    # -- streamed ---------------------------------------------------------------------

    def head(self, prepared: PreparedChat) -> list[bytes]:
        self.id = f"msg_{self.session.id[:12]}_{self.session.calls + 1}"
        self.prompt_tokens = len(prepared.prompt_ids)
        return [sse({"type": "message_start", "message": self._message(None, [])}, "message_start")]

    def tail(self, answer: ChatAnswer) -> list[bytes]:
        out = []
        for n, block in enumerate(self._blocks(answer)):
            if block["type"] == "text":
                out.append(sse({"type": "content_block_start", "index": n, "content_block": {"type": "text", "text": ""}},
                               "content_block_start"))  # fmt: skip
                for text, _ in text_pieces(self.session, answer):
                    out.append(sse({"type": "content_block_delta", "index": n,
                                    "delta": {"type": "text_delta", "text": text}}, "content_block_delta"))  # fmt: skip
            else:
                out.append(sse({"type": "content_block_start", "index": n, "content_block": {**block, "input": {}}},
                               "content_block_start"))  # fmt: skip
                for piece in argument_pieces(json.dumps(block["input"], ensure_ascii=False)):
                    out.append(sse({"type": "content_block_delta", "index": n,
                                    "delta": {"type": "input_json_delta", "partial_json": piece}}, "content_block_delta"))  # fmt: skip
            out.append(sse({"type": "content_block_stop", "index": n}, "content_block_stop"))
        final = self._message(answer, [])
        out.append(sse({"type": "message_delta", "delta": {"stop_reason": final["stop_reason"],
                        "stop_sequence": final["stop_sequence"]}, "usage": final["usage"]}, "message_delta"))  # fmt: skip
        return [*out, sse({"type": "message_stop"}, "message_stop")]

    def failed(self, exc: GatewayError) -> list[bytes]:
        return [sse(anthropic_error(exc), "error")]
