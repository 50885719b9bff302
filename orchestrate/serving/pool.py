"""The servers behind a client, as a pool: requests go to the least-busy server that is up, under a bounded
concurrency. A server that fails to connect, times out, or fails its health check twice while requests are in
flight is taken out, its requests retried at once on the others, and it is handed to `on_failure` (the
orchestrator restarts a server of its own); it rejoins when its health check passes again, after
`on_rejoin` (which loads the current weights into it). Only when no server is left, or none comes back
within `rejoin_timeout_s`, does a request fail. A server error (5xx) is retried with backoff; a client error
(4xx) is not. Used by orchestrate.serving.llm.VLLMClient, which builds the requests."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import httpx


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
    """A call failed: the servers are failing (the run stops; no tape is invented)."""


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


def _lock_factory() -> Callable[[], asyncio.Lock]:
    """A lock made on first use, on the event loop that uses it."""
    lock: list[asyncio.Lock] = []

    def get() -> asyncio.Lock:
        if not lock:
            lock.append(asyncio.Lock())
        return lock[0]

    return get


class ServerPool:
    """The servers a client calls, their health and their failover; `post` sends one request."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        *,
        max_concurrency: int = 64,
        timeout_s: float = 900,
        max_retries: int = 4,
        on_failure: Callable[[Endpoint, Exception], Awaitable[None]] | None = None,
        on_rejoin: Callable[[Endpoint], Awaitable[None]] | None = None,
        out: Sequence[Endpoint] = (),
        health_interval_s: float = 10.0,
        rejoin_timeout_s: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
        weights_lock: Callable[[], asyncio.Lock] | None = None,
    ):
        if not endpoints:
            raise ValueError("VLLMClient needs at least one endpoint")
        self.endpoints = list(endpoints)
        self._members = [_Member(e) for e in self.endpoints]
        self.on_failure = on_failure
        self.on_rejoin = on_rejoin  # e.g. load the current weights into a server that was out
        self.health_interval_s = health_interval_s
        self.rejoin_timeout_s = rejoin_timeout_s
        self.max_retries = max_retries
        # held while a server rejoins, so that a weight swap (orchestrate.serving.swaps) never overlaps it
        self.weights_lock = weights_lock or _lock_factory()
        self._changed: asyncio.Event | None = None  # set when a server rejoins or is given up
        self._monitor: asyncio.Task | None = None
        self._start_out = [m for m in self._members if any(m.endpoint is e for e in out)]
        self._limit = asyncio.Semaphore(max_concurrency)
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=30),
            limits=httpx.Limits(max_connections=max_concurrency + 8, max_keepalive_connections=max_concurrency + 8),
            transport=transport,  # tests pass a mock
        )
        self.requests = 0
        self.retries = 0
        self.taken_out = 0  # times a server was taken out of the pool

    async def aclose(self) -> None:
        tasks = [m.reviving for m in self._members if m.reviving] + ([self._monitor] if self._monitor else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.http.aclose()

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
            async with self.weights_lock():
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
        post = asyncio.ensure_future(self.http.post(
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

    async def post(self, payload: dict[str, Any], flight: Any = None) -> dict[str, Any]:
        """POST /v1/completions to the least-busy server that is up; a server that cannot be reached is
        taken out and the request goes to another (or waits for one to come back). A `flight`
        (orchestrate.serving.swaps.Flight) follows where the call runs, under which request id (each attempt
        its own; a retry starts afresh)."""
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
