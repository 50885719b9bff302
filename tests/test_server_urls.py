"""vLLM servers started elsewhere, used by URL (issue 23): two policy servers started as a user starts them on
other nodes (separate processes, the documented `orchestrate.serve` command), the orchestrator using them by
URL; one of them killed while the second iteration's requests are in flight, and the run finishing on the
other. (Resuming a run on servers by URL: tests/test_lora.py and the PPO kill test of tests/test_loop.py.)"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from orchestrate.serving.vllm_server import free_port

pytestmark = pytest.mark.vllm

KEY = "test-key-9f3a"


def serve(run, model, port, key_file, cpus, log):
    """A policy server as docs/config.md starts one on another node."""
    command = [
        sys.executable, "-m", "orchestrate.serve", "--run-dir", str(run), "--role", "policy",
        "--host", "127.0.0.1", "--port", str(port), "--key-file", str(key_file),
        "--model.policy", str(model), "--server.max_model_len", "512", "--server.kv_cache_gib", "1",
        "--server.cpus", cpus,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}  # the key comes from the file
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(process, url, deadline_s=600):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server for {url} exited with code {process.returncode}"
        try:
            if httpx.get(url + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # polling a server that is starting, not synchronising with it
    raise AssertionError(f"{url} did not answer /health within {deadline_s} s")


def running(url) -> float:
    """Requests running or waiting on a server (its Prometheus gauges)."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).text
    values = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$", text, re.MULTILINE)
    return sum(float(v) for v in values)


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_policy_servers_by_url_and_failover_when_one_is_killed(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    logs = [open(tmp_path / f"server-{i}.log", "ab") for i in range(2)]
    servers = [serve(run, tiny_model_dir, port, key_file, str(i), logs[i]) for i, port in enumerate(ports)]
    rl = [
        sys.executable, "-m", "orchestrate.rl", "--run-dir", str(run),
        "--model.policy", str(tiny_model_dir), "--server.policy_urls", ",".join(urls),
        "--server.api_key_file", str(key_file),
        "--rollouts.tasks_per_iteration", "4", "--rollouts.attempts", "8", "--rollouts.max_tokens", "200",
        "--server.max_model_len", "512", "--eval.every", "0", "--train.kl_coef", "0", "--train.lr", "1e-3",
    ]  # fmt: skip
    try:
        for process, url in zip(servers, urls):
            wait_ready(process, url)
        assert not run.exists()  # the servers were started before the run (nothing written by them)

        # three iterations on the two servers by URL: requests go to both; server 1 is killed while
        # iteration 2's requests run on it, and the run finishes on server 0
        process = subprocess.Popen(
            [*rl, "--iterations", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 600
        metrics = run / "metrics.jsonl"
        while not metrics.exists() or metrics.read_text().count("\n") < 1 or running(urls[1]) == 0:
            assert process.poll() is None, process.communicate()  # events: iteration 1 recorded, then
            assert time.monotonic() < deadline, "no request of iteration 2 reached server 1"  # requests on 1
            time.sleep(0.02)
        os.killpg(servers[1].pid, signal.SIGKILL)
        stdout, stderr = process.communicate(timeout=900)
        assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
        first, second, third = records(run)
        assert [r["iteration"] for r in (first, second, third)] == [1, 2, 3]
        assert first["server_0_requests"] > 0 and first["server_1_requests"] > 0, first
        assert first["server_taken_out"] == 0
        assert second["server_taken_out"] >= 1 and second["server_retries"] >= 1, second
        assert second["tapes"] == 32 and second["infra_errors"] == 0
        assert third["server_1_requests"] == 0 and third["server_0_requests"] > 0, third
        assert "Traceback" not in stderr
    finally:
        for process in servers:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        for log in logs:
            log.close()
