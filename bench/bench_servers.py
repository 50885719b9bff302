"""Generation throughput with one vs two policy servers by URL, same work, one run.

    uv run python bench/bench_servers.py [--tasks 16 --attempts 4 --max-tokens 128 --repeats 3]

Starts two vLLM servers with the embedded model the way a user starts them on
other machines (`uv run -m orchestrate.serve --role policy --port P
--key-file F`, separate processes, their own sessions), server 0 pinned to
core 0 and server 1 to core 1 (`--server.cpus`), as separate accelerators
would be. Then, each repeat, in alternating order, the same episodes
(math:arithmetic, the agent through VLLMClient, tapes written, every
completion run to --max-tokens with `ignore_eos` so each side does exactly the
same work) are generated with the pool holding server 0 alone, and with the
pool holding both (the client's least-loaded choice spreads the requests, as
in a run with `--server.policy_urls URL0,URL1`). Prints output tokens/s of
each, the requests each server took, the median ratio two/one, and what bounds
it on this machine: each server has one core, so two servers have twice the
cores of one (x2 at most); this process (the agent, the environment, the
HTTP client, the tokenizer) runs on the same two cores and takes its share,
printed as its CPU seconds per wall second.

Measured (2026-11-25, the 2-core CI machine): one server 170.9 tokens/s, two
servers 307.1 tokens/s, x1.80 (docs/multi-node.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agents.agent import AgentConfig, ChatAgent, Example  # noqa: E402
from agents.chat import ChatTokens  # noqa: E402
from agents.env_spec import EnvSpec  # noqa: E402
from orchestrate.loop.rollouts import RolloutContext, run_rollouts  # noqa: E402
from orchestrate.serving.llm import VLLMClient  # noqa: E402
from orchestrate.serving.models import resolve_model  # noqa: E402
from orchestrate.serving.vllm_server import RemoteServer, free_port  # noqa: E402
from tapes.store import write_tapes  # noqa: E402
from tapes.tape import SamplingParams  # noqa: E402


def serve(tmp: Path, port: int, key_file: Path, cpus: str) -> subprocess.Popen:
    """A policy server as docs/multi-node.md starts one on another machine."""
    command = [
        sys.executable, "-m", "orchestrate.serve", "--run-dir", str(tmp / "run"), "--role", "policy",
        "--host", "127.0.0.1", "--port", str(port), "--key-file", str(key_file), "--server.cpus", cpus,
        "--server.kv_cache_gib", "2", "--server.max_model_len", "2048",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}  # the key comes from the file
    log = open(tmp / f"server-{port}.log", "ab")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)


def wait_ready(proc: subprocess.Popen, server: RemoteServer, tmp: Path, deadline_s: float = 900) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server for {server.url} exited with code {proc.returncode}: see {tmp}")
        try:
            if httpx.get(server.url + "/health", headers=server.headers, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{server.url} did not answer /health within {deadline_s:.0f} s: see {tmp}")


async def generate(servers, agent, spec, seeds, attempts, concurrency, out: Path) -> tuple[int, list[int]]:
    """(output tokens, requests per server) of the episodes, tapes written."""
    async with VLLMClient(servers, model="policy", max_concurrency=concurrency, extra_body={"ignore_eos": True}) as c:
        tapes = await run_rollouts(RolloutContext(agent, spec, c, 0, 0), seeds, attempts, progress=False)
        per_server = c.requests_per_server()
    write_tapes(out, tapes)
    return sum(len(call.output_token_ids) for t in tapes for call in t.llm_calls), per_server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--attempts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    for name in ("tasks", "attempts", "max_tokens", "repeats", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    if len(os.sched_getaffinity(0)) < 2:
        parser.error("needs two CPU cores (one per server)")

    model_dir = resolve_model("smollm2")
    chat = ChatTokens(AutoTokenizer.from_pretrained(model_dir))
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    spec = EnvSpec("math:arithmetic", {}, "train", 0)
    config = AgentConfig(max_turns=1, examples=[Example(question="What is 3 + 4?", solution="3 + 4 = 7. \\boxed{7}")])
    agent = ChatAgent(config, sampling, chat, max_context=2048)
    seeds = list(range(args.tasks))

    tmp = Path(tempfile.mkdtemp(prefix="bench-servers-"))
    key_file = tmp / "key"
    key_file.write_text(uuid.uuid4().hex + "\n")
    key_file.chmod(0o600)
    key = key_file.read_text().strip()
    cores = sorted(os.sched_getaffinity(0))[:2]
    ports = [free_port(), free_port()]
    servers = [RemoteServer(f"http://127.0.0.1:{p}", name="policy", api_key=key) for p in ports]
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"{args.tasks} tasks x {args.attempts} attempts, {args.max_tokens} new tokens each (ignore_eos), "
          f"T={args.temperature}; servers on cores {cores[0]} and {cores[1]}, logs in {tmp}", flush=True)  # fmt: skip
    procs = [serve(tmp, port, key_file, str(core)) for port, core in zip(ports, cores)]
    results: dict[str, list[float]] = {"one": [], "two": []}
    client_cpu: dict[str, list[float]] = {"one": [], "two": []}
    try:
        for proc, server in zip(procs, servers):
            wait_ready(proc, server, tmp)
        for k, server in enumerate(servers):  # warm-up: each server's first requests pay one-off costs
            asyncio.run(generate([server], agent, spec, seeds[:2], 2, args.concurrency, tmp / f"warmup-{k}.jsonl"))
        for repeat in range(args.repeats):
            for kind in ("one", "two") if repeat % 2 == 0 else ("two", "one"):
                pool = servers[:1] if kind == "one" else servers
                for server in pool:
                    server._post("/reset_prefix_cache")
                wall, cpu = time.perf_counter(), time.process_time()
                tokens, per_server = asyncio.run(
                    generate(pool, agent, spec, seeds, args.attempts, args.concurrency, tmp / f"{kind}-{repeat}.jsonl")
                )
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                results[kind].append(tokens / wall)
                client_cpu[kind].append(cpu / wall)
                print(f"repeat {repeat} {kind} server(s): {tokens} tokens in {wall:6.2f} s = {tokens / wall:7.1f} "
                      f"tokens/s; requests {per_server}; this process {cpu / wall:.2f} CPU s per s", flush=True)  # fmt: skip
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    for kind, values in results.items():
        spread = (max(values) - min(values)) / 2
        print(f"{kind} server(s): median {statistics.median(values):7.1f} tokens/s (+/- {spread:.1f}), this "
              f"process {statistics.median(client_cpu[kind]):.2f} CPU s per s")  # fmt: skip
    ratio = statistics.median(t / o for t, o in zip(results["two"], results["one"]))
    print(f"ratio two/one: x{ratio:.2f}. Bound here: each server has one core, so two have twice the cores of one "
          f"(x2.00 at most); the rest of the gap is what else runs on those two cores (each server's own HTTP "
          f"front-end process beside its engine, the system, and this process: "
          f"{statistics.median(client_cpu['two']):.2f} CPU s per s with two servers).")  # fmt: skip
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
