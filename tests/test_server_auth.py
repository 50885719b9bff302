"""Our vLLM servers want their API key on every route, and the key is on no command line (issue 13, item 5)."""

import asyncio
import os

import httpx
import pytest

from orchestrate.serving.auth import RequireAPIKey, forbidden_server_arg
from orchestrate.serving.vllm_server import ServerConfig, VLLMServer


def _call(app, path, headers=()):
    """Drive an ASGI app with one HTTP request; (status, body)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": list(headers)}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


async def _inner(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_middleware_requires_the_key_on_every_path(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    app = RequireAPIKey(_inner)
    for path in ("/collective_rpc", "/update_weights", "/sleep", "/pause", "/abort_requests",
                 "/reset_prefix_cache", "/health", "/v1/completions", "/"):  # fmt: skip
        assert _call(app, path)[0] == 401, path
        assert _call(app, path, [(b"authorization", b"Bearer wrong")])[0] == 401, path
        assert _call(app, path, [(b"authorization", b"Bearer s3cret")]) == (200, b"ok"), path


def test_middleware_without_a_key_refuses_everything(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    app = RequireAPIKey(_inner)
    assert _call(app, "/collective_rpc", [(b"authorization", b"Bearer ")])[0] == 401


def test_key_is_not_on_the_command_line(tmp_path):
    server = VLLMServer(tmp_path, log_path=tmp_path / "log")
    command = server.command()
    assert server.api_key not in " ".join(command)
    assert "--api-key" not in command
    assert "orchestrate.serving.auth.RequireAPIKey" in command
    assert server.environment()["VLLM_API_KEY"] == server.api_key


@pytest.mark.parametrize(
    "args",
    [
        ["--host", "0.0.0.0"],
        ["--host=0.0.0.0"],
        ["--port", "80"],
        ["--api-key", "k"],
        ["--api_key=k"],
        ["--hos", "0.0.0.0"],
        ["--uds", "/tmp/s"],
        ["--middleware", "x.y"],
        ["--max-num-seqs", "8", "--port=9"],
    ],
)
def test_extra_args_cannot_set_host_port_or_key(args):
    from pydantic import ValidationError

    assert forbidden_server_arg(args)
    with pytest.raises(ValidationError, match="host, port, API key"):
        ServerConfig(extra_args=args)


def test_harmless_extra_args_pass():
    assert ServerConfig(extra_args=["--max-num-seqs", "8", "--hf-overrides", "{}"]).extra_args[0] == "--max-num-seqs"


def test_rl_refuses_extra_args_with_a_port():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "orchestrate.rl", "--server.extra_args", '["--port", "9"]',
                          "--print-config"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and "--server.extra_args" in out.stderr.splitlines()[-1], out.stderr


@pytest.mark.vllm
def test_real_server_refuses_control_routes_without_the_key(tiny_policy_server, tmp_path):
    from finetune.tiny_model import make_tiny_model

    other = make_tiny_model(tmp_path / "other", hidden_size=256, num_layers=2, seed=1)
    server = tiny_policy_server
    # the key is in no process's command line (ps shows those to every user)
    pids = [server.process.pid] + [int(p) for p in os.listdir("/proc") if p.isdigit()]
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert server.api_key.encode() not in f.read(), pid
        except OSError:
            continue
    base = server.base_url
    for path, body in [("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(other)}}),
                       ("/reset_prefix_cache", None), ("/sleep", None), ("/pause", None),
                       ("/abort_requests", {}), ("/update_weights", {}), ("/v1/completions", {})]:  # fmt: skip
        r = httpx.post(base + path, json=body, timeout=30)
        assert r.status_code in (401, 403), (path, r.status_code, r.text[:200])
        r = httpx.post(base + path, json=body, headers={"Authorization": "Bearer not-the-key"}, timeout=30)
        assert r.status_code in (401, 403), (path, r.status_code)
    assert httpx.get(base + "/health", timeout=10).status_code in (401, 403)
    # with the key: a reload still works and changes the weights (reload_weights checks log-probs changed)
    seconds = server.reload_weights(other)
    assert seconds > 0
