"""What `--eval.overlap` saves: the same run with evaluations overlapping training, and played in line.

    uv run python bench/bench_eval_overlap.py [--preset embedded] [--iterations 6] [--every 1] [--out FILE]
        [any orchestrate.rl option both runs take, e.g. --server.cpus 0 --trainer.cpus 1]

Runs `python -m orchestrate.rl` twice from the untrained model, one after the other with nothing else running:
`--eval.overlap on` (an evaluation plays while the trainer trains the next batch) and `off` (it plays before
the next rollouts), each for --iterations with an evaluation every --every. The clock is the wall time from
the end of iteration 0's evaluation to iteration N's record (servers' and trainer's start-up left out: both
runs pay them alike). Prints per run the seconds per iteration, the evaluations' own seconds and the held-out
successes, then the ratio overlapped / in line of the wall time (below 1: overlapping saves); with --out,
writes them as JSON. The learning is the same either way (the same seeds and weights; sampling differs run to
run), so the held-out figures are printed only to show that.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # provenance.py, also when this file is loaded by its path

from provenance import write_json  # noqa: E402


def run(preset: str, iterations: int, every: int, overlap: str, root: Path, extra: list[str]) -> dict:
    """One run; its clock and evaluations, from its metrics.jsonl."""
    run_dir = root / f"overlap-{overlap}"
    cmd = [sys.executable, "-m", "orchestrate.rl", "--preset", preset, "--run-dir", str(run_dir), "--iterations",
           str(iterations), "--eval.every", str(every), "--eval.overlap", overlap, *extra]  # fmt: skip
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = next(r["elapsed_s"] for r in rows if r["iteration"] == 0)
    end = max(r["elapsed_s"] for r in rows)
    trained = [r for r in rows if r["iteration"] >= 1]
    result = {
        "overlap": overlap,
        "seconds": round(end - start, 1),
        "seconds_per_iteration": round((end - start) / len(trained), 2),
        "eval_seconds": round(sum(r.get("time_eval", 0.0) for r in rows if r["iteration"] >= 1), 1),
        "train_seconds": round(sum(r.get("time_train", 0.0) for r in trained), 1),
        "held_out": {r["iteration"]: r["eval_success_rate"] for r in rows if "eval_success_rate" in r},
    }
    print(f"  {result['seconds']:.0f} s for {len(trained)} iterations ({result['seconds_per_iteration']:.1f} s each); "
          f"evaluations {result['eval_seconds']:.0f} s; waiting for the trainer {result['train_seconds']:.0f} s; "
          "held-out " + ", ".join(f"it {i} {100 * s:.0f}%" for i, s in result["held_out"].items()), flush=True)  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="embedded")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--every", type=int, default=1, help="--eval.every of both runs")
    parser.add_argument("--out", default=None, help="write the figures here (JSON)")
    args, extra = parser.parse_known_args()
    if args.iterations < 1 or args.every < 1:
        parser.error("--iterations and --every: 1 or more")
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, preset {args.preset}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-eval-overlap-"))
    try:
        runs = [run(args.preset, args.iterations, args.every, overlap, root, extra) for overlap in ("on", "off")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratio = runs[0]["seconds"] / runs[1]["seconds"]
    saved = runs[1]["seconds"] - runs[0]["seconds"]
    print(f"\noverlapped / in line, wall time over {args.iterations} iterations: {ratio:.2f} ({saved:.0f} s saved; "
          f"the evaluations took {runs[1]['eval_seconds']:.0f} s in line)")  # fmt: skip
    if args.out:
        figures = {"date": time.strftime("%Y-%m-%d"), "preset": args.preset, "iterations": args.iterations,
                   "every": args.every, "options": extra, "runs": runs, "ratio": round(ratio, 3)}  # fmt: skip
        write_json(args.out, figures)


if __name__ == "__main__":
    main()
