"""Servers elsewhere, with no vLLM (issue 23): the client's pool fails over between policy servers and lets
them back in; servers given by URL are checked before a run starts (answers, key, model, same files);
GPU placement options are checked against the visible GPUs."""

import asyncio
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from contract.cli import OptionError
from orchestrate.loop.config import RLConfig
from orchestrate.loop.config_checks import check_colocation, check_gpus, colocated, gpu_slices
from orchestrate.loop.metrics import server_metrics
from orchestrate.loop.preflight import PreflightError, check_remote_servers
from orchestrate.serve import build_server
from orchestrate.serving.auth import APIKeyMissing, RequireAPIKey, folder_fingerprint, read_api_key
from orchestrate.serving.llm import NoServerLeft, VLLMClient
from tapes.tape import SamplingParams


def answer():
    logprobs = {"tokens": ["token_id:5"], "token_logprobs": [-0.5]}
    return {"choices": [{"text": "x", "finish_reason": "stop", "logprobs": logprobs}]}


class Server:
    """A policy server stand-in with a health check the test turns on and off."""

    served_model_name = "policy"
    headers: dict = {}

    def __init__(self, name):
        self.base_url = f"http://{name}"
        self.up = True

    async def healthy(self):
        return self.up


class Cluster:
    """Scripted HTTP for stand-in servers: a server that is down refuses connections, a hung one never
    answers; every request is noted by server."""

    def __init__(self, *servers):
        self.servers = {s.base_url.removeprefix("http://"): s for s in servers}
        self.down, self.hung = set(), set()
        self.seen: list[str] = []
        self.arrived = asyncio.Event()

    async def handler(self, request: httpx.Request):
        host = request.url.host
        self.seen.append(host)
        self.arrived.set()
        if host in self.down:
            raise httpx.ConnectError("connection refused")
        if host in self.hung:
            await asyncio.Event().wait()  # never answers
        await asyncio.sleep(0.001)
        return httpx.Response(200, json=answer())


async def until(condition, seconds=20):
    """Wait for a condition the pool reaches by itself (its health checks run every 10 ms here)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the pool did not get there"
        await asyncio.sleep(0.01)


def calls(client, n):
    return asyncio.gather(*(client.complete_ids([1, 2], SamplingParams()) for _ in range(n)))


def test_a_dead_server_is_taken_out_and_its_requests_go_to_the_other():
    a, b = Server("a"), Server("b")
    cluster = Cluster(a, b)
    failures = []

    async def on_failure(endpoint, exc):
        failures.append(endpoint.base_url)

    async def go():
        cluster.down.add("a")
        a.up = False  # dead: it fails its health check too, so it stays out
        async with VLLMClient([a, b], transport=httpx.MockTransport(cluster.handler), on_failure=on_failure,
                              health_interval_s=0.01, rejoin_timeout_s=60) as client:  # fmt: skip
            results = await calls(client, 20)
            return results, client.requests_per_server(), client.retries, client.taken_out, client.up_endpoints()

    results, per_server, retries, taken_out, up = asyncio.run(go())
    assert len(results) == 20 and per_server == [0, 20]
    assert retries >= 1 and taken_out == 1 and failures == ["http://a"]
    assert up == [b]
    assert server_metrics(per_server, retries, taken_out) == {
        "server_0_requests": 0, "server_1_requests": 20, "server_retries": retries, "server_taken_out": 1,
    }  # fmt: skip


def test_a_hung_server_fails_its_health_check_and_its_requests_in_flight_are_retried_elsewhere():
    a, b = Server("a"), Server("b")
    cluster = Cluster(a, b)
    rejoined = []

    async def on_rejoin(endpoint):
        rejoined.append(endpoint.base_url)

    async def go():
        cluster.hung.add("a")
        async with VLLMClient([a, b], transport=httpx.MockTransport(cluster.handler), on_rejoin=on_rejoin,
                              health_interval_s=0.01, rejoin_timeout_s=60) as client:  # fmt: skip
            first = asyncio.ensure_future(calls(client, 6))
            while "a" not in cluster.seen:  # some requests are stuck on a
                await cluster.arrived.wait()
                cluster.arrived.clear()
            a.up = False  # a stops answering its health check too: taken out after two misses
            results = await first
            assert client.up_endpoints() == [b] and client.requests_per_server() == [0, 6]
            # a answers again: it rejoins (after on_rejoin) and takes requests again
            cluster.hung.discard("a")
            a.up = True
            await until(lambda: client.up_endpoints() == [a, b])
            more = await calls(client, 10)
            return results, more, client.requests_per_server(), client.retries

    results, more, per_server, retries = asyncio.run(go())
    assert len(results) == 6 and len(more) == 10
    assert retries >= 1 and rejoined == ["http://a"]
    assert per_server[0] > 0 and sum(per_server) == 16


def test_the_run_stops_with_one_line_only_when_no_server_is_left():
    a, b = Server("a"), Server("b")
    cluster = Cluster(a, b)

    async def go():
        cluster.down.update({"a", "b"})
        a.up = b.up = False
        async with VLLMClient([a, b], transport=httpx.MockTransport(cluster.handler), max_retries=10,
                              health_interval_s=0.01, rejoin_timeout_s=0.05) as client:  # fmt: skip
            return await calls(client, 3)

    with pytest.raises(NoServerLeft) as caught:
        asyncio.run(go())
    message = str(caught.value)
    assert "\n" not in message and "http://a" in message and "http://b" in message
    assert "no answer to its health check" in message


def test_a_server_that_missed_a_reload_starts_out_and_rejoins_with_the_weights():
    a, b = Server("a"), Server("b")
    cluster = Cluster(a, b)
    rejoined = []

    async def on_rejoin(endpoint):
        rejoined.append(endpoint.base_url)

    async def go():
        async with VLLMClient([a, b], transport=httpx.MockTransport(cluster.handler), on_rejoin=on_rejoin, out=[a],
                              health_interval_s=0.01) as client:  # fmt: skip
            await calls(client, 4)
            await until(lambda: client.up_endpoints() == [a, b])
            return client.taken_out

    assert asyncio.run(go()) == 1 and rejoined == ["http://a"]
    assert cluster.seen[0] == "b"  # nothing went to a before it had the weights


# -- servers given by URL: the checks before a run -------------------------------------


class FakeVLLM(BaseHTTPRequestHandler):
    """/health, /v1/models, /version and tapeloop's /tapeloop/stat behind a key, as a server from
    orchestrate.serve; /tokenize with a `tokenizer` (each id moved by `shift`: another tokenizer's)."""

    key, model, blind, lora_rank, version = "s3cret", "policy", False, 0, "0.32.0"
    tokenizer, shift = None, 0

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.headers.get("Authorization") != f"Bearer {self.key}":
            return self._send(401, {"error": "Unauthorized"})
        if self.path != "/tokenize" or self.tokenizer is None or body.get("model") != self.model:
            return self._send(404, {})
        ids = self.tokenizer.encode(body["prompt"], add_special_tokens=False)
        return self._send(200, {"tokens": [i + self.shift for i in ids]})

    def do_GET(self):
        if self.headers.get("Authorization") != f"Bearer {self.key}":
            return self._send(401, {"error": "Unauthorized"})
        url = urlsplit(self.path)
        if url.path == "/health":
            return self._send(200, {})
        if url.path == "/v1/models":
            return self._send(200, {"data": [{"id": self.model, "root": "/models/x"}]})
        if url.path == "/version":
            return self._send(200, {"version": self.version})
        if url.path == "/tapeloop/stat":
            path = parse_qs(url.query).get("path", [""])[0]
            seen = {"path": path, "is_dir": False, "digest": None} if self.blind else folder_fingerprint(path)
            return self._send(200, {**seen, "max_lora_rank": self.lora_rank})
        return self._send(404, {})

    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    servers = []

    def start(**behaviour):
        handler = type("Handler", (FakeVLLM,), behaviour)
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def remote_config(*urls, lora_rank: int = 0, **server):
    return RLConfig.model_validate({"server": {"policy_urls": list(urls), **server},
                                    "train": {"lora": {"rank": lora_rank}}})  # fmt: skip


def test_a_lora_run_needs_servers_by_url_that_serve_its_rank(fake_server, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    run = tmp_path / "runs" / "new"
    check_remote_servers(remote_config(fake_server(lora_rank=16), lora_rank=16), run)
    check_remote_servers(remote_config(fake_server(lora_rank=32), lora_rank=16), run)
    with pytest.raises(PreflightError, match=r"^--server.policy_urls: http://127.0.0.1:\d+ was started without LoRA, "
                       "below --train.lora.rank 16; start it with `uv run -m orchestrate.serve --train.lora.rank 16"):  # fmt: skip
        check_remote_servers(remote_config(fake_server(), lora_rank=16), run)
    with pytest.raises(PreflightError, match="was started with --max-lora-rank 8, below --train.lora.rank 16"):
        check_remote_servers(remote_config(fake_server(lora_rank=8), lora_rank=16), run)
    check_remote_servers(remote_config(fake_server(lora_rank=0)), run)  # full fine-tuning: a server without LoRA,
    check_remote_servers(remote_config(fake_server(lora_rank=16)), run)  # or with it on a vLLM that loads weights there
    for version in ("0.26.0", "0.27.0+cpu"):  # not before 0.28: its LoRA layers cannot load new base weights
        with pytest.raises(PreflightError, match=rf"^--server.policy_urls: http://127.0.0.1:\d+ was started with LoRA "
                           rf"on vLLM {re.escape(version)}, which cannot load new weights into a server with LoRA \(from "
                           r"0.28 on\); for a run that trains every weight start it without --train.lora.rank$"):  # fmt: skip
            check_remote_servers(remote_config(fake_server(lora_rank=16, version=version)), run)
    check_remote_servers(remote_config(fake_server(lora_rank=16, version="0.26.0"), lora_rank=16), run)  # LoRA: fine
    assert not run.parent.exists()  # nothing was written


def test_a_lent_lora_server_keeps_its_base_where_vllm_cannot_reload_it():
    """The reset of a policy server by URL (its base weights reloaded: a run before may have loaded others) is
    skipped for a server with LoRA on vLLM 0.26-0.27, where the reload fails half-way and leaves the model
    without weights (nothing of ours can have changed that base there); on 0.28 on, and without LoRA, it runs."""
    from orchestrate.loop.servers import Servers
    from orchestrate.serving.vllm_server import RemoteServer, reloads_under_lora

    assert not reloads_under_lora("0.26.0") and not reloads_under_lora("0.27.1+cpu")
    assert reloads_under_lora("0.28.0") and reloads_under_lora("0.32.0") and reloads_under_lora(None)

    class Lent(RemoteServer):
        def __init__(self, rank, version):
            super().__init__("http://lent", name="policy", api_key="k")
            self.rank, self.version, self.calls = rank, version, []

        def served_lora_rank(self):
            return self.rank

        def vllm_version(self):
            return self.version

        def model_root(self):
            return "/models/x"

        def _post(self, route, json=None, timeout=None):
            self.calls.append(route if route != "/collective_rpc" else json["method"])

    servers = [Lent(16, "0.26.0"), Lent(16, "0.28.0"), Lent(0, "0.26.0")]
    fleet = Servers.__new__(Servers)
    fleet.policy = servers
    fleet.reset_lent()
    reset = ["/resume", "reload_weights", "/reset_prefix_cache"]
    assert [s.calls for s in servers] == [["/resume"], reset, reset]


def test_servers_by_url_are_checked_before_the_run(fake_server, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    run = tmp_path / "runs" / "new"
    good = fake_server()
    check_remote_servers(remote_config(good), run)  # answers, key, model, same files: passes

    with pytest.raises(PreflightError, match=r"^--server.policy_urls: http://127.0.0.1:\d+ refused the API key"):
        check_remote_servers(remote_config(good, fake_server(key="other")), run)
    with pytest.raises(PreflightError, match="serves 'reference', not 'policy'"):
        check_remote_servers(remote_config(fake_server(model="reference")), run)
    blind = fake_server(blind=True)
    with pytest.raises(PreflightError, match=f"{blind} cannot read the run's checkpoints: it cannot see {tmp_path}"):
        check_remote_servers(remote_config(blind), run)
    with pytest.raises(PreflightError, match="^--server.policy_urls: http://127.0.0.1:1 does not answer"):
        check_remote_servers(remote_config("http://127.0.0.1:1"), run)

    key_file = tmp_path / "key"
    key_file.write_text("wrong\n")
    with pytest.raises(PreflightError, match="refused the API key"):
        check_remote_servers(remote_config(good, api_key_file=str(key_file)), run)
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(APIKeyMissing, match=r"^--server.api_key_file: .*\$VLLM_API_KEY"):
        check_remote_servers(remote_config(good), run)
    assert not run.parent.exists()  # nothing was written


def test_the_middleware_answers_what_it_sees_with_the_key_only(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    (tmp_path / "a.txt").write_text("1")
    sent = []

    async def inner(scope, receive, send):
        raise AssertionError("the stat route is answered by the middleware")

    async def send(message):
        sent.append(message)

    def get(key):
        sent.clear()
        scope = {"type": "http", "method": "GET", "path": "/tapeloop/stat", "headers": [(b"authorization", key)],
                 "query_string": f"path={tmp_path}".encode()}  # fmt: skip
        asyncio.run(RequireAPIKey(inner)(scope, None, send))
        return sent[0]["status"], json.loads(sent[1]["body"])

    status, body = get(b"Bearer s3cret")
    assert status == 200 and body == {**folder_fingerprint(str(tmp_path)), "max_lora_rank": 0} and body["is_dir"]
    monkeypatch.setenv("TAPELOOP_MAX_LORA_RANK", "16")  # a LoRA run's policy server says its rank
    assert get(b"Bearer s3cret")[1]["max_lora_rank"] == 16
    assert get(b"Bearer nope")[0] == 401
    before = body["digest"]
    (tmp_path / "b.txt").write_text("2")
    assert folder_fingerprint(str(tmp_path))["digest"] != before  # other files: another fingerprint


def test_api_key_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert read_api_key(None) == "from-env"
    (tmp_path / "key").write_text("from-file\n")
    assert read_api_key(str(tmp_path / "key")) == "from-file"
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(APIKeyMissing, match="--key-file: a server given by URL needs its API key"):
        read_api_key(None, "--key-file")  # a server on this machine too: every server of ours requires one


def test_the_serve_command_is_the_local_servers_line(tmp_path, folder_model):
    config = RLConfig.model_validate({"model": {"policy": str(folder_model)}, "server": {"max_model_len": 512}})
    server = build_server(config, "reference", "0.0.0.0", 8123, tmp_path)
    command = server.command()
    assert command[command.index("--host") + 1] == "0.0.0.0" and command[command.index("--port") + 1] == "8123"
    assert command[command.index("--served-model-name") + 1] == "reference"
    assert "orchestrate.serving.auth.RequireAPIKey" in command and "--api-key" not in command
    assert command[command.index("--max-model-len") + 1] == "512"
    assert server.environment()["VLLM_SERVER_DEV_MODE"] == "1"
    # on CPU the model runs in the engine core (docs/set-up.md), unless the user's environment says otherwise
    assert server.environment({})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert server.environment({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


@pytest.mark.parametrize("rank", [0, 8])
def test_the_servers_a_run_starts_itself(tmp_path, tiny_model_dir, rank):
    """The servers a run with a KL term starts (built, not started): a LoRA run's policy server takes adapters
    up to its rank and there is no reference server (the reference is the base model on the policy server);
    without LoRA, a plain policy server and a reference server. (tests/test_lora.py runs a LoRA run on a
    real server by URL; tiny_run starts its own pair.)"""
    from contract.rundir import RunDir
    from orchestrate.loop.servers import Servers
    from orchestrate.serving.vllm_server import VLLMServer

    model = tiny_model_dir
    config = RLConfig.model_validate(
        {"model": {"policy": str(model)}, "train": {"kl_coef": 0.01, "lora": {"rank": rank}}}
    )
    servers = Servers.for_run(config, RunDir(tmp_path / "run"), model, model, None, progress=False)
    [policy] = servers.policy
    command = policy.command()
    assert isinstance(policy, VLLMServer) and policy.log_path == tmp_path / "run" / "logs" / "policy-0.log"
    if rank:
        assert command[command.index("--enable-lora") + 1 :][:2] == ["--max-lora-rank", "8"]
        assert servers.reference is None and servers.all == [policy]
    else:
        assert "--enable-lora" not in command
        assert isinstance(servers.reference, VLLMServer) and servers.reference.served_model_name == "reference"


# -- GPUs -----------------------------------------------------------------------------------


def gpu_config(server=None, trainer=None):
    return RLConfig.model_validate({"server": server or {}, "trainer": trainer or {}})


@pytest.mark.parametrize(
    "server, trainer, count, named",
    [
        ({"gpus": "0"}, {}, 0, "--server.gpus: no GPU is visible"),
        ({"tensor_parallel_size": 2}, {}, 0, "--server.tensor_parallel_size: no GPU is visible"),
        ({}, {"gpus": "1"}, 0, "--trainer.gpus: no GPU is visible"),
        ({"gpus": "0-4"}, {}, 4, "--server.gpus: GPU(s) 4 are not visible"),
        ({"gpus": "0-1"}, {}, 4, "--server.gpus: 2 GPU(s) given"),
        (
            {"gpus": "0-1", "policy_servers": 2, "colocate": "off"},
            {"gpus": "1-2"},
            4,
            "--trainer.gpus: GPU(s) 1 are also in --server.gpus",
        ),
        # colocated (auto: common GPUs), the learner takes exactly the policy servers' GPUs
        ({"gpus": "0-1", "policy_servers": 2}, {"gpus": "1-2"}, 4, "--trainer.gpus: colocated"),
        ({"gpus": "0"}, {"gpus": "0-1", "num_processes": 2}, 4, "--trainer.gpus: colocated"),
        ({"colocate": "on"}, {}, 0, "--server.colocate: on time-shares GPUs and none is visible"),
        ({"colocate": "on", "policy_urls": "http://a:8000"}, {}, 1, "--server.colocate: on needs the policy"),
        ({"colocate": "on"}, {"launch": "external"}, 1, "--server.colocate: on needs the policy servers"),
        ({"reference_gpus": "3"}, {"gpus": "3"}, 4, "--trainer.gpus: GPU(s) 3 are also in --server.reference_gpus"),
        ({"gpus": "0", "reference_gpus": "0-1"}, {}, 4, "--server.reference_gpus: 2 GPU(s) given"),
        ({}, {"gpus": "2", "num_processes": 2}, 4, "--trainer.gpus: 1 GPU(s) for --trainer.num_processes 2"),
        ({"policy_servers": 3, "tensor_parallel_size": 2}, {}, 4, "--server.policy_servers: 3 server(s) x 2"),
        ({"gpus": "0", "policy_urls": "http://a:8000"}, {}, 4, "--server.gpus: the policy servers are given by URL"),
        # NCCL refuses two ranks of the weight-transfer group on one GPU: nothing placed means both on GPU 0
        ({"weight_transfer": "nccl"}, {}, 2, "--server.weight_transfer: nccl needs the learner and the policy"),
        ({"weight_transfer": "nccl", "gpus": "0"}, {}, 2, "--server.weight_transfer: nccl needs the learner and"),
        ({"weight_transfer": "nccl", "tensor_parallel_size": 2}, {"gpus": "1"}, 4, "--server.weight_transfer: nccl"),
    ],
)
def test_gpu_placement_is_refused_in_one_line_naming_the_option(server, trainer, count, named):
    config = gpu_config(server, trainer)
    with pytest.raises(OptionError) as caught:
        check_gpus(config, count=count)  # in check_config's order
        check_colocation(config, count=count)
    assert str(caught.value).startswith(named) and "\n" not in str(caught.value)


def test_colocation_is_chosen_when_the_servers_and_the_learner_share_gpus():
    """auto: our servers and a local learner on common GPUs (one GPU, nothing placed: both on GPU 0); never on
    CPU, by URL or with an external learner; on and off as said."""
    assert colocated(gpu_config(), count=1) and colocated(gpu_config({"gpus": "1"}, {"gpus": "1"}), count=2)
    assert not colocated(gpu_config({"gpus": "0"}, {"gpus": "1"}), count=2)
    assert not colocated(gpu_config(), count=0)  # CPU
    assert not colocated(gpu_config({"policy_urls": "http://a:8000"}), count=1)
    assert not colocated(gpu_config({}, {"launch": "external"}), count=1)
    assert colocated(gpu_config({"colocate": "on", "gpus": "0"}, {"gpus": "1"}), count=2)
    assert not colocated(gpu_config({"colocate": "off"}), count=1)
    # accepted: one GPU for everything (the reference server sleeps on it too), one server and learner per GPU
    for server, trainer in [({}, {}), ({"reference_gpus": "0"}, {}),
                            ({"gpus": "0-1", "policy_servers": 2}, {"gpus": "0-1", "num_processes": 2})]:  # fmt: skip
        config = gpu_config(server, trainer)
        check_gpus(config, count=2)
        check_colocation(config, count=2)
    with pytest.raises(OptionError, match=r"^--run.async_level: 1 generates while the learner trains"):
        check_colocation(RLConfig.model_validate({"run": {"async_level": 1}}), count=1)


def test_gpu_placement_that_fits(monkeypatch):
    check_gpus(gpu_config({"gpus": "0-3", "policy_servers": 2, "tensor_parallel_size": 2,
                           "reference_gpus": "0-1"}, {"gpus": "4-5", "num_processes": 2}), count=6)  # fmt: skip
    check_gpus(gpu_config({}, {}), count=0)  # nothing asked: nothing checked
    check_gpus(gpu_config({"weight_transfer": "nccl", "gpus": "0"}, {"gpus": "1"}), count=2)
    check_gpus(gpu_config({"weight_transfer": "nccl", "gpus": "1"}, {}), count=2)  # the trainer takes GPU 0
    check_gpus(
        gpu_config({"weight_transfer": "nccl", "policy_servers": 2}, {"gpus": "2-3", "num_processes": 2}), count=4
    )
    check_gpus(gpu_config({"weight_transfer": "nccl"}, {"launch": "external"}), count=1)  # the learner is elsewhere
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setattr("orchestrate.loop.config_checks.visible_gpus", lambda: ["4", "5", "6", "7"])
    assert gpu_slices("0-3", 2, 2) == [["4", "5"], ["6", "7"]]  # our index i is the child's visible_gpus()[i]
    assert gpu_slices(None, 2, 1) == [["4"], ["5"]]


# -- the loop: a server that misses a reload is stale until it rejoins with the weights --------------


class Reloadable(Server):
    """A policy server stand-in that loads checkpoints while it is alive."""

    def __init__(self, name):
        super().__init__(name)
        self.loaded = []

    def alive(self):
        return self.up

    def answers(self):
        return self.up

    async def recover(self, max_restarts):
        pass  # a server elsewhere: nothing to restart

    def reload_weights(self, path, verify=True):
        from orchestrate.serving.vllm_server import ServerError

        if not self.up:
            raise ServerError(f"{self.base_url} /collective_rpc: connection refused")
        self.loaded.append(path.name)


def test_the_loop_leaves_a_dead_server_stale_and_it_rejoins_with_the_served_checkpoint(tmp_path):
    from contract.rundir import RunDir
    from orchestrate.loop.servers import Servers
    from orchestrate.serving.vllm_server import ServerError

    class Trainer:
        def weights_changed(self, version):
            return True

    run = RunDir(tmp_path / "run")
    for version in (1, 2):  # the learner published checkpoints 1 and 2 as model folders
        run.checkpoint(version).mkdir(parents=True)
        (run.checkpoint(version) / "config.json").write_text("{}")
    a, b = Reloadable("a"), Reloadable("b")
    servers = Servers(RLConfig(), run, None, [a, b], progress=False)
    servers.use(Trainer())
    b.up = False
    servers.serve(1)
    assert servers.served == 1 and a.loaded == ["000001"] and servers.stale == {b}

    cluster = Cluster(a, b)

    async def go():
        b.up = True  # b answers again: the next client starts it out, and it rejoins after loading checkpoint 1
        client = servers.client("policy", policy_version=1)
        client.pool.http = httpx.AsyncClient(transport=httpx.MockTransport(cluster.handler))
        client.pool.health_interval_s = 0.01
        async with client:
            await calls(client, 3)
            await until(lambda: client.up_endpoints() == [a, b])
            servers.count(client)

    asyncio.run(go())
    assert b.loaded == ["000001"] and not servers.stale
    record = servers.take_metrics()
    assert record["server_taken_out"] == 1 and record["server_0_requests"] + record["server_1_requests"] == 3

    a.up = b.up = False
    with pytest.raises(ServerError, match="no policy server is left to serve version 2"):
        servers.serve(2)
