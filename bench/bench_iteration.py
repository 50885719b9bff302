"""Where an RL iteration's time goes, on the embedded preset.

    uv run python bench/bench_iteration.py [--iterations 4] [--kl-coef 0] [any orchestrate.rl override ...]

Runs `python -m orchestrate.rl` (embedded preset: SmolLM2-135M, fp32, 64
completions of at most 128 new tokens, the policy server and the trainer on
this machine's CPU) for a few iterations with evaluation off, in a temporary
run directory, and reads the seconds per phase from its metrics.jsonl:
generate / reward / reference / train / weight sync / other. Server and
trainer start-up happen once per run and are not part of an iteration. The
first iteration is shown but not counted (warm-up). Prints each iteration,
the median per phase, and last the overhead share (weight sync + other) of
the iteration's wall time (target < 10%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ["generate", "reward", "reference", "train", "weight_sync", "other"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--kl-coef", type=float, default=0.0, help="> 0 adds the reference server and pass")
    args, extra = parser.parse_known_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {__import__('os').cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="bench-iteration-") as tmp:
        run = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "orchestrate.rl",
            "--run-dir",
            str(run),
            "--iterations",
            str(args.iterations),
            "--eval.every",
            "0",
            "--train.kl_coef",
            str(args.kl_coef),
            *extra,
        ]
        print("$", " ".join(cmd[1:]), flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("iteration", 0) >= 1 and "time_total" in r]
    for r in rows:
        parts = " ".join(f"{p} {r.get('time_' + p, 0.0):6.1f}" for p in PHASES)
        print(
            f"iteration {r['iteration']}: total {r['time_total']:6.1f} s | {parts} | "
            f"{r.get('completion_tokens_mean', 0):.0f} tokens/completion, train {r.get('train_tokens_per_s', 0):.0f} tok/s"
        )
    counted = rows[1:] if len(rows) > 1 else rows
    total = statistics.median(r["time_total"] for r in counted)
    print(f"\nwhole command: {wall:.0f} s for {len(rows)} iterations (start-up included)")
    print(f"median over iterations {counted[0]['iteration']}-{counted[-1]['iteration']}:")
    for p in PHASES:
        x = statistics.median(r.get("time_" + p, 0.0) for r in counted)
        print(f"  {p:12s} {x:7.1f} s  {100 * x / total:5.1f}%")
    print(f"  {'total':12s} {total:7.1f} s")
    shares = [(r.get("time_weight_sync", 0.0) + r.get("time_other", 0.0)) / r["time_total"] for r in counted]
    print(
        f"overhead share (weight sync + other): {100 * statistics.median(shares):.1f}% "
        f"(min {100 * min(shares):.1f}%, max {100 * max(shares):.1f}%; target < 10%)"
    )


if __name__ == "__main__":
    main()
