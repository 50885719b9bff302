"""A distillation student against every recorded RL run of its preset, not only the one that made its teacher.

    uv run --no-sync python bench/distill_vs_rl_runs.py bench/results/bench_distill/distill_game.json \\
        --rl bench/results/bench_distill/distill_game.json bench/results/bench_distill/distill_game-topk.json bench/results/bench_distill/distill_game-topk30.json bench/results/bench_trees/trees_game.json:chain

The student's held-out curve is the `distill` curve of a bench_distill.py JSON (its teacher: that run's
checkpoint); each RL curve is the `grpo` curve of a bench_distill.py JSON, or `FILE:ARM` for an arm of a
bench_trees.py JSON (`runs.ARM.curve`). GRPO on a multi-turn preset differs from run to run (the game: 25% to 60%
within 30 minutes, results.md), so a student of the preset's best checkpoint is compared with each run and with
their mean: each pair as step functions to the shorter curve's end (bench_distill.compare_curves: the minutes the
student is ahead, level, behind, and each curve's mean success), and each curve's success at its last
evaluation within --minutes. Reads JSONs only: the runs' folders are not needed. Prints the table, writes
OUT.json and OUT.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_distill import at, compare_curves  # noqa: E402
from provenance import results_dir, write_json  # noqa: E402

Curve = list[tuple[float, float, int]]  # (minutes from the command's start, held-out success, iteration)


def read_curve(spec: str, key: str) -> Curve:
    """`FILE` (bench_distill.py's JSON: its `key` curve) or `FILE:ARM` (bench_trees.py's JSON: that arm's curve)."""
    path, _, arm = spec.partition(":")
    data = json.loads(Path(path).read_text())
    if arm:
        runs = data.get("runs", {})
        if arm not in runs:
            raise ValueError(f"{path}: no arm {arm!r} (it has {', '.join(runs) or 'none'})")
        return [(p["minutes"], p["success"], p["iteration"]) for p in runs[arm]["curve"]]
    if key not in data:
        raise ValueError(f"{path}: no {key!r} curve (a bench_distill.py JSON has 'grpo' and 'distill')")
    return [tuple(p) for p in data[key]]


def default_label(spec: str) -> str:
    """`bench/results/bench_distill/distill_game.json` -> `distill_game`, `bench/results/bench_trees/trees_game.json:chain` -> `trees_game:chain`."""
    path, sep, arm = spec.partition(":")
    return Path(path).stem + sep + arm


def compare(student: Curve, runs: dict[str, Curve], minutes: float) -> dict:
    """The student against each run and against the runs' mean (each at its last evaluation within `minutes`)."""
    rows = {}
    for name, rl in runs.items():
        until = min(student[-1][0], rl[-1][0], minutes)
        rows[name] = {"last": at(rl, minutes), "curves": compare_curves(student, rl, until)}
    mine = at(student, minutes)
    finals = [r["last"][1] for r in rows.values() if r["last"] is not None]
    return {
        "minutes": minutes,
        "student_last": mine,
        "runs": rows,
        "rl_mean_last": sum(finals) / len(finals) if finals else None,
        "student_ahead_of": sum(mine is not None and mine[1] > f + 1e-9 for f in finals),
        "student_level_with": sum(mine is not None and abs(mine[1] - f) <= 1e-9 for f in finals),
        "student_behind": sum(mine is not None and mine[1] < f - 1e-9 for f in finals),
    }


def plot(student: Curve, runs: dict[str, Curve], out: Path, minutes: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rl in runs.items():
        ax.step([m for m, _, _ in rl], [100 * s for _, s, _ in rl], where="post", alpha=0.6, label=f"RL: {name}")
    ax.step([m for m, _, _ in student], [100 * s for _, s, _ in student], where="post", color="black", lw=2.5,
            label="student of the best checkpoint")  # fmt: skip
    ax.set_xlim(0, minutes + 1)
    ax.set_xlabel("minutes from the command's start")
    ax.set_ylabel("held-out success (%)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("student", help="bench_distill.py JSON whose `distill` curve is the student")
    parser.add_argument("--rl", nargs="+", required=True, help="RL curves: bench_distill.py JSONs, or FILE:ARM")
    parser.add_argument("--labels", help="comma-separated, one per --rl curve (default: the files' names)")
    parser.add_argument("--minutes", type=float, default=30.0, help="compare up to this many minutes")
    parser.add_argument(
        "--out",
        help="OUT.json and OUT.png are written (default: bench/results/distill_vs_rl_runs/"
        "STUDENT_vs_rl_runs, STUDENT the student JSON's name)",
    )
    args = parser.parse_args()
    if not args.minutes > 0:
        parser.error(f"--minutes: {args.minutes} (give a positive number)")
    for spec in [args.student, *args.rl]:
        if not Path(spec.partition(":")[0]).is_file():
            parser.error(f"{spec}: no such file")
    labels = args.labels.split(",") if args.labels else [default_label(s) for s in args.rl]
    if len(labels) != len(args.rl) or len(set(labels)) != len(labels):
        parser.error(f"--labels: {len(labels)} labels for {len(args.rl)} curves (one each, all different)")
    try:
        student = read_curve(args.student, "distill")
        runs = {label: read_curve(s, "grpo") for label, s in zip(labels, args.rl)}
    except (ValueError, json.JSONDecodeError) as exc:
        parser.error(str(exc))
    result = compare(student, runs, args.minutes)
    mine = result["student_last"]
    print(f"student ({args.student}): {100 * mine[1]:.0f}% at {mine[0]:.1f} min (its last evaluation within "
          f"{args.minutes:g} min)")  # fmt: skip
    for name, row in result["runs"].items():
        last, c = row["last"], row["curves"]
        print(f"  RL {name}: {100 * last[1]:.0f}% at {last[0]:.1f} min; to {c['until']:.1f} min the student ahead "
              f"{c['minutes']['ahead']:.1f}, level {c['minutes']['level']:.1f}, behind {c['minutes']['behind']:.1f} "
              f"min, mean success {100 * c['mean_success']['student']:.1f}% against "
              f"{100 * c['mean_success']['rl']:.1f}%")  # fmt: skip
    print(f"  the RL runs' mean at their last evaluation within {args.minutes:g} min: "
          f"{100 * result['rl_mean_last']:.1f}%; the student ahead of {result['student_ahead_of']}, level with "
          f"{result['student_level_with']}, behind {result['student_behind']}")  # fmt: skip
    out = Path(args.out) if args.out else results_dir(__file__) / f"{Path(args.student).stem}_vs_rl_runs"
    write_json(out.with_suffix(".json"), {"student": args.student, "rl": args.rl, **result})
    plot(student, runs, out.with_suffix(".png"), args.minutes)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
