"""One episode's calls through the gateway, recorded token-exactly on its tape.

A chat request's messages are compared with the previous call's messages and the reply it got. When they
extend them (the same messages, that reply, then new ones: tool results, a user message), the prompt sent to
vLLM is the previous prompt ids + the ids it sampled + the template's rendering of the new messages alone
(`agents.chat.ChatTokens`), so what is trained is exactly what was sampled. When they do not (a history
edited or summarised, a sub-agent, a retry), the messages are rendered whole and the call starts a new
sample of the same episode (`LLMCall.extends_previous` False; `prompt_mismatches` in metrics counts them).
A reply is compared as what it said: the same tool calls (names and arguments as JSON values) and the same
text, or no text where the client left it out.

Each call goes on the tape as its LLM call (prompt and output ids and log-probs from the server) and its
steps: the messages it added (`ToolResultObservation` for a tool's result, `ProgramMessage` for a user or
system message), then what the model did (one `ToolCallAction` per tool call, or an `AgentMessage`).

A fault of the program's own (a prompt longer than the context, an unknown model, malformed tools or
messages) is answered with an HTTP error it can read (`GatewayError`) and kept in `error`: the episode
is then an infrastructure failure, left out of training. A server failure (`LLMError`) is kept in
`server_error` and stops the run, as with the built-in agent.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from agents.agent import RoleLLMs
from agents.chat import ChatTokens
from agents.tool_format import ToolFormat, ToolFormatError, check_tools, same_calls, written
from tapes.tape import (
    AgentMessage,
    LLMCall,
    ProgramMessage,
    SamplingParams,
    Tape,
    ToolCallAction,
    ToolResultObservation,
)


class GatewayError(Exception):
    """An HTTP error for the program: status, OpenAI error type, message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code

    def body(self) -> dict[str, Any]:
        """OpenAI's error shape: a type, and a string code where there is one (`context_length_exceeded`, which
        frameworks read to shorten their history)."""
        return {"error": {"message": str(self), "type": self.kind, "param": None, "code": self.code}}


def listed(value: Any, field: str, of: str) -> list[Any]:
    """A request's list field: absent or null is empty; anything else but a list is refused naming it."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise GatewayError(400, f"{field}: expected a list of {of}")
    return value


def text_parts(content: Any, where: str, kinds: tuple[str, ...] = ("text",), sep: str = "", dotted: bool = False,
               refusals: bool = False) -> str:  # fmt: skip
    """A content as text: a string, null, or a list of parts of `kinds` (each part's `text`; a `refusal` part's
    refusal where `refusals`), joined by `sep`. Any other part is refused naming its place: `where[j]` (or
    `where.j`, `dotted`, as Anthropic writes it)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}: expected a string or a list of text parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in kinds and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif refusals and kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        else:
            place = f"{where}.{j}" if dotted else f"{where}[{j}]"
            raise GatewayError(400, f"{place}: content of type {kind!r} is not served (text only)")
    return sep.join(out)


def offered_tools(choice: Any, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools a reply's calls are parsed against, by `tool_choice`: none of them ("none"); all of them
    ("auto", absent, or "required"); the one a {"type": "function", "function": {"name": ...}} names. A forced
    call is not enforced while sampling (no guided decoding): the model is offered the tools, and a reply
    without a call comes back as text, the model's own doing, trained on like any other."""
    if choice in (None, "auto", "required"):
        return tools
    if choice == "none":
        return []
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str):
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise GatewayError(400, f"tool_choice: names function {name!r}, which is not in tools")
        return named
    raise GatewayError(400, "tool_choice: expected 'auto', 'none', 'required' or "
                            '{"type": "function", "function": {"name": ...}}')  # fmt: skip


def normalise(messages: Any) -> list[dict[str, Any]]:
    """The request's messages as the template reads them: role, text content, tool calls, tool call id."""
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages: expected a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise GatewayError(400, f"{where}: expected a message with role system, user, assistant or tool")
        role = "system" if message["role"] == "developer" else message["role"]
        clean: dict[str, Any] = {"role": role, "content": text_parts(message.get("content"), f"{where}.content")}
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
            ):
                raise GatewayError(400, f"{where}.tool_calls: expected a list of function calls")
            clean["tool_calls"] = [
                {"id": str(c.get("id", "")), "type": "function",
                 "function": {"name": c["function"].get("name"), "arguments": c["function"].get("arguments", "{}")}}
                for c in calls
            ]  # fmt: skip
        if role == "tool":
            clean["tool_call_id"] = str(message.get("tool_call_id", ""))
        out.append(clean)
    return out


def _same_message(sent: dict[str, Any], echoed: dict[str, Any]) -> bool:
    """Is `echoed` (from the client) the message `sent`? A reply: the same calls, and the same text or none."""
    if sent["role"] != echoed["role"]:
        return False
    if sent["role"] != "assistant":
        return sent == echoed
    if not same_calls(sent.get("tool_calls", []), echoed.get("tool_calls", [])):
        return False
    return echoed["content"].strip() in ("", sent["content"].strip())


@dataclass
class Thread:
    """One role's conversation in an episode (the episode's one agent's: role None): its previous chat call's
    messages + the reply it got, its tools, its prompt + output ids, the call itself."""

    history: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    ids: list[int] | None = None
    last_call: LLMCall | None = None


@dataclass
class PreparedChat:
    """A chat request rendered and checked, not yet sent: what `EpisodeSession.answer` samples."""

    protocol: str  # recorded on the call: the API it came in on
    role: str | None  # the role that asked (agent.roles; None: the episode's one agent)
    messages: list[dict[str, Any]]
    new: list[dict[str, Any]]  # the messages not already on the tape
    tools: list[dict[str, Any]]
    offered: list[dict[str, Any]]  # the tools a reply's calls are parsed against (tool_choice)
    sampling: SamplingParams
    prompt_ids: list[int]
    prompt_text: str
    extends: bool
    asked_stops: list[str]


@dataclass
class ChatAnswer:
    """One sampled reply as every protocol reads it: the call on the tape, its text and tool calls."""

    call: LLMCall
    content: str | None  # the text less its tool calls (None: the calls alone)
    tool_calls: list[dict[str, Any]]  # OpenAI's shape, ids of ours
    finish_reason: str  # stop, length or tool_calls
    stop_sequence: str | None  # the request's stop string that ended it, left out of the text

    @property
    def usage(self) -> tuple[int, int]:
        """(prompt tokens, output tokens)."""
        return len(self.call.prompt_token_ids), len(self.call.output_token_ids)


class EpisodeSession:
    """The gateway's side of one episode: its tape, its LLM (a VLLMClient, or a ReplayLLM for a replay), the
    run's sampling, and the previous call to extend."""

    def __init__(
        self,
        episode_id: str,
        tape: Tape,
        llm: Any,
        chat: ChatTokens,
        tool_format: ToolFormat,
        sampling: SamplingParams,
        *,
        model_name: str,
        max_context: int | None,
        loop: asyncio.AbstractEventLoop,
        roles: tuple[str, ...] = (),
        bindings: dict[str, str] | None = None,
    ):
        self.id, self.tape, self.llm, self.tokens, self.tools = episode_id, tape, llm, chat, tool_format
        self.sampling, self.model_name, self.max_context, self.loop = sampling, model_name, max_context, loop
        self.roles = tuple(roles)  # the model names served, each a role's (none: model_name, the one agent's)
        self.llm_for = RoleLLMs(llm, bindings)  # the LLM that answers each role (agent.roles' binding)
        self.calls = 0
        self.mismatches = 0
        self.closed = False
        self.error: str | None = None  # the program's first fault (GatewayError)
        self.server_error: BaseException | None = None
        self.last_reply = ""  # the last call's text (sent to the environment when the program returns None)
        self._threads: dict[str | None, Thread] = {}  # each role's conversation: its previous call to extend
        self.last_turns: dict[str | None, int] = {}  # each role's latest turn (its rewards go there)
        self._names: dict[str, str] = {}  # tool call id -> the function it called
        # the Responses API's stored responses (orchestrate.gateway.responses_api): id -> its conversation
        self.responses: dict[str, list[dict[str, Any]]] = {}
        # a program process's task operations (orchestrate.gateway.agent ProgramAgent._in_process)
        self.control: dict[str, Any] | None = None

    def fault(self, error: GatewayError) -> GatewayError:
        if self.error is None:
            self.error = f"gateway: HTTP {error.status}: {error}"
        return error

    # -- requests ----------------------------------------------------------------

    @property
    def served(self) -> tuple[str, ...]:
        """The model names a request may send: the roles', or the one agent's."""
        return self.roles or (self.model_name,)

    def _check_model(self, body: dict[str, Any]) -> str | None:
        """The role a request's `model` names (None: the episode's one agent); a name not served is refused."""
        model = body.get("model")
        if model not in self.served:
            names = " or ".join(repr(n) for n in self.served)
            what = f"the run's roles are {names}" if self.roles else f"this gateway serves {names}"
            raise GatewayError(404, f"model {model!r} is not served here; {what}", "not_found_error")
        return model if self.roles else None

    def echo(self, body: dict[str, Any]) -> str:
        """The model name a reply names: the role the request asked for, or the one agent's."""
        model = body.get("model")
        return model if self.roles and model in self.roles else self.model_name

    def thread(self, role: str | None) -> Thread:
        return self._threads.setdefault(role, Thread())

    @staticmethod
    def _asked_stops(body: dict[str, Any]) -> list[str]:
        """The stop strings a request asks for."""
        asked = body.get("stop") or []
        asked = [asked] if isinstance(asked, str) else asked
        if not isinstance(asked, list) or not all(isinstance(s, str) for s in asked):
            raise GatewayError(400, "stop: expected a string or a list of strings")
        return asked

    def _sampling(self, body: dict[str, Any], stop: list[str]) -> SamplingParams:
        """The run's sampling (its temperature and top_p are the behaviour policy the learner corrects for);
        a request may ask for fewer new tokens and add stop strings."""
        if body.get("n") not in (None, 1):  # a client may send null for what it leaves unset
            raise GatewayError(400, "n: one choice per request is served")
        top = body.get("top_logprobs")
        legacy = body.get("logprobs")  # /v1/completions: the number of alternatives beside the sampled token
        if top or (isinstance(legacy, int) and not isinstance(legacy, bool) and legacy > 0):
            raise GatewayError(400, "top_logprobs: alternatives are not served; the sampled tokens' log-probs are "
                                    "(logprobs true, or 0 on /v1/completions)")  # fmt: skip
        limit = body.get("max_completion_tokens")
        limit = body.get("max_tokens") if limit is None else limit
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise GatewayError(400, "max_tokens: expected a positive integer")
        asked = self._asked_stops(body)
        max_tokens = min(limit or self.sampling.max_tokens, self.sampling.max_tokens)
        stops = [*self.sampling.stop, *(s for s in [*asked, *stop] if s not in self.sampling.stop)]
        return self.sampling.model_copy(update={"max_tokens": max_tokens, "stop": list(dict.fromkeys(stops))})

    def _fit(self, prompt_ids: list[int], sampling: SamplingParams) -> SamplingParams:
        if self.max_context is None:
            return sampling
        room = self.max_context - len(prompt_ids)
        if room < 1:
            raise GatewayError(400, f"the prompt has {len(prompt_ids)} tokens; the model's context is "
                                    f"{self.max_context} (prompt + new tokens)", code="context_length_exceeded")  # fmt: skip
        return sampling if sampling.max_tokens <= room else sampling.model_copy(update={"max_tokens": room})

    async def _complete(self, prompt_ids, sampling, messages, prompt_text, role: str | None = None) -> LLMCall:
        from orchestrate.serving.llm import LLMError, RequestRejected

        try:
            call = await self.llm_for(role).complete_ids(prompt_ids, sampling, messages=messages,
                                                         prompt_text=prompt_text)  # fmt: skip
        except RequestRejected as exc:
            raise GatewayError(400, f"the server refused the request: {exc}") from None
        except LLMError as exc:
            self.server_error = exc
            raise GatewayError(503, f"the policy servers failed: {exc}", "server_error") from None
        if self.closed:  # the episode ended (its time limit) while this call was in flight: its tape is written
            raise GatewayError(409, f"episode {self.id} ended while this call was in flight; its reply is not "
                                    "recorded", "episode_ended")  # fmt: skip
        return call

    def _without_stop(self, call: LLMCall, asked: list[str]) -> str:
        """The call's text less the stop string the request asked for that ended it (the OpenAI API leaves it
        out; the tape keeps the sampled ids, the stop string's among them). A turn ended by its end-of-turn token
        ended on no stop string, whatever its text ends with."""
        text, ids = call.output_text, call.output_token_ids
        if call.finish_reason == "stop" and not (ids and ids[-1] in set(self.tokens.tokenizer.all_special_ids)):
            for stop in asked:
                if stop and text.endswith(stop):
                    return text[: -len(stop)]
        return text

    async def prepare_chat(
        self, body: dict[str, Any], protocol: str = "chat.completions", fit: bool = True
    ) -> PreparedChat:
        """A chat request checked and rendered, nothing sent nor recorded yet: every fault of the request's own is
        raised here (a streamed reply starts only once this has passed)."""
        role = self._check_model(body)
        thread = self.thread(role)
        messages = normalise(body.get("messages"))
        try:
            tools = check_tools(body.get("tools"))
        except ToolFormatError as exc:
            raise GatewayError(400, str(exc)) from None
        offered = offered_tools(body.get("tool_choice"), tools)
        sampling = self._sampling(body, self.tools.stop(offered))
        t = thread
        extends = (
            t.ids is not None
            and tools == t.tools
            and len(messages) > len(t.history)
            and all(_same_message(a, b) for a, b in zip(t.history, messages))
        )
        try:
            if extends:
                new = messages[len(t.history) :]
                previous_calls = t.history[-1].get("tool_calls")
                delta = self.tokens.close_turn(t.last_call.output_token_ids) + self.tokens.messages_delta(
                    self.tools.prepare(new, []), previous_calls if self.tools.renders_tool_calls else None,
                    **self.tools.template_kwargs(tools),
                )  # fmt: skip
                prompt_ids = t.ids + self.tokens.encode(delta)
                prompt_text = t.last_call.prompt_text + self.tokens.tokenizer.decode(
                    t.last_call.output_token_ids, skip_special_tokens=False) + delta  # fmt: skip
            else:
                new = messages[_common_prefix(t.history, messages) :]
                prompt_text, prompt_ids = self.tokens.first_prompt(
                    self.tools.prepare(messages, tools), **self.tools.template_kwargs(tools)
                )
        except (ValueError, TypeError, KeyError, TemplateError) as exc:  # the template refused these messages
            raise GatewayError(400, f"messages: the chat template cannot render them ({exc})") from None
        sampling = self._fit(prompt_ids, sampling) if fit else sampling
        return PreparedChat(protocol, role, messages, new, tools, offered, sampling, prompt_ids,
                            prompt_text, extends, self._asked_stops(body))  # fmt: skip

    async def answer(self, prepared: PreparedChat) -> ChatAnswer:
        """The prepared call sampled, parsed and recorded on the tape."""
        p = prepared
        call = await self._complete(p.prompt_ids, p.sampling, p.messages, p.prompt_text, p.role)
        call.protocol, call.role = p.protocol, p.role
        text = self._without_stop(call, p.asked_stops)
        content, calls = self.tools.parse(text, p.offered)
        for i, c in enumerate(calls):  # ids of ours, the same in a replay (the parser's are random)
            c["id"] = f"call_{self.calls + 1}_{i}"
        thread = self.thread(p.role)
        self._record(call, p.new, calls, p.extends, thread)
        reply: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if calls:
            reply["tool_calls"] = calls
        thread.history, thread.tools, thread.last_call = [*p.messages, reply], p.tools, call
        thread.ids = call.prompt_token_ids + call.output_token_ids
        self.last_reply = content or ""
        finish = "tool_calls" if calls else call.finish_reason or "stop"
        stop_sequence = call.output_text[len(text) :] or None
        return ChatAnswer(call, content, calls, finish, stop_sequence)

    async def count_tokens(self, body: dict[str, Any]) -> int:
        """The tokens a chat request's prompt would take here, nothing sent nor recorded."""
        return len((await self.prepare_chat(body, fit=False)).prompt_ids)

    async def chat(self, body: dict[str, Any], protocol: str = "chat.completions") -> ChatAnswer:
        """A chat request whole: checked, sampled, recorded."""
        return await self.answer(await self.prepare_chat(body, protocol))

    def chat_completion(self, answer: ChatAnswer, logprobs: bool = False) -> dict[str, Any]:
        """POST /v1/chat/completions' reply."""
        message: dict[str, Any] = {"role": "assistant", "content": answer.content}
        if answer.tool_calls:
            message["tool_calls"] = answer.tool_calls
        return self._response("chat.completion", answer.call, {
            "index": 0, "message": message, "finish_reason": answer.finish_reason,
            "logprobs": chat_logprobs(self.tokens_of(answer.call), answer.call) if logprobs else None})  # fmt: skip

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/completions: a prompt as text or token ids, continued as sent."""
        role = self._check_model(body)
        thread = self.thread(role)
        if body.get("stream"):
            raise GatewayError(400, "stream: /v1/completions is not streamed here; send stream=false (chat "
                                    "completions, responses and messages stream)")  # fmt: skip
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            prompt_text, prompt_ids = prompt, self.tokens.encode(prompt)
        elif (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            prompt_ids = list(prompt)
            prompt_text = self.tokens.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        else:
            raise GatewayError(400, "prompt: expected a non-empty string or list of token ids (one prompt)")
        sampling = self._fit(prompt_ids, self._sampling(body, []))
        t = thread
        extends = t.ids is not None and len(prompt_ids) > len(t.ids) and prompt_ids[: len(t.ids)] == t.ids
        call = await self._complete(prompt_ids, sampling, [], prompt_text, role)
        call.protocol, call.role = "completions", role
        self._record(call, [], [], extends, t)
        t.history, t.tools, t.last_call = [], [], call
        t.ids = call.prompt_token_ids + call.output_token_ids
        self.last_reply = text = self._without_stop(call, self._asked_stops(body))
        logprobs = completion_logprobs(self.tokens_of(call), call) if body.get("logprobs") is not None else None
        return self._response("text_completion", call, {"index": 0, "text": text,
                                                        "finish_reason": call.finish_reason or "stop", "logprobs": logprobs})  # fmt: skip

    # -- the tape ----------------------------------------------------------------

    def _record(self, call: LLMCall, new: list[dict[str, Any]], calls: list[dict[str, Any]], extends: bool,
                thread: Thread) -> None:  # fmt: skip
        self.calls += 1
        turn = self.calls
        call.turn = turn
        self.last_turns[call.role] = turn
        if thread.ids is not None:  # the first call of its role's conversation extends nothing
            call.extends_previous = extends
            self.mismatches += not extends
        tape = self.tape
        for message in new:
            answered = message.get("tool_call_id") in self._names  # the result of a call this episode's model made
            if message["role"] == "tool" and answered:
                step = ToolResultObservation(text=message["content"], turn=turn - 1, tool=self._names[message["tool_call_id"]],
                                             info={"tool_call_id": message["tool_call_id"]})  # fmt: skip
            else:  # the program's own messages, a few-shot example's replies and tool results among them
                step = ProgramMessage(role=message["role"], text=written(message), turn=turn - 1)
            step.metadata.agent, step.metadata.node = tape.metadata.author or "", "program"
            tape.append(step)
        actions = [
            ToolCallAction(
                text=call.output_text, turn=turn, tool=c["function"]["name"], call=c["function"]["arguments"]
            )
            for c in calls
        ] or [AgentMessage(text=call.output_text, turn=turn)]
        for c in calls:
            self._names[c["id"]] = c["function"]["name"]
        for action in actions:
            action.metadata.agent, action.metadata.node = tape.metadata.author or "", "llm"
            tape.append(action, llm_call=call)

    def tokens_of(self, call: LLMCall) -> list[str]:
        return [self.tokens.tokenizer.decode([t], skip_special_tokens=False) for t in call.output_token_ids]

    def _response(self, kind: str, call: LLMCall, choice: dict[str, Any]) -> dict[str, Any]:
        prompt, output = len(call.prompt_token_ids), len(call.output_token_ids)
        return {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{call.id}",
            "object": kind,
            "created": int(time.time()),
            "model": call.role or self.model_name,
            "choices": [choice],
            "usage": {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output},
        }


def chat_logprobs(tokens: list[str], call: LLMCall) -> dict[str, Any]:
    """The sampled tokens' log-probs (those the learner's ratio starts from) in the chat API's shape, `tokens` their
    texts; no top alternatives (`top_logprobs` is refused)."""
    return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                        for tok, lp in zip(tokens, call.logprobs)]}  # fmt: skip


def completion_logprobs(tokens: list[str], call: LLMCall) -> dict[str, Any]:
    """The same in /v1/completions' shape, with each token's offset in the text."""
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {"tokens": tokens, "token_logprobs": list(call.logprobs), "top_logprobs": None, "text_offset": offsets}


def _common_prefix(history: list[dict[str, Any]], messages: list[dict[str, Any]]) -> int:
    """How many of `messages` start as `history` did."""
    n = 0
    for a, b in zip(history, messages):
        if not _same_message(a, b):
            break
        n += 1
    return n


def dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode()
