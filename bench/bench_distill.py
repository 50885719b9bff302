"""On-policy distillation against the RL run that made its teacher: held-out success against wall time.

    uv run --no-sync python bench/bench_distill.py                                  # 20 min GRPO, then 8 min distilling
    uv run --no-sync python bench/bench_distill.py --preset game --teacher best --grpo-minutes 30 --distill-minutes 30
    uv run --no-sync python bench/bench_distill.py --report-only --out-dir DIR      # the table of runs already made

1. GRPO: `orchestrate.rl --preset P` from the untrained model for --grpo-minutes. The teacher: its newest
   checkpoint (--teacher newest), or the one its held-out success was best at (--teacher best: every
   checkpoint is kept during the run, the others deleted after it).
2. Distillation: `orchestrate.rl --preset P --teacher.model TEACHER --train.estimator zero` (the teacher's term
   alone) from the same untrained model, sampling at temperature 1 (where the term is the per-token reverse KL
   exactly), evaluated every 2 iterations, for --distill-minutes.
Both start from the command's start (servers, the first evaluation included). Two targets: the student reaches
90% of the teacher's held-out success within a third of the minutes GRPO took to first reach the teacher's;
and, at the same minutes from the start (the shorter run's), the student's held-out success beats GRPO's.
Prints the table, writes OUT/distill_PRESET.json and OUT/distill_PRESET.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_trees import run  # noqa: E402

from contract.rundir import RunDir  # noqa: E402
from orchestrate.loop.metrics import read_metrics  # noqa: E402


def held_out(run_dir: Path) -> list[tuple[float, float, int]]:
    """(minutes from the command's start, held-out success, iteration) of each evaluation."""
    return [(r["elapsed_s"] / 60, r["eval_success_rate"], r["iteration"]) for r in read_metrics(run_dir / "metrics.jsonl")
            if r.get("eval_success_rate") is not None and "elapsed_s" in r]  # fmt: skip


def first_reaching(points, level: float) -> float | None:
    """Minutes at which a run's held-out success first reached `level` (none: never)."""
    return next((m for m, s, _ in points if s >= level - 1e-9), None)


def at(points, minutes: float) -> tuple[float, float, int] | None:
    """A run's latest evaluation at or before `minutes` (none: none yet)."""
    return ([p for p in points if p[0] <= minutes + 1e-9] or [None])[-1]


def best_checkpoint(run_dir: Path, points) -> tuple[Path, float, int]:
    """The checkpoint (weights served at that evaluation) with the best held-out success after training
    started, the earliest of equals; every other checkpoint of the run is deleted."""
    _, success, iteration = max((p for p in points if p[2] > 0), key=lambda p: (p[1], -p[2]))
    run = RunDir(run_dir)
    keep = run.checkpoint(iteration)
    if not (keep / "config.json").exists():
        raise SystemExit(
            f"{keep}: the checkpoint of iteration {iteration} is not on disk (kept: --run.keep_checkpoints)"
        )
    for other in run.checkpoints.iterdir():
        if other != keep:
            shutil.rmtree(other, ignore_errors=True)
    return keep, success, iteration


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="embedded")
    parser.add_argument("--grpo-minutes", type=float, default=20.0)
    parser.add_argument("--distill-minutes", type=float, default=8.0)
    parser.add_argument("--teacher", choices=("newest", "best"), default="newest",
                        help="GRPO's checkpoint that teaches: its newest, or its best held-out")  # fmt: skip
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
        run(args.preset, grpo, args.grpo_minutes, ["--run.keep_checkpoints", "1000"] if args.teacher == "best" else [])
    teacher_curve = held_out(grpo)
    if args.teacher == "best":
        source_file = root / f"{args.preset}-teacher.json"
        if args.report_only:
            source = json.loads(source_file.read_text())
        else:
            path, success, iteration = best_checkpoint(grpo, teacher_curve)
            source = {"path": str(path), "success": success, "iteration": iteration}
            source_file.write_text(json.dumps(source))
        teacher_model, teacher = source["path"], source["success"]
    else:
        source = {"path": str(grpo), "success": teacher_curve[-1][1], "iteration": teacher_curve[-1][2]}
        teacher_model, teacher = str(grpo), teacher_curve[-1][1]
    if not args.report_only:
        run(args.preset, student, args.distill_minutes, ["--teacher.model", teacher_model, "--train.estimator", "zero",
                                                         "--rollouts.temperature", "1.0", "--eval.every", "2"])  # fmt: skip
    student_curve = held_out(student)
    grpo_reached = first_reaching(teacher_curve, teacher)
    student_reached = first_reaching(student_curve, 0.9 * teacher)
    ratio = student_reached / grpo_reached if student_reached is not None and grpo_reached else None
    same = min(teacher_curve[-1][0], student_curve[-1][0])  # the shorter run's last evaluation
    rl_then, student_then = at(teacher_curve, same), at(student_curve, same)
    results = {"preset": args.preset, "teacher": args.teacher, "teacher_checkpoint": source,
               "teacher_success": teacher, "grpo_minutes_to_teacher": grpo_reached,
               "student_minutes_to_90pct": student_reached, "time_ratio": ratio,
               "same_minutes": same, "grpo_at_same_minutes": rl_then[1], "student_at_same_minutes": student_then[1],
               "grpo": teacher_curve, "distill": student_curve}  # fmt: skip
    print(f"{args.preset}: teacher (GRPO's {args.teacher} checkpoint, iteration {source['iteration']}) "
          f"{100 * teacher:.1f}% held-out, first reached at {grpo_reached:.1f} min")  # fmt: skip
    for label, points in (("GRPO", teacher_curve), ("distillation", student_curve)):
        print(f"  {label}: " + ", ".join(f"it {i} {m:.1f} min {100 * s:.1f}%" for m, s, i in points))
    if student_reached is None:
        print(f"  the student did not reach 90% of the teacher ({90 * teacher:.1f}%) within {args.distill_minutes} min")
    else:
        print(f"  the student reached {90 * teacher:.1f}% at {student_reached:.1f} min: {ratio:.2f} of GRPO's time")
    print(f"  at {same:.1f} min: GRPO {100 * rl_then[1]:.1f}% (iteration {rl_then[2]}), the student "
          f"{100 * student_then[1]:.1f}% (iteration {student_then[2]})")  # fmt: skip
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
