"""LLMs an agent can call. Every call comes back as a whole `LLMCall`.

`VLLMClient` talks to one or more vLLM OpenAI-compatible servers: it sends
token ids (the agent renders them, see `agents.chat`), so the prompt ids on
the tape are exactly what the model saw, and it keeps the output token ids vLLM
sampled (never re-tokenized text) with their log-probs. Requests go to the
least-busy server under a bounded concurrency. The servers are a pool: one
that fails to connect, times out, or fails its health check while requests
are in flight is taken out, its requests are retried at once on the others,
and it is handed to `on_failure` (the orchestrator restarts a local server);
it rejoins when its health check passes again (after `on_rejoin`, which
loads the current weights into it). Only when no server is left, or none
comes back within `rejoin_timeout_s`, does a request fail. A server error
(5xx) is retried with backoff. New weights arrive through
`swap_weights` while episodes run (the asynchronous pipeline): new requests
wait, and those in flight either finish first, so that each call records
the one policy version that produced all of its tokens, or (in-flight swaps)
are paused between two engine steps and go on under the new weights, the call
recording the token where its version changed; LoRA adapters need neither:
calls in flight go on under the old adapter's name.

Calls answered from a tape instead (replay, fork): `orchestrate/serving/recorded.py`.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import httpx

from contract.weight_paths import ADAPTER, DRAIN, KEEP
from tapes.tape import LLMCall, SamplingParams, VersionChange


class Endpoint(Protocol):
    """What the client needs of a server (orchestrate.serving.vllm_server.VLLMServer has it)."""

    served_model_name: str

    @property
    def base_url(self) -> str: ...

    @property
    def headers(self) -> dict[str, str]: ...

    async def healthy(self) -> bool:
        """Does it answer its health check (the pool's monitor asks the servers that have calls)?"""
        ...


class LLMError(RuntimeError):
    pass


class RequestRejected(LLMError):
    """The server answered with a client error (4xx): retrying will not help."""


class NoServerLeft(LLMError):
    """Every server of the pool is out and none came back."""


class _TakenOut(Exception):
    """The request's server was taken out of the pool while the request was in flight."""


_TRANSIENT = (httpx.TransportError, httpx.RemoteProtocolError)  # connection errors and timeouts: the server is out


async def _healthy(endpoint: Endpoint) -> bool:
    try:
        return bool(await endpoint.healthy())
    except Exception:  # noqa: BLE001 - a health check that fails is a server that is not healthy
        return False


class _Flight:
    """A call being generated: the server and request id of its current attempt, and the versions that took
    over during it (mark_versions)."""

    __slots__ = ("endpoint", "request", "changes")

    def __init__(self):
        self.endpoint: Endpoint | None = None
        self.request: str | None = None
        self.changes: list[VersionChange] = []


class _Member:
    """One server of the pool: up (taking requests) or out (being revived), or gone (gave up on it)."""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint
        self.in_flight = 0
        self.requests = 0  # answered requests
        self.out = asyncio.Event()  # set while out: requests in flight on it stop waiting and go elsewhere
        self.gone: str | None = None  # why it was given up
        self.reviving: asyncio.Task | None = None
        self.missed_health = 0

    @property
    def up(self) -> bool:
        return not self.out.is_set()


def _url(endpoint: Endpoint) -> str:
    return str(endpoint.base_url)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


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
        on_rejoin: Callable[[Endpoint], Awaitable[None]] | None = None,
        out: Sequence[Endpoint] = (),
        health_interval_s: float = 10.0,
        rejoin_timeout_s: float = 120.0,
        adapter: Callable[[int], str | None] | None = None,
    ):
        if not endpoints:
            raise ValueError("VLLMClient needs at least one endpoint")
        self.endpoints = list(endpoints)
        self._members = [_Member(e) for e in self.endpoints]
        self.on_rejoin = on_rejoin  # e.g. load the current weights into a server that was out
        self.health_interval_s = health_interval_s
        self.rejoin_timeout_s = rejoin_timeout_s
        self._changed: asyncio.Event | None = None  # set when a server rejoins or is given up
        self._monitor: asyncio.Task | None = None
        self._start_out = [m for m in self._members if any(m.endpoint is e for e in out)]
        self.taken_out = 0  # times a server was taken out of the pool
        self.tokenizer = tokenizer
        self.model = model
        # a LoRA run: the name version v's adapter is served under (None: the base model's own name)
        self.adapter = adapter
        self.policy_version = policy_version
        self.max_retries = max_retries
        self.on_failure = on_failure
        self.extra_body = dict(extra_body or {})  # more vLLM sampling fields, e.g. {"ignore_eos": True}
        self._limit = asyncio.Semaphore(max_concurrency)
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
        self._by_version: dict[int, int] = {}  # calls in flight per version that serves them
        self._version_left = asyncio.Event()  # set when a call leaves (version_idle checks again)
        self.held_s = 0.0  # seconds calls were held back by weight swaps (drain + reload)
        self._flights: set[_Flight] = set()  # generating calls: their server and request id, versions

    async def aclose(self) -> None:
        tasks = [m.reviving for m in self._members if m.reviving] + ([self._monitor] if self._monitor else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._http.aclose()

    async def __aenter__(self) -> VLLMClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # -- weight swaps ------------------------------------------------------

    async def swap_weights(self, reload: Callable[[], Awaitable[Any]], version: int, mode: str = DRAIN) -> float:
        """New weights while calls run: `reload()` puts `version` on the servers, and calls started from then
        on are served by it. Returns the seconds calls were held back. `mode`:

        - "drain": new calls wait, the calls in flight finish, `reload()` runs, calls go on. One version per
          call, so a call's log-probs are exactly its version's; the cost is the longest call in flight.
        - "keep": new calls wait only while `reload()` runs; it pauses the servers between two engine steps
          with the calls in flight kept, swaps the weights, says with `mark_versions` how many tokens each
          call had sampled, and resumes them: a call may span two versions (LLMCall.version_changes).
        - "adapter" (a LoRA run: each version an adapter of its own name, the older one still loaded):
          nothing waits; calls go on under the old version while `reload()` loads the new one, then new
          calls name the new one; the old one may be unloaded once `version_idle` says so.
        """
        if mode not in (DRAIN, KEEP, ADAPTER):
            raise ValueError(f"swap mode {mode!r}: drain, keep or adapter")
        start = time.perf_counter()
        if mode == ADAPTER:
            async with self._weights_lock():
                await reload()
                self.policy_version = version
            return 0.0
        self._gate.clear()
        try:
            if mode == DRAIN:
                await self._idle.wait()
            async with self._weights_lock():  # a server rejoining meanwhile loads the weights after this
                await reload()
                self.policy_version = version
        finally:
            self._gate.set()
        held = time.perf_counter() - start
        self.held_s += held
        return held

    def mark_versions(self, endpoint: Endpoint, lengths: dict[str, int], version: int) -> int:
        """`endpoint` now serves `version` under the calls it had in flight (paused: "keep" above), which had
        sampled `lengths` tokens each (by vLLM's request id, which holds ours: orchestrate.serving.vllm_plugin.worker_ext). A
        call the engine had not started is not in `lengths`, nor is one it finished: recorded as they began
        (the older version, the cautious side for the learner's lag). Returns the calls marked."""
        marked = 0
        for flight in self._flights:
            if flight.endpoint is not endpoint or flight.request is None:
                continue
            mine = f"cmpl-{flight.request}-"
            n = next((n for request, n in lengths.items() if request.startswith(mine)), None)
            if n is not None:
                flight.changes.append(VersionChange(token=n, version=version))
                marked += 1
        return marked

    async def version_idle(self, version: int) -> None:
        """Return once no call served by `version` is in flight (new calls name a newer one)."""
        while self._by_version.get(version, 0) > 0:
            self._version_left.clear()
            await self._version_left.wait()

    @property
    def in_flight(self) -> int:
        """Calls sent and not yet answered."""
        return self._active

    async def _enter_call(self) -> int:
        """Wait for an open gate and count the call in flight; returns the version that serves it."""
        while not self._gate.is_set():
            await self._gate.wait()
        self._active += 1
        self._idle.clear()
        version = self.policy_version
        self._by_version[version] = self._by_version.get(version, 0) + 1
        return version

    def _leave_call(self, version: int) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()
        self._by_version[version] -= 1
        self._version_left.set()

    # -- the pool of servers -----------------------------------------------

    def _weights_lock(self) -> asyncio.Lock:
        if getattr(self, "_weights", None) is None:
            self._weights = asyncio.Lock()
        return self._weights

    def requests_per_server(self) -> list[int]:
        """Requests answered by each endpoint, in the order given."""
        return [m.requests for m in self._members]

    def up_endpoints(self) -> list[Endpoint]:
        return [m.endpoint for m in self._members if m.up]

    def _start_pool(self) -> None:
        """First request: the monitor starts, and servers given as `out` start out (they are revived)."""
        if self._changed is not None:
            return
        self._changed = asyncio.Event()
        for member in self._start_out:
            self._take_out(member, None)
        if len(self._members) > 1:
            self._monitor = asyncio.create_task(self._watch())  # with one server there is nowhere to go

    def take_out(self, endpoint: Endpoint, reason: Exception | None = None) -> None:
        """Take a server out of the pool (e.g. it missed a weight reload); it rejoins once revived."""
        self._start_pool()
        for member in self._members:
            if member.endpoint is endpoint:
                self._take_out(member, reason)

    def _take_out(self, member: _Member, reason: Exception | None) -> None:
        if member.gone or not member.up:
            return
        member.out.set()  # its requests in flight go elsewhere
        self.taken_out += 1
        member.reviving = asyncio.create_task(self._revive(member, reason))

    async def _revive(self, member: _Member, reason: Exception | None) -> None:
        """on_failure (restart it), then health checks until it answers; then on_rejoin and back in."""
        try:
            if self.on_failure is not None:
                await self.on_failure(member.endpoint, reason or LLMError("taken out of the pool"))
            deadline = time.monotonic() + self.rejoin_timeout_s
            while not await _healthy(member.endpoint):
                if time.monotonic() > deadline:
                    raise LLMError(f"no answer to its health check for {self.rejoin_timeout_s:.0f} s")
                await asyncio.sleep(min(2.0, self.health_interval_s))
            async with self._weights_lock():
                if self.on_rejoin is not None:
                    await self.on_rejoin(member.endpoint)
                member.missed_health = 0
                member.out = asyncio.Event()  # up again, with a fresh event for its next time out
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the server is given up; the others go on
            member.gone = f"{_url(member.endpoint)}: {_one_line(exc)}"
        finally:
            member.reviving = None
            self._changed.set()

    async def _watch(self) -> None:
        """While requests are in flight, a server whose health check fails twice running is taken out (a
        server that hangs rather than refusing connections)."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            busy = [m for m in self._members if m.up and m.in_flight]
            for member, ok in zip(busy, await asyncio.gather(*(_healthy(m.endpoint) for m in busy))):
                member.missed_health = 0 if ok else member.missed_health + 1
                if member.missed_health >= 2:
                    self._take_out(member, LLMError("failed its health check twice"))

    async def _pick(self) -> _Member:
        """The least-busy server that is up; waits while all are out and some may come back."""
        self._start_pool()
        while True:
            up = [m for m in self._members if m.up]
            if up:
                return min(up, key=lambda m: m.in_flight)
            if all(m.gone for m in self._members):
                reasons = "; ".join(m.gone for m in self._members)
                raise NoServerLeft(f"no {self._members[0].endpoint.served_model_name} server is left ({reasons})")
            self._changed.clear()
            await self._changed.wait()

    async def _send(self, member: _Member, payload: dict[str, Any], request: str | None = None) -> httpx.Response:
        """POST to one server; _TakenOut when the server is taken out before it answers."""
        endpoint = member.endpoint
        headers = {**endpoint.headers, "X-Request-Id": request} if request else endpoint.headers
        post = asyncio.ensure_future(self._http.post(
            endpoint.base_url + "/v1/completions",
            json={"model": endpoint.served_model_name, **payload},  # payload's model: an adapter
            headers=headers,
        ))  # fmt: skip
        out = asyncio.ensure_future(member.out.wait())
        try:
            await asyncio.wait({post, out}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            out.cancel()
            if not post.done():
                post.cancel()
        if not post.done() or post.cancelled():
            raise _TakenOut()
        return post.result()

    # -- requests --------------------------------------------------------

    async def _post(self, payload: dict[str, Any], flight: _Flight | None = None) -> dict[str, Any]:
        """POST /v1/completions to the least-busy server that is up; a server that cannot be reached is
        taken out and the request goes to another (or waits for one to come back). A `flight` follows
        where the call runs, under which request id (each attempt its own; a retry starts afresh)."""
        async with self._limit:
            last: Exception | None = None
            for attempt in range(self.max_retries + 1):
                member = await self._pick()
                member.in_flight += 1
                request = None
                if flight is not None:
                    request = uuid.uuid4().hex
                    flight.endpoint, flight.request, flight.changes = member.endpoint, request, []
                try:
                    response = await self._send(member, payload, request)
                    if 400 <= response.status_code < 500:
                        raise RequestRejected(f"HTTP {response.status_code}: {response.text[:500]}")
                    response.raise_for_status()
                    self.requests += 1
                    member.requests += 1
                    return response.json()
                except RequestRejected:
                    raise
                except (*_TRANSIENT, _TakenOut) as exc:  # the server is out: the request goes elsewhere
                    last = exc if not isinstance(exc, _TakenOut) else LLMError(f"{_url(member.endpoint)} taken out")
                    self.retries += 1
                    self._take_out(member, last)
                except httpx.HTTPStatusError as exc:  # the server answered with an error: back off, try again
                    last = exc
                    self.retries += 1
                    await asyncio.sleep(min(30.0, 0.5 * 2**attempt) * (0.5 + random.random()))
                finally:
                    member.in_flight -= 1
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
        adapter = self.adapter(version) if self.adapter is not None else None
        if adapter:
            payload["model"] = adapter  # instead of the server's base name
        start = time.perf_counter()
        flight = _Flight()
        self._flights.add(flight)
        try:
            body = await self._post(payload, flight)
        finally:
            self._flights.discard(flight)
            self._leave_call(version)
        choice = body["choices"][0]
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        values = logprobs.get("token_logprobs") or []
        if len(tokens) != len(values) or any(v is None for v in values):
            raise LLMError(f"vLLM returned {len(tokens)} tokens but {len(values)} log-probs")
        output_ids = [_token_id(t) for t in tokens]
        return LLMCall(
            model=f"{self.model} + adapter {adapter}" if adapter else self.model,
            policy_version=version,
            version_changes=[c for c in flight.changes if c.token < len(output_ids)],  # none after the last
            messages=list(messages or []),
            prompt_text=prompt_text,
            prompt_token_ids=prompt_ids,
            output_text=choice.get("text", ""),
            output_token_ids=output_ids,
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
