"""The API key on every route of our vLLM servers, and never on a command line.

vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere; with
`VLLM_SERVER_DEV_MODE=1` (which we need for weight reloads) /collective_rpc,
/update_weights, /sleep, /pause, /abort_requests, /reset_prefix_cache and the
rest answer anyone who can reach 127.0.0.1. And a key given as `--api-key`
is in /proc/PID/cmdline, which every user of the machine can read (`ps`).

So the server gets its key from the environment (`VLLM_API_KEY`, readable only
by its owner in /proc/PID/environ) and is started with
`--middleware orchestrate.serving.auth.RequireAPIKey`: an ASGI middleware,
outermost, that refuses every HTTP request and websocket without
`Authorization: Bearer KEY`, whatever its path (/health included: our own
health checks send the key).

A server that runs on another machine (`orchestrate.serve`) gets its key the
same way, from a file or the environment; the orchestrator reads the same key
(`--server.api_key_file`, else `$VLLM_API_KEY`). The middleware also answers
`GET /tapeloop/stat?path=P` (with the key): a fingerprint of the folder P as
the server's machine sees it, so the orchestrator can tell that the server
will find the run's checkpoints at the paths it sends for reloads.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from urllib.parse import parse_qs

from contract.cli import OptionError

KEY_ENV = "VLLM_API_KEY"
MIDDLEWARE = "orchestrate.serving.auth.RequireAPIKey"
STAT_PATH = "/tapeloop/stat"
LORA_ENV = "TAPELOOP_MAX_LORA_RANK"  # the server's --max-lora-rank (0: no LoRA), told by STAT_PATH


class APIKeyMissing(OptionError):
    """No API key could be read; the message (one line) names the option and where it was looked for."""


def read_api_key(key_file: str | None, option: str = "--server.api_key_file") -> str:
    """The key of a server given by URL: the first line of `key_file`, else $VLLM_API_KEY."""
    if key_file:
        try:
            key = Path(key_file).expanduser().read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise APIKeyMissing(f"{option}: cannot read {key_file} ({exc.strerror or exc})") from None
        if not key:
            raise APIKeyMissing(f"{option}: {key_file} is empty; write the servers' API key in it")
        return key
    key = os.environ.get(KEY_ENV, "").strip()
    if not key:
        raise APIKeyMissing(f"{option}: a server given by URL needs its API key: put it in a file and pass "
                        f"{option} FILE, or set ${KEY_ENV} (never on the command line)")  # fmt: skip
    return key


def folder_fingerprint(path: str) -> dict:
    """How a folder looks from this machine: whether it is one, and a digest of its entries (names, and the
    sizes and modification seconds of its files) and of its parent's names. The same digest on two machines
    means they see the same folder at the same path (a shared filesystem). (The parent's names only: other
    runs beside this one may be writing their files.)"""
    folder = Path(path)
    if not folder.is_dir():
        return {"path": path, "is_dir": False, "digest": None}
    digest = hashlib.sha256()
    for level in (folder, folder.parent):
        try:
            for entry in sorted(os.scandir(level), key=lambda e: e.name):
                about = "-"
                if level == folder and entry.is_file(follow_symlinks=False):
                    stat = entry.stat(follow_symlinks=False)
                    about = f"{stat.st_size}:{int(stat.st_mtime)}"
                digest.update(f"{level}/{entry.name}:{about}\n".encode())
        except OSError as exc:
            digest.update(f"{level}: {exc.strerror}\n".encode())
    return {"path": path, "is_dir": True, "digest": digest.hexdigest()}


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
        if scope["type"] == "http" and scope.get("path") == STAT_PATH and self._authorized(scope):
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            answer = {
                **folder_fingerprint(query.get("path", [""])[0]),
                "max_lora_rank": int(os.environ.get(LORA_ENV) or 0),
            }
            body = json.dumps(answer).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})  # fmt: skip
            await send({"type": "http.response.body", "body": body})
            return
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
