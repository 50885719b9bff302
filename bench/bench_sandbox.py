"""The sandbox's cost: start-to-result latency of a trivial program (bwrap vs plain subprocess), and tool
executions per second at the rollouts' concurrency.

    uv run python bench/bench_sandbox.py [--runs 40] [--concurrency 16]

Latency: `print(1)` run `--runs` times one after another under each isolation, alternating; the median and
the 90th percentile, and the ratio bwrap / subprocess. Throughput: `--runs` x 2 programs that each compute a
little (sum of squares to 10^5, as a tool call of the python_tool preset would) through the PythonTool from
`--concurrency` threads at once (as concurrent episodes call it), executions per second under each isolation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agents.sandbox import Sandbox, SandboxConfig  # noqa: E402
from agents.tools import PythonTool, ToolCall  # noqa: E402

WORK = "print(sum(i * i for i in range(100_000)))"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    if args.runs < 2 or args.concurrency < 1:
        parser.error("--runs must be >= 2 and --concurrency >= 1")
    modes = ("bwrap", "unsafe_subprocess")
    boxes = {m: Sandbox(SandboxConfig(isolation=m), slots=args.concurrency) for m in modes}

    latency: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(args.runs):
        for m in modes if i % 2 == 0 else modes[::-1]:
            start = time.perf_counter()
            result = boxes[m].run("print(1)")
            latency[m].append(time.perf_counter() - start)
            assert result.ok and result.stdout == "1\n", result
    print(f"latency of print(1), {args.runs} runs each (ms):")
    for m in modes:
        xs = sorted(latency[m])
        print(f"  {m:>17}: median {1000 * statistics.median(xs):6.1f}, p90 {1000 * xs[int(0.9 * len(xs)) - 1]:6.1f}")
    ratio = statistics.median(latency["bwrap"]) / statistics.median(latency["unsafe_subprocess"])
    print(f"  bwrap / subprocess: {ratio:.2f}x")

    print(f"tool executions per second, {2 * args.runs} calls from {args.concurrency} threads:")
    rates = {}
    for m in modes:
        tool = PythonTool(boxes[m])
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda _: tool.execute(ToolCall("python", WORK)), range(2 * args.runs)))
        seconds = time.perf_counter() - start
        assert all(not info["tool_error"] for _, info in results)
        rates[m] = 2 * args.runs / seconds
        print(f"  {m:>17}: {rates[m]:6.1f} per second ({seconds:.1f} s)")
    print(f"  bwrap / subprocess: {rates['bwrap'] / rates['unsafe_subprocess']:.2f}x the rate")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
