"""The gateway: an OpenAI-compatible API with a base URL per episode, in front of the policy servers.

    http://127.0.0.1:PORT/episodes/EPISODE/v1/chat/completions   OpenAI's chat completions (tools, stream)
                                             /v1/responses          OpenAI's Responses API (responses_api.py)
                                             /v1/messages           Anthropic's Messages API (messages_api.py)
                                             /v1/messages/count_tokens
                                             /v1/completions
                                             /v1/models

Every protocol's request becomes a chat request (its messages, tools, tool choice, limits), rendered and
recorded by the one path in session.py; its reply is written back in the protocol's shape, streamed as
server-sent events where asked (chat_api.py: sampled whole, then streamed). Errors come in the protocol's shape.

Every request needs the run's key (`Authorization: Bearer KEY`, or `x-api-key: KEY`); an episode that is not open here (another
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
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from functools import cached_property
from typing import Any

from orchestrate.gateway.chat_api import ChatCall
from orchestrate.gateway.messages_api import MessagesCall
from orchestrate.gateway.responses_api import ResponsesCall
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
        # the same app on a unix socket, for harnesses in a network namespace of their own (agents.harness): a
        # forwarder inside reaches it by path, and the namespace reaches nothing else
        self._folder = tempfile.mkdtemp(prefix="tapeloop-gateway-")
        self.unix_path = os.path.join(self._folder, "gateway.sock")
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._unix.bind(self.unix_path)
        self._unix.listen(2048)
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def base_url(self, episode_id: str) -> str:
        return f"{self.url}{PREFIX}/{episode_id}/v1"

    def control_url(self, episode_id: str) -> str:
        """Where a program in a process of its own reaches its episode's environment, sandbox and rewards."""
        return f"{self.url}{PREFIX}/{episode_id}/control"

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
            loop.run_until_complete(self._server.serve(sockets=[self._sock, self._unix]))

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
        self._unix.close()
        shutil.rmtree(self._folder, ignore_errors=True)

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
        """The run's key, as OpenAI's clients send it (`Authorization: Bearer KEY`) or Anthropic's (`x-api-key`,
        or the same bearer header)."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()
        return bool(token) and secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)

    @cached_property
    def asgi(self):
        """The gateway's ASGI app: what uvicorn serves on the port, and what an in-process program's client
        calls directly (`httpx.ASGITransport`: no socket; the same routes, checks and key)."""
        return self._app()

    def _app(self):
        from starlette.applications import Starlette
        from starlette.responses import StreamingResponse
        from starlette.routing import Route

        async def on_episode_loop(session: EpisodeSession, work):
            """Run an episode's work on the loop that plays it (where its LLM client lives)."""
            if asyncio.get_running_loop() is session.loop:  # a client on the episode's own loop
                return await work
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, session.loop))

        def failure(session: EpisodeSession, exc: Exception) -> GatewayError:
            """The error a request's failure is answered with; a fault of the program's kept as its episode's."""
            if isinstance(exc, GatewayError):
                return session.fault(exc) if exc.status < 500 else exc
            # a bug of ours: the program reads it, the tape keeps it
            return session.fault(GatewayError(500, f"{type(exc).__name__}: {exc}", "server_error"))

        async def handle(request):
            endpoint = request.path_params["endpoint"]
            api = API_OF.get(endpoint, ChatCall)  # the protocol whose shape errors take
            if not self._authorized(request):
                return _json(401, api.error(GatewayError(401, "this gateway needs the run's key: Authorization: "
                                                              "Bearer KEY (or x-api-key: KEY)", "authentication_error")))  # fmt: skip
            episode = request.path_params["episode"]
            session = self.sessions.get(episode)
            if session is None or session.closed:
                if episode in self._closed:
                    return _json(409, api.error(GatewayError(409, f"episode {episode} has ended: its tape is written",
                                                             "episode_ended")))  # fmt: skip
                return _json(404, api.error(GatewayError(404, f"no episode {episode} on this gateway (another run's?)",
                                                         "not_found_error")))  # fmt: skip
            if endpoint == "models" and request.method == "GET":
                return _json(200, {"object": "list", "data": [
                    {"id": name, "object": "model", "created": 0, "owned_by": "tapeloop"} for name in session.served]})  # fmt: skip
            if request.method != "POST" or endpoint not in POSTED:
                return _json(404, api.error(GatewayError(404, f"{request.method} /v1/{endpoint} is not served here",
                                                         "not_found_error")))  # fmt: skip
            try:
                body = await request.json()
            except Exception:  # noqa: BLE001 - any unreadable body
                return _json(400, api.error(session.fault(GatewayError(400, "the request body is not JSON"))))
            if not isinstance(body, dict):
                return _json(400, api.error(session.fault(GatewayError(400, "the request body must be a JSON object"))))
            try:
                if endpoint == "completions":
                    return _json(200, await on_episode_loop(session, session.complete(body)))
                if endpoint == "messages/count_tokens":
                    call = MessagesCall(body, session, counting=True)
                    counted = await on_episode_loop(session, session.count_tokens(call.chat_body()))
                    return _json(200, {"input_tokens": counted})
                call = api(body, session)
                chat_body = call.chat_body()
                if not call.streamed:
                    return _json(200, call.reply(await on_episode_loop(session, session.chat(chat_body, call.name))))
                prepared = await on_episode_loop(session, session.prepare_chat(chat_body, call.name + "+stream"))
            except Exception as exc:  # noqa: BLE001 - each failure answered in the protocol's shape
                error = failure(session, exc)
                return _json(error.status, api.error(error))

            async def events():
                for event in call.head(prepared):
                    yield event
                try:
                    answer = await on_episode_loop(session, session.answer(prepared))
                except Exception as exc:  # noqa: BLE001 - the stream has begun: the failure is its last event
                    for event in call.failed(failure(session, exc)):
                        yield event
                    return
                for event in call.tail(answer):
                    yield event

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-accel-buffering": "no"})  # fmt: skip

        async def control(request):
            """A program process's task (orchestrate.gateway.forkserver): step, python, reward, result."""
            session = self.sessions.get(request.path_params["episode"])
            operation = (session.control or {}).get(request.path_params["op"]) if session is not None else None
            if not self._authorized(request) or operation is None:
                return _json(404, GatewayError(404, "no such episode or operation here", "not_found_error").body())
            try:
                return _json(200, await on_episode_loop(session, operation(await request.json())))
            except Exception as exc:  # noqa: BLE001 - the program reads it as its task's failure
                return _json(500, GatewayError(500, f"{type(exc).__name__}: {exc}", "server_error").body())

        routes = [Route(PREFIX + "/{episode}/v1/{endpoint:path}", handle, methods=["GET", "POST"]),
                  Route(PREFIX + "/{episode}/control/{op}", control, methods=["POST"])]  # fmt: skip
        return Starlette(routes=routes)


API_OF = {"chat/completions": ChatCall, "responses": ResponsesCall, "messages": MessagesCall,
          "messages/count_tokens": MessagesCall}  # fmt: skip
POSTED = {*API_OF, "completions"}
