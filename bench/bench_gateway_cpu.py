"""Each protocol's own work per call, without a server: the CPU a call costs the orchestrator's process.

    uv run python bench/bench_gateway_cpu.py [--episodes 64 --turns 4 --repeats 5] [--call-ms 142]
    uv run python bench/bench_gateway_cpu.py --turns 1 --reply-tokens 64 --call-ms 644

The model is replaced by a scripted one that answers every call at once with the same few tokens (a wrong
guess, `\\boxed{1}`, so each game runs its --turns; --reply-tokens N: N tokens, as many streamed pieces), so
what is timed is only what runs in this process: the
built-in agent's calls (`builtin`), and the programs of bench/gateway_mirror.py through the gateway in a thread
each (chat completions whole and streamed, the Responses API, the Messages API) with their client libraries.
Each repeat plays the same episodes on every side in a rotating order; prints each side's CPU milliseconds per
call (median over repeats; process CPU time, so other jobs on the machine disturb it little), the difference
to chat completions (a protocol's own work) and to the built-in agent (the gateway's with the client's), and,
with --call-ms (a real call's time, e.g. bench_gateway.py's seconds per repeat over its calls), what that
difference is as a share of a call. Writes bench/results/bench_gateway_cpu/TAG.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # provenance, when run as a script
import gateway_mirror as mirrors  # noqa: E402
from bench_gateway import program_for  # noqa: E402
from provenance import results_dir, write_json  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from agents.agent import ChatAgent  # noqa: E402
from agents.chat import ChatTokens  # noqa: E402
from orchestrate.loop.rollouts import RolloutContext, run_rollouts  # noqa: E402
from orchestrate.serving.models import resolve_model  # noqa: E402
from tapes.tape import LLMCall, SamplingParams  # noqa: E402

SIDES = ("builtin", "chat", "stream", "responses", "messages")


class ScriptedLLM:
    """Answers every call with the same text's tokens and the end of turn, at once."""

    def __init__(self, tokenizer, text: str = "\\boxed{1}"):
        self.text = text
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [
            tokenizer.convert_tokens_to_ids("<|im_end|>")
        ]
        self.calls = 0

    async def complete_ids(self, prompt_ids, sampling, *, messages=None, prompt_text=""):
        self.calls += 1
        return LLMCall(messages=list(messages or []), prompt_token_ids=list(prompt_ids), prompt_text=prompt_text,
                       output_text=self.text, output_token_ids=self.ids, logprobs=[-0.5] * len(self.ids),
                       finish_reason="stop", sampling=sampling)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4, help="1: math:arithmetic; N > 1: guess the number, N turns")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reply-tokens", type=int, default=0, help="the reply's length (0: \\boxed{1})")
    parser.add_argument("--call-ms", type=float, default=None, help="a real call's milliseconds, for the share")
    parser.add_argument("--tag", default=None, help="the result file's name (default: turnsN)")
    args = parser.parse_args()
    if min(args.episodes, args.turns, args.repeats) < 1 or args.reply_tokens < 0:
        parser.error("--episodes, --turns and --repeats must be at least 1, --reply-tokens 0 or more")
    if args.call_ms is not None and args.call_ms <= 0:
        parser.error("--call-ms: must be more than 0")

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    spec, mirrors.CONFIG = mirrors.setting(args.turns)
    sampling = SamplingParams(temperature=0.0, max_tokens=16)
    agents = {side: ChatAgent(mirrors.CONFIG, sampling, ChatTokens(tokenizer), max_context=4096) if side == "builtin"
              else program_for(side, sampling, tokenizer) for side in SIDES}  # fmt: skip

    def play(side: str) -> tuple[float, int]:
        llm = ScriptedLLM(tokenizer, " ".join(["1"] * args.reply_tokens) if args.reply_tokens else "\\boxed{1}")
        context = RolloutContext(agents[side], spec, llm, 0, 0)
        start = time.process_time()
        tapes = asyncio.run(run_rollouts(context, list(range(args.episodes)), 1, progress=False))
        errors = [t.metadata.error for t in tapes if t.metadata.error]
        if errors:
            raise SystemExit(f"{side}: {len(errors)} episodes failed, e.g. {errors[0]}")
        return (time.process_time() - start) * 1000 / llm.calls, llm.calls

    for side in SIDES:  # warm-up: imports, first-call allocations
        play(side)
    ms: dict[str, list[float]] = {side: [] for side in SIDES}
    calls = 0
    for repeat in range(args.repeats):
        for side in SIDES[repeat % len(SIDES) :] + SIDES[: repeat % len(SIDES)]:
            took, calls = play(side)
            ms[side].append(took)
        print(f"repeat {repeat}: " + ", ".join(f"{s} {ms[s][-1]:.2f}" for s in SIDES) + " ms of CPU a call", flush=True)
    for agent in agents.values():
        if hasattr(agent, "close"):
            agent.close()
    median = {side: statistics.median(v) for side, v in ms.items()}
    result = {"episodes": args.episodes, "turns": args.turns, "reply_tokens": args.reply_tokens, "calls": calls, "cpu_ms_per_call": ms, "median": median,
              "over_chat_ms": {}, "over_builtin_ms": {}, "call_ms": args.call_ms}  # fmt: skip
    print(f"{calls} calls a side a repeat; CPU milliseconds a call, median of {args.repeats}:")
    for side in SIDES:
        line = f"  {side:9s} {median[side]:6.2f}"
        if side != "builtin":
            result["over_builtin_ms"][side] = median[side] - median["builtin"]
            line += f"  +{median[side] - median['builtin']:.2f} over the built-in agent"
        if side not in ("builtin", "chat"):
            extra = median[side] - median["chat"]
            result["over_chat_ms"][side] = extra
            line += f", {extra:+.2f} over chat"
            if args.call_ms:
                line += f" ({100 * extra / args.call_ms:+.1f}% of a {args.call_ms:.0f} ms call)"
        print(line)
    path = write_json(results_dir(__file__) / f"{args.tag or f'turns{args.turns}'}.json", result)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
