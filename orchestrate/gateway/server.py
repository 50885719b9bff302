"""The gateway: an OpenAI-compatible API with a base URL per episode, in front of the policy servers.

    http://127.0.0.1:PORT/episodes/EPISODE/v1/chat/completions   (tools, tool_choice)
                                             /v1/completions
                                             /v1/models

Every request needs the run's key (`Authorization: Bearer KEY`); an episode that is not open here (another
run's, or one that ended) is refused. It listens on loopback unless told otherwise.

It runs in a thread of its own (uvicorn, its own event loop), for the life of the process; each episode's
work (rendering, the call to the servers, the tape) runs on the event loop that plays the episode, where its
LLM client lives: a request is handed over with `run_coroutine_threadsafe`. A program that runs in the
orchestrator's process (in a thread of its own: orchestrate.gateway.agent) calls the same app without the
socket (`Gateway.asgi` through `httpx.ASGITransport`, on its own loop): the same routes, checks and key, less
an HTTP round trip; its work is handed to the episode's loop the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import socket
import threading
import time
import uuid
from collections import OrderedDict
from functools import cached_property
from typing import Any

from orchestrate.gateway.session import EpisodeSession, GatewayError, dumps

PREFIX = "/episodes"
CLOSED_KEPT = 100_000  # ended episodes whose late calls get "ended" (409) rather than "no such episode" (404)


def _json(status: int, body: dict[str, Any]):
    """A JSON response; an error but 503 (the servers failed) tells an OpenAI client not to retry it (the
    `openai` client retries 409 and 5xx by default): asked again, the same request fails the same way."""
    from starlette.responses import Response

    headers = {"x-should-retry": "false"} if status >= 400 and status != 503 else None
    return Response(dumps(body), status_code=status, media_type="application/json", headers=headers)


class Gateway:
    """The HTTP server and the episodes open on it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, key: str | None = None):
        self.host, self.key = host, key or secrets.token_urlsafe(24)
        self._digest = hashlib.sha256(self.key.encode()).digest()
        self.sessions: dict[str, EpisodeSession] = {}
        # episodes that ended here, the latest CLOSED_KEPT (a late call is told its episode ended, not that it is
        # unknown): bounded, for a run of millions of episodes
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._sock = socket.create_server((host, port))
        self.port = self._sock.getsockname()[1]
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def base_url(self, episode_id: str) -> str:
        return f"{self.url}{PREFIX}/{episode_id}/v1"

    # -- life ----------------------------------------------------------------------

    def start(self) -> Gateway:
        import uvicorn

        if self._thread is not None:
            return self
        config = uvicorn.Config(self.asgi, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30, backlog=2048)  # fmt: skip
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # not the main thread: the loop's handlers stay
        ready = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_until_complete(self._server.serve(sockets=[self._sock]))

        self._thread = threading.Thread(target=serve, name="gateway", daemon=True)
        self._thread.start()
        ready.wait(10)
        deadline = time.monotonic() + 10
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"the gateway did not start on {self.url}")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self._sock.close()

    # -- episodes ------------------------------------------------------------------

    def open(self, **session: Any) -> EpisodeSession:
        episode_id = uuid.uuid4().hex
        opened = EpisodeSession(episode_id, **session)
        self.sessions[episode_id] = opened
        return opened

    def close(self, session: EpisodeSession) -> None:
        session.closed = True
        self._closed[session.id] = None
        while len(self._closed) > CLOSED_KEPT:
            self._closed.popitem(last=False)
        self.sessions.pop(session.id, None)

    # -- HTTP ----------------------------------------------------------------------

    def _authorized(self, request) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(
            hashlib.sha256(token.strip().encode()).digest(), self._digest
        )

    @cached_property
    def asgi(self):
        """The gateway's ASGI app: what uvicorn serves on the port, and what an in-process program's client
        calls directly (`httpx.ASGITransport`: no socket; the same routes, checks and key)."""
        return self._app()

    def _app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        async def handle(request):
            if not self._authorized(request):
                return _json(401, GatewayError(401, "this gateway needs the run's key: Authorization: Bearer KEY",
                                               "authentication_error").body())  # fmt: skip
            episode = request.path_params["episode"]
            session = self.sessions.get(episode)
            if session is None or session.closed:
                if episode in self._closed:
                    return _json(409, GatewayError(409, f"episode {episode} has ended: its tape is written",
                                                   "episode_ended").body())  # fmt: skip
                return _json(404, GatewayError(404, f"no episode {episode} on this gateway (another run's?)",
                                               "not_found_error").body())  # fmt: skip
            endpoint = request.path_params["endpoint"]
            if endpoint == "models" and request.method == "GET":
                return _json(200, {"object": "list", "data": [
                    {"id": session.model_name, "object": "model", "created": 0, "owned_by": "tapeloop"}]})  # fmt: skip
            if request.method != "POST" or endpoint not in ("chat/completions", "completions"):
                return _json(404, GatewayError(404, f"{request.method} /v1/{endpoint} is not served here",
                                               "not_found_error").body())  # fmt: skip
            try:
                body = await request.json()
            except Exception:  # noqa: BLE001 - any unreadable body
                return _json(400, session.fault(GatewayError(400, "the request body is not JSON")).body())
            if not isinstance(body, dict):
                return _json(400, session.fault(GatewayError(400, "the request body must be a JSON object")).body())
            try:
                work = session.chat(body) if endpoint == "chat/completions" else session.complete(body)
                if asyncio.get_running_loop() is session.loop:  # a client on the episode's own loop
                    answer = await work
                else:
                    answer = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, session.loop))
            except GatewayError as exc:
                if exc.status < 500:
                    session.fault(exc)
                return _json(exc.status, exc.body())
            except Exception as exc:  # noqa: BLE001 - a bug of ours: the program reads it, the tape keeps it
                error = session.fault(GatewayError(500, f"{type(exc).__name__}: {exc}", "server_error"))
                return _json(500, error.body())
            return _json(200, answer)

        routes = [Route(PREFIX + "/{episode}/v1/{endpoint:path}", handle, methods=["GET", "POST"])]
        return Starlette(routes=routes)
