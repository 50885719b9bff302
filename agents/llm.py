"""LLMs an agent can call. Every call comes back as a whole `LLMCall`.

`VLLMClient` talks to one or more vLLM OpenAI-compatible servers: it sends
token ids (the agent renders them, see `agents.chat`), so the prompt ids on
the tape are exactly what the model saw, and it keeps the output token ids vLLM
sampled (never re-tokenized text) with their log-probs. Requests go to the
least-busy server under a bounded concurrency; a failed request is retried
with backoff, and a server that stops answering is handed to `on_failure`
(the orchestrator restarts it) before the retry. New weights arrive through
`swap_weights` while episodes run (the asynchronous pipeline): new requests
wait, those in flight finish, the servers reload, and every call records the
one policy version that produced all of its tokens.

`ReplayLLM` answers from the calls recorded on a tape: re-running an agent
with it gives the same tape back, which is how a change to an agent is
checked against old tapes.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import httpx

from tapes.tape import LLMCall, SamplingParams, Tape


class Endpoint(Protocol):
    """What the client needs of a server (orchestrate.vllm_server.VLLMServer has it)."""

    served_model_name: str

    @property
    def base_url(self) -> str: ...

    @property
    def headers(self) -> dict[str, str]: ...


class LLMError(RuntimeError):
    pass


class RequestRejected(LLMError):
    """The server answered with a client error (4xx): retrying will not help."""


_TRANSIENT = (httpx.TransportError, httpx.RemoteProtocolError)


def _token_id(token: str) -> int:
    # with return_tokens_as_token_ids, vLLM names each token "token_id:<id>"
    return int(token.rsplit(":", 1)[1])


class VLLMClient:
    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        tokenizer: Any = None,
        *,
        model: str = "",
        policy_version: int = 0,
        max_concurrency: int = 64,
        timeout_s: float = 900,
        max_retries: int = 4,
        on_failure: Callable[[Endpoint, Exception], Awaitable[None]] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        extra_body: dict[str, Any] | None = None,
    ):
        if not endpoints:
            raise ValueError("VLLMClient needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.tokenizer = tokenizer
        self.model = model
        self.policy_version = policy_version
        self.max_retries = max_retries
        self.on_failure = on_failure
        self.extra_body = dict(extra_body or {})  # more vLLM sampling fields, e.g. {"ignore_eos": True}
        self._limit = asyncio.Semaphore(max_concurrency)
        self._in_flight = [0] * len(self.endpoints)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=30),
            limits=httpx.Limits(max_connections=max_concurrency + 8, max_keepalive_connections=max_concurrency + 8),
            transport=transport,  # tests pass a mock
        )
        self.requests = 0
        self.retries = 0
        # The weight-swap gate: closed while servers reload; `_idle` is set when no call is in flight.
        self._gate = asyncio.Event()
        self._gate.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._active = 0
        self.held_s = 0.0  # seconds calls were held back by weight swaps (drain + reload)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> VLLMClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # -- weight swaps ------------------------------------------------------

    async def swap_weights(self, reload: Callable[[], Awaitable[Any]], version: int) -> float:
        """Drain, reload, go on: new calls wait, calls in flight finish, `reload()` runs, then calls go on
        served by `version`. Returns the seconds calls were held back.

        Draining (rather than reloading between engine steps) keeps one version per call, so a call's
        log-probs are exactly its version's; its cost is the longest call in flight at the swap.
        """
        start = time.perf_counter()
        self._gate.clear()
        try:
            await self._idle.wait()
            await reload()
            self.policy_version = version
        finally:
            self._gate.set()
        held = time.perf_counter() - start
        self.held_s += held
        return held

    async def _enter_call(self) -> int:
        """Wait for an open gate and count the call in flight; returns the version that serves it."""
        while not self._gate.is_set():
            await self._gate.wait()
        self._active += 1
        self._idle.clear()
        return self.policy_version

    def _leave_call(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    # -- requests --------------------------------------------------------

    async def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/completions to the least-busy server, retrying transient failures."""
        async with self._limit:
            last: Exception | None = None
            for attempt in range(self.max_retries + 1):
                index = min(range(len(self.endpoints)), key=self._in_flight.__getitem__)
                endpoint = self.endpoints[index]
                self._in_flight[index] += 1
                try:
                    response = await self._http.post(
                        endpoint.base_url + "/v1/completions",
                        json={"model": endpoint.served_model_name, **payload},
                        headers=endpoint.headers,
                    )
                    if 400 <= response.status_code < 500:
                        raise RequestRejected(f"HTTP {response.status_code}: {response.text[:500]}")
                    response.raise_for_status()
                    self.requests += 1
                    return response.json()
                except RequestRejected:
                    raise
                except (*_TRANSIENT, httpx.HTTPStatusError) as exc:
                    last = exc
                    self.retries += 1
                    if self.on_failure is not None:
                        await self.on_failure(endpoint, exc)  # e.g. restart a dead server
                    await asyncio.sleep(min(30.0, 0.5 * 2**attempt) * (0.5 + random.random()))
                finally:
                    self._in_flight[index] -= 1
            raise LLMError(f"request failed after {self.max_retries + 1} attempts: {last!r}")

    async def complete_ids(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt_text: str = "",
    ) -> LLMCall:
        payload: dict[str, Any] = {
            "prompt": prompt_ids,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": True,
        }
        if sampling.seed is not None:
            payload["seed"] = sampling.seed
        if sampling.stop:
            # the stop string stays in the output: a tool call ends with its closing tag, and the next
            # prompt continues from exactly the tokens sampled
            payload["stop"] = sampling.stop
            payload["include_stop_str_in_output"] = True
        payload.update(self.extra_body)
        version = await self._enter_call()
        start = time.perf_counter()
        try:
            body = await self._post(payload)
        finally:
            self._leave_call()
        choice = body["choices"][0]
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        values = logprobs.get("token_logprobs") or []
        if len(tokens) != len(values) or any(v is None for v in values):
            raise LLMError(f"vLLM returned {len(tokens)} tokens but {len(values)} log-probs")
        return LLMCall(
            model=self.model,
            policy_version=version,
            messages=list(messages or []),
            prompt_text=prompt_text,
            prompt_token_ids=prompt_ids,
            output_text=choice.get("text", ""),
            output_token_ids=[_token_id(t) for t in tokens],
            logprobs=[float(v) for v in values],
            finish_reason=choice.get("finish_reason"),
            sampling=sampling,
            latency_s=time.perf_counter() - start,
        )

    async def score(self, token_ids: list[int], n_prompt: int) -> list[float]:
        """Log-probs of token_ids[n_prompt:] given what precedes them (reference scoring).

        Uses echo + prompt_logprobs on the token-id prompt and checks that every
        returned entry is for the token that was sent: a missing or misaligned
        log-prob is an error, never a zero.
        """
        if not 0 < n_prompt <= len(token_ids):
            raise ValueError(f"n_prompt={n_prompt} for {len(token_ids)} tokens")
        body = await self._post(
            {"prompt": token_ids, "max_tokens": 0, "echo": True, "temperature": 1.0, "prompt_logprobs": 0}
        )
        entries = body["choices"][0].get("prompt_logprobs")
        if entries is None or len(entries) != len(token_ids):
            got = None if entries is None else len(entries)
            raise LLMError(f"reference scoring: expected {len(token_ids)} prompt log-probs, got {got}")
        out = []
        for position in range(n_prompt, len(token_ids)):
            entry = entries[position] or {}
            found = entry.get(str(token_ids[position]))
            if found is None:
                raise LLMError(f"reference scoring: no log-prob for token {token_ids[position]} at {position}")
            out.append(float(found["logprob"]))
        return out


class ReplayLLM:
    """Answers from the LLM calls recorded on a tape, in order.

    strict (the default): a prompt whose token ids differ from the recorded
    ones is an LLMError. strict=False answers anyway and notes the difference
    in `mismatches` (call number, what differs), so a replay can go on and
    report every step that changed; a different sampling setting is only
    noted. Either way, asking for more calls than the tape recorded is an
    LLMError.
    """

    def __init__(self, tape: Tape, strict: bool = True):
        self.calls = list(tape.llm_calls)
        self.position = 0
        self.strict = strict
        self.mismatches: list[tuple[int, str]] = []

    async def complete_ids(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt_text: str = "",
    ) -> LLMCall:
        if self.position >= len(self.calls):
            raise LLMError(f"replay: the agent made call #{self.position + 1}; the tape recorded {len(self.calls)}")
        call = self.calls[self.position]
        self.position += 1
        if call.prompt_token_ids != list(prompt_ids):
            problem = f"call #{self.position} prompt differs from the recorded one: "
            problem += _first_message_difference(call.messages, list(messages or []))
            problem += "; " + _first_id_difference(call.prompt_token_ids, list(prompt_ids))
            if self.strict:
                raise LLMError("replay: " + problem)
            self.mismatches.append((self.position, problem))
        if call.sampling != sampling:  # noted, never fatal: the recorded answer is what it is
            self.mismatches.append(
                (
                    self.position,
                    f"call #{self.position} sampling differs: recorded "
                    f"{call.sampling.model_dump()}, now {sampling.model_dump()}",
                )
            )
        replayed = call.model_copy(deep=True)
        replayed.turn, replayed.extends_previous = 1, None  # the agent sets these again
        return replayed


def _first_id_difference(recorded: list[int], now: list[int]) -> str:
    for i, (a, b) in enumerate(zip(recorded, now)):
        if a != b:
            return f"token {i} was {a}, now {b}"
    return f"recorded {len(recorded)} prompt tokens, now {len(now)}"


def _first_message_difference(recorded: list[dict[str, Any]], now: list[dict[str, Any]]) -> str:
    for i, (a, b) in enumerate(zip(recorded, now)):
        if a != b:
            return f"message {i + 1} was {_short(a)}, now {_short(b)}"
    if len(recorded) != len(now):
        return f"recorded {len(recorded)} messages, now {len(now)}"
    return "same messages"


def _short(message: dict[str, Any], width: int = 120) -> str:
    text = repr(message)
    return text if len(text) <= width else text[: width - 3] + "..."
