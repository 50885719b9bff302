"""On-policy distillation against the RL run that made its teacher: held-out success against wall time.

    uv run --no-sync python bench/bench_distill.py                                  # 20 min GRPO, then 8 min distilling
    uv run --no-sync python bench/bench_distill.py --report-only --out-dir DIR      # the table of runs already made

1. GRPO: `orchestrate.rl --preset P` from the untrained model for --grpo-minutes: its newest checkpoint is the teacher.
2. Distillation: `orchestrate.rl --preset P --teacher.model GRPO_RUN --train.estimator zero` (the teacher's term
   alone) from the same untrained model, sampling at temperature 1 (where the term is the per-token reverse KL
   exactly), evaluated every 2 iterations, for --distill-minutes.
Both start from the command's start (servers, the first evaluation included). The teacher's success is the GRPO
run's last held-out figure; the target: the student reaches 90% of it within a third of the minutes GRPO took to
first reach it. Prints the table, writes OUT/distill_PRESET.json and OUT/distill_PRESET.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_trees import run  # noqa: E402

from orchestrate.loop.metrics import read_metrics  # noqa: E402


def held_out(run_dir: Path) -> list[tuple[float, float, int]]:
    """(minutes from the command's start, held-out success, iteration) of each evaluation."""
    return [(r["elapsed_s"] / 60, r["eval_success_rate"], r["iteration"]) for r in read_metrics(run_dir / "metrics.jsonl")
            if r.get("eval_success_rate") is not None and "elapsed_s" in r]  # fmt: skip


def first_reaching(points, level: float) -> float | None:
    """Minutes at which a run's held-out success first reached `level` (none: never)."""
    return next((m for m, s, _ in points if s >= level - 1e-9), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="embedded")
    parser.add_argument("--grpo-minutes", type=float, default=20.0)
    parser.add_argument("--distill-minutes", type=float, default=8.0)
    parser.add_argument("--out-dir", default="/tmp/bench_distill", help="where the runs go")
    parser.add_argument("--out", default="bench", help="where the JSON and the plot go")
    parser.add_argument("--report-only", action="store_true", help="read the runs in --out-dir, start none")
    args = parser.parse_args()
    root = Path(args.out_dir)
    root.mkdir(parents=True, exist_ok=True)
    grpo, student = root / f"{args.preset}-grpo", root / f"{args.preset}-distill"
    if not args.report_only:
        for d in (grpo, student):
            if d.exists():
                parser.error(f"{d} exists: remove it, or pass --report-only")
        run(args.preset, grpo, args.grpo_minutes, [])
        run(args.preset, student, args.distill_minutes, ["--teacher.model", str(grpo), "--train.estimator", "zero",
                                                         "--rollouts.temperature", "1.0", "--eval.every", "2"])  # fmt: skip
    teacher_curve, student_curve = held_out(grpo), held_out(student)
    teacher = teacher_curve[-1][1]
    grpo_reached = first_reaching(teacher_curve, teacher)
    student_reached = first_reaching(student_curve, 0.9 * teacher)
    ratio = student_reached / grpo_reached if student_reached is not None and grpo_reached else None
    results = {"preset": args.preset, "teacher_success": teacher, "grpo_minutes_to_teacher": grpo_reached,
               "student_minutes_to_90pct": student_reached, "time_ratio": ratio,
               "grpo": teacher_curve, "distill": student_curve}  # fmt: skip
    print(
        f"{args.preset}: teacher (GRPO's last held-out) {100 * teacher:.1f}%, first reached at {grpo_reached:.1f} min"
    )
    for label, points in (("GRPO", teacher_curve), ("distillation", student_curve)):
        print(f"  {label}: " + ", ".join(f"it {i} {m:.1f} min {100 * s:.1f}%" for m, s, i in points))
    if student_reached is None:
        print(f"  the student did not reach 90% of the teacher ({90 * teacher:.1f}%) within {args.distill_minutes} min")
    else:
        print(f"  the student reached {90 * teacher:.1f}% at {student_reached:.1f} min: {ratio:.2f} of GRPO's time")
    out = Path(args.out)
    (out / f"distill_{args.preset}.json").write_text(json.dumps(results, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, points in (("GRPO (makes the teacher)", teacher_curve), ("on-policy distillation", student_curve)):
        ax.plot([m for m, _, _ in points], [100 * s for _, s, _ in points], marker="o", label=label)
    ax.axhline(90 * teacher, color="grey", linestyle=":", label="90% of the teacher")
    ax.set_xlabel("minutes from the command's start")
    ax.set_ylabel("held-out success (%)")
    ax.set_title(f"{args.preset}: distillation from GRPO's checkpoint")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"distill_{args.preset}.png", dpi=90)
    print(f"wrote {out / f'distill_{args.preset}.json'} and {out / f'distill_{args.preset}.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
