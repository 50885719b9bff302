"""The API key on every route of our vLLM servers, and never on a command line.

vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere; with
`VLLM_SERVER_DEV_MODE=1` (which we need for weight reloads) /collective_rpc,
/update_weights, /sleep, /pause, /abort_requests, /reset_prefix_cache and the
rest answer anyone who can reach 127.0.0.1. And a key given as `--api-key`
is in /proc/PID/cmdline, which every user of the machine can read (`ps`).

So the server gets its key from the environment (`VLLM_API_KEY`, readable only
by its owner in /proc/PID/environ) and is started with
`--middleware orchestrate.server_auth.RequireAPIKey`: an ASGI middleware,
outermost, that refuses every HTTP request and websocket without
`Authorization: Bearer KEY`, whatever its path (/health included: our own
health checks send the key).
"""

from __future__ import annotations

import hashlib
import os
import secrets

KEY_ENV = "VLLM_API_KEY"
MIDDLEWARE = "orchestrate.server_auth.RequireAPIKey"

# `vllm serve` options that would undo the above: another address or socket, a key on the
# command line, or middleware of one's own. vLLM's parser takes unambiguous abbreviations,
# so a prefix of these is refused too.
FORBIDDEN_SERVER_ARGS = ("--host", "--port", "--api-key", "--uds", "--middleware")


def forbidden_server_arg(args: list[str]) -> str | None:
    """The first argument of `args` that sets host, port, API key, socket or middleware, else None."""
    for arg in args:
        if not arg.startswith("--") or arg == "--":
            continue
        name = arg.split("=", 1)[0].replace("_", "-")
        if len(name) > 2 and any(option.startswith(name) for option in FORBIDDEN_SERVER_ARGS):
            return arg
    return None


class RequireAPIKey:
    """Pure ASGI middleware: every request must carry the key in `$VLLM_API_KEY`.

    Without a key in the environment every request is refused (fail closed).
    """

    def __init__(self, app) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        self._digest = hashlib.sha256(key.encode()).digest() if key else None

    def _authorized(self, scope) -> bool:
        if self._digest is None:
            return False
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return secrets.compare_digest(hashlib.sha256(token.strip().encode()).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"error": "Unauthorized: this server needs its API key on every request"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})
