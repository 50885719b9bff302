"""OpenAI's chat completions, whole and streamed: the gateway's own protocol, which the others translate into.

A streamed reply is sampled whole, then sent as server-sent events in OpenAI's chunk shape (the role, the text in
pieces, each tool call's id and name then its arguments in fragments, the finish reason, usage last when
`stream_options.include_usage`, then `data: [DONE]`): the tape holds the same call, ids and log-probs as the
request without `stream`. The first chunk goes out once the request has been checked and rendered, before
sampling, so a client's first byte comes as soon as the request is accepted; a failure after it (the servers)
is a chunk holding OpenAI's error, then the end of the stream.
"""

from __future__ import annotations

import json
import time
from typing import Any

from orchestrate.gateway.session import ChatAnswer, EpisodeSession, GatewayError, PreparedChat

ARGUMENT_PIECE = 16  # characters of a tool call's arguments per chunk


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event: JSON data (or a literal string), under an event name where the protocol has them."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "").encode() + f"data: {payload}\n\n".encode()


def text_pieces(session: EpisodeSession, answer: ChatAnswer) -> list[tuple[str, list[tuple[str, float]]]]:
    """The reply's text in the pieces its tokens sampled, each with its (token, log-prob); where the text is not
    the tokens' (a tool call parsed out of it) it is one piece holding every token."""
    content = answer.content or ""
    tokens = list(zip(session.tokens_of(answer.call), answer.call.logprobs))
    pieces, at = [], 0
    for token, logprob in tokens:
        if at >= len(content) or not content.startswith(token, at):
            break
        pieces.append((token, [(token, logprob)]))
        at += len(token)
    if at == len(content):
        return pieces
    return [(content, tokens)]


def argument_pieces(arguments: str) -> list[str]:
    return [arguments[i : i + ARGUMENT_PIECE] for i in range(0, len(arguments), ARGUMENT_PIECE)] or [""]


def openai_error(exc: GatewayError) -> dict[str, Any]:
    return exc.body()


class ChatCall:
    """One POST /v1/chat/completions."""

    name = "chat.completions"
    error = staticmethod(openai_error)

    def __init__(self, body: dict[str, Any], session: EpisodeSession):
        self.body, self.session = body, session
        self.streamed = bool(body.get("stream"))
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise GatewayError(400, "stream_options: expected an object")
        self.usage_chunk = bool(self.streamed and options and options.get("include_usage"))
        self.logprobs = bool(body.get("logprobs"))
        self.created = int(time.time())
        self.id = ""

    def chat_body(self) -> dict[str, Any]:
        return self.body

    def reply(self, answer: ChatAnswer) -> dict[str, Any]:
        return self.session.chat_completion(answer, self.logprobs)

    # -- streamed ---------------------------------------------------------------------

    def _chunk(self, delta: dict[str, Any] | None, finish: str | None = None, logprobs: Any = None,
               usage: dict[str, int] | None = None) -> bytes:  # fmt: skip
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.session.echo(self.body), "choices": choices}  # fmt: skip
        if self.usage_chunk:
            chunk["usage"] = usage
        return sse(chunk)

    def head(self, prepared: PreparedChat) -> list[bytes]:
        self.id = f"chatcmpl-{self.session.id[:12]}-{self.session.calls + 1}"
        return [self._chunk({"role": "assistant", "content": ""})]

    def tail(self, answer: ChatAnswer) -> list[bytes]:
        out = []
        for text, logprobs in text_pieces(self.session, answer):
            lp = None
            if self.logprobs:
                lp = {"content": [{"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
                                  for t, v in logprobs]}  # fmt: skip
            out.append(self._chunk({"content": text}, logprobs=lp))
        for i, call in enumerate(answer.tool_calls):
            function = call["function"]
            out.append(self._chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                                    "function": {"name": function["name"], "arguments": ""}}]}))  # fmt: skip
            for piece in argument_pieces(function["arguments"]):
                out.append(self._chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
        out.append(self._chunk({}, finish=answer.finish_reason))
        if self.usage_chunk:
            prompt, output = answer.usage
            out.append(self._chunk(None, usage={"prompt_tokens": prompt, "completion_tokens": output,
                                                "total_tokens": prompt + output}))  # fmt: skip
        return [*out, sse("[DONE]")]

    def failed(self, exc: GatewayError) -> list[bytes]:
        return [sse(exc.body()), sse("[DONE]")]
