"""Held-out success of several runs against wall-clock minutes, in one plot and one table.

    uv run python bench/compare_runs.py RUN_A RUN_B ... --labels "GRPO,PPO" --out bench/results/compare_runs/ppo_vs_grpo.png

Without --out the plot is bench/results/compare_runs/A_vs_B.png, A and B the runs' folder names; beside it,
STEM.provenance.json says when, from which commit, by which command and on which machine it was made.

Reads each run's metrics.jsonl (the numbers the loop logged: eval_success_rate at the iterations it
evaluated, elapsed_s from the command's start, the trainer's seconds per iteration). The trainer's
memory is bench/bench_ppo.py's to measure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import results_dir, write_sidecar  # noqa: E402

from orchestrate.loop.metrics import read_metrics  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories")
    parser.add_argument("--labels", help="comma-separated, one per run (default: the folder names)")
    parser.add_argument("--out", help="PNG to write (default: bench/results/compare_runs/A_vs_B.png)")
    parser.add_argument("--title", default="held-out success")
    parser.add_argument("--minutes", type=float, help="only up to this many minutes from the start")
    parser.add_argument(
        "--metrics", default="eval_success_rate",
        help="the held-out figure plotted, one for every run or comma-separated one per run (a run given twice: "
        "e.g. each role's, eval_success_rate_solver,eval_success_rate_judge)",
    )  # fmt: skip
    args = parser.parse_args()
    labels = args.labels.split(",") if args.labels else [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"--labels: {len(labels)} labels for {len(args.runs)} runs")
    metrics = args.metrics.split(",")
    metrics = metrics * len(args.runs) if len(metrics) == 1 else metrics
    if len(metrics) != len(args.runs):
        parser.error(f"--metrics: {len(metrics)} metrics for {len(args.runs)} runs (give one, or one per run)")
    for run in args.runs:
        if not (Path(run) / "metrics.jsonl").is_file():
            parser.error(f"{run}: no metrics.jsonl (not a run directory)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run, label, metric in zip(args.runs, labels, metrics):
        records = read_metrics(Path(run) / "metrics.jsonl")
        if not any(r.get(metric) is not None for r in records):
            parser.error(f"--metrics: {run} never logged {metric}")
        points = [
            (r["elapsed_s"] / 60, r[metric], r["iteration"])
            for r in records
            if r.get(metric) is not None
            and "elapsed_s" in r
            and (args.minutes is None or r["elapsed_s"] / 60 <= args.minutes)
        ]
        train = [r["train_seconds"] for r in records if isinstance(r.get("train_seconds"), (int, float))]
        total = [
            r["time_total"] for r in records if isinstance(r.get("time_total"), (int, float)) and not r.get("time_eval")
        ]
        ax.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o", label=label)
        print(f"{label}: " + ", ".join(f"it {i} {m:.1f} min {100 * s:.1f}%" for m, s, i in points))
        if train:
            print(
                f"{label}: trainer {statistics.median(train):.1f} s per iteration (median of {len(train)}), "
                f"iteration {statistics.median(total):.1f} s without evaluation"
                if total
                else ""
            )
    ax.set_xlabel("minutes from the command's start")
    ax.set_ylabel("held-out success (%)")
    ax.set_ylim(0, 100)  # the whole scale: a change of a few points looks its size
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = (
        Path(args.out) if args.out else results_dir(__file__) / ("_vs_".join(Path(r).name for r in args.runs) + ".png")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    write_sidecar(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
