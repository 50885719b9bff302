"""On-policy distillation against the RL run that made its teacher: held-out success against wall time.

    uv run --no-sync python bench/bench_distill.py                                  # 20 min GRPO, then 8 min distilling
    uv run --no-sync python bench/bench_distill.py --preset game --teacher best --grpo-minutes 30 --distill-minutes 30
    uv run --no-sync python bench/bench_distill.py --report-only --out-dir DIR      # the table of runs already made

1. GRPO: `orchestrate.rl --preset P` from the untrained model for --grpo-minutes. The teacher: its newest
   checkpoint (--teacher newest; measured with `orchestrate.eval` when the run stopped after its last
   evaluation, and that measurement is then a point of GRPO's curve, at the end of its iteration), or the
   one its held-out success was best at (--teacher best: every checkpoint is kept during the run, the others
   deleted after it).
2. Distillation: `orchestrate.rl --preset P --teacher.model TEACHER --train.estimator zero` (the teacher's term
   alone) from the same untrained model, sampling at temperature 1 (where the term is the per-token reverse KL
   exactly), evaluated every 2 iterations, for --distill-minutes. --student-options adds options or replaces
   these (e.g. "--train.estimator batch --teacher.coef 1": the teacher's term beside the reward's);
   --reuse-grpo runs another student of the same teacher; --tag names its directory and outputs.
--offline-eval K: neither run evaluates itself (`--eval.every 0`); each writes its weights every K iterations and
keeps them, and after it `orchestrate.eval RUN --versions all --step K` evaluates those versions (and the
newest) on one server, each placed at the minute its checkpoint came: both curves are then on the wall clock of
runs that spent no time evaluating, at the same cadence. Once a run's curve is written its checkpoints are deleted
(all but the teacher): a 16-minute embedded run keeps 40 of 625 MB each until then.
Both start from the command's start (servers, the first evaluation included). Two targets: the student reaches
90% of the teacher's held-out success within a third of the minutes GRPO took to first reach the teacher's;
and, at the same minutes from the start (the shorter run's), the student's held-out success beats GRPO's. Up
to those minutes the curves are compared as step functions: the minutes the student is ahead, level and behind,
and each curve's mean success over them. A teacher no better than the untrained model's held-out success (a GRPO
run that did not learn) starts no student: one line, exit 1, the GRPO run kept.
Prints the table, writes OUT/distill_PRESET.json and OUT/distill_PRESET.png.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_trees import run  # noqa: E402
from provenance import results_dir, write_json  # noqa: E402

from contract.rundir import RunDir  # noqa: E402
from orchestrate.loop.metrics import read_metrics  # noqa: E402

CURVE = "evals/curve"  # where --offline-eval's `orchestrate.eval --versions` writes a run's curve


def held_out(
    run_dir: Path, evaluations: bool = True, measured: dict[int, float] | None = None
) -> list[tuple[float, float, int]]:
    """(minutes from the command's start, held-out success, iteration) of each evaluation; without
    `evaluations`, the minutes the evaluations so far took (metrics' time_eval) are left out of the clock, so
    that two runs evaluated at different intervals compare by the time their training took. `measured`: the
    success of checkpoints the run did not evaluate, measured afterwards (orchestrate.eval), each placed at
    the end of its iteration (when its checkpoint was served). A run evaluated after it (--offline-eval): the
    points of its curve.json, placed by the same clock (orchestrate.loop.metrics.version_clock)."""
    curve = run_dir / CURVE / "curve.json"
    if curve.is_file():
        key = "minutes" if evaluations else "training_minutes"
        points = json.loads(curve.read_text())["points"]
        return [(p[key], p["pass@1"]["value"], p["version"]) for p in points if p[key] is not None]
    points, evaluating, measured = [], 0.0, measured or {}
    for r in read_metrics(run_dir / "metrics.jsonl"):
        evaluating += r.get("time_eval") or 0.0
        success = r.get("eval_success_rate")
        if success is None:
            success = measured.get(r["iteration"])
        if success is not None and "elapsed_s" in r:
            seconds = r["elapsed_s"] - (0.0 if evaluations else evaluating)
            points.append((seconds / 60, success, r["iteration"]))
    return points


def evaluate_versions(run_dir: Path, step: int) -> None:
    """--offline-eval: the run's versions on disk, every `step`-th and the newest, evaluated on one server as the
    loop would have (its held-out tasks and temperature) into RUN/evals/curve."""
    cmd = [sys.executable, "-m", "orchestrate.eval", str(run_dir), "--versions", "all", "--step", str(step),
           "--out", str(run_dir / CURVE), "--no-progress"]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    log_path = run_dir.with_suffix(".eval.log")
    with open(log_path, "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"the evaluation of {run_dir} failed ({log_path}); the same command with --reuse-grpo "
                             "plays only what is left of GRPO's")  # fmt: skip


STUDENT_DEFAULTS = {"--train.estimator": "zero", "--rollouts.temperature": "1.0", "--eval.every": "2"}


def drop_evaluated(run_dir: Path, keep: Path | None = None) -> None:
    """--offline-eval: once a run's curve is written, its checkpoints (625 MB each for the embedded model, one
    per version kept) are deleted, all but `keep` (the teacher): the curve holds their figures."""
    if not (run_dir / CURVE / "curve.json").is_file():
        return
    checkpoints = RunDir(run_dir).checkpoints
    for folder in checkpoints.iterdir() if checkpoints.is_dir() else ():
        if keep is None or folder.resolve() != keep.resolve():
            shutil.rmtree(folder, ignore_errors=True)


# options that change the held-out evaluation itself: the run seed draws a generated environment's test
# problems (the embedded preset's arithmetic: agents/envs/math.py), so a student with another would be measured
# on other tasks than GRPO's curve and the teacher's success
HELD_OUT = ("--run.seed", "--env.", "--eval.tasks", "--eval.temperature", "--eval.max_tokens", "--preset")


def student_options(teacher_model: str, extra: list[str]) -> list[str]:
    """The distillation run's options: the teacher, the student's defaults (each replaced by the same option
    in `extra`: the loop takes an option once), then `extra`. ValueError for an option that would change the
    held-out tasks or their scoring (HELD_OUT): the curves would not compare."""
    given = {o.split("=")[0] for o in extra if o.startswith("--")}
    if changed := sorted(o for o in given if o.startswith(HELD_OUT)):
        raise ValueError(f"--student-options {changed[0]}: changes the held-out evaluation (the run seed draws a "
                         "generated environment's test problems), so the student's curve would not compare with "
                         "GRPO's; leave it out")  # fmt: skip
    kept = [x for option, value in STUDENT_DEFAULTS.items() if option not in given for x in (option, value)]
    return ["--teacher.model", teacher_model, *kept, *extra]


def setting(run_dir: Path) -> str:
    """A student run's learning rate, episodes per iteration, (beside the teacher's) its reward's estimator and
    the teacher's top-k term, read from its resolved config."""
    config = RunDir(run_dir).saved_config()
    rollouts = config["rollouts"]
    teacher, estimator = config["teacher"], config["train"]["estimator"]
    terms = [f"teacher x {teacher['coef']:g}"] if teacher["coef"] else []
    if teacher.get("topk"):  # the teacher's top-k term, beside the advantage term or alone (coef 0)
        terms.append(f"top-{teacher['topk']} x {teacher['topk_coef']:g}")
    if estimator != "zero":
        signal = f", {estimator} + " + " + ".join(terms)
    else:
        signal = "" if terms == ["teacher x 1"] else ", " + " + ".join(terms)
    return f"lr {config['train']['lr']:g}, {rollouts['tasks_per_iteration']} tasks x {rollouts['attempts']}{signal}"


def rl_setting(run_dir: Path) -> str:
    """The RL run's algorithm and estimator, trees named, read from its resolved config."""
    config = RunDir(run_dir).saved_config()
    trees = f", trees of width {config['tree']['width']}" if config.get("tree", {}).get("width") else ""
    return f"{config['train']['algorithm'].upper()}, {config['train']['estimator']}{trees}"


def first_reaching(points, level: float) -> float | None:
    """Minutes at which a run's held-out success first reached `level` (none: never)."""
    return next((m for m, s, _ in points if s >= level - 1e-9), None)


def at(points, minutes: float) -> tuple[float, float, int] | None:
    """A run's latest evaluation at or before `minutes` (none: none yet)."""
    return ([p for p in points if p[0] <= minutes + 1e-9] or [None])[-1]


def compare_curves(student, rl, until: float) -> dict:
    """The two curves as step functions (each evaluation's success holds until the run's next one) from the
    command's start to `until`: the minutes the student is ahead of RL, level with it, behind it, and each
    curve's mean success over that span (its area over the minutes). Before a run's first evaluation its
    curve is its first point (both start from the untrained model)."""
    times = sorted({0.0, until} | {m for m, _, _ in (*student, *rl) if m < until})
    value = lambda points, t: (at(points, t) or points[0])[1]  # noqa: E731
    spans = {"ahead": 0.0, "level": 0.0, "behind": 0.0}
    area = {"student": 0.0, "rl": 0.0}
    for t0, t1 in zip(times, times[1:]):
        s, r = value(student, t0), value(rl, t0)
        spans["ahead" if s > r + 1e-9 else "behind" if r > s + 1e-9 else "level"] += t1 - t0
        area["student"] += s * (t1 - t0)
        area["rl"] += r * (t1 - t0)
    return {"until": until, "minutes": spans, "mean_success": {k: v / until for k, v in area.items()}}


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


def measure_checkpoint(run_dir: Path, iteration: int) -> float:
    """Held-out success of one checkpoint of a run, measured as the loop measures it: `orchestrate.eval RUN
    --version N` plays the run's held-out tasks at its evaluation temperature; its eval.json is kept in
    RUN/evals/teacher-vN."""
    out = run_dir / "evals" / f"teacher-v{iteration}"
    cmd = [sys.executable, "-m", "orchestrate.eval", str(run_dir), "--version", str(iteration), "--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
    return json.loads((out / "eval.json").read_text())["pass@1"]["value"]


def newest_checkpoint(run_dir: Path, points, measure=measure_checkpoint) -> tuple[Path, float, int, str]:
    """The run's newest checkpoint, its held-out success and how that was measured: the run's own evaluation
    of it, else (the run stopped between evaluations) `measure` (an `orchestrate.eval` of that version)."""
    iteration = RunDir(run_dir).newest_checkpoint()
    if not iteration:
        raise SystemExit(f"{run_dir}: no checkpoint on disk to teach with")
    success = next((s for _, s, i in points if i == iteration), None)
    how = (
        "orchestrate.eval --versions, after the run"
        if (run_dir / CURVE / "curve.json").is_file()
        else "the run's evaluation"
    )
    if success is None:
        success, how = measure(run_dir, iteration), f"orchestrate.eval --version {iteration}"
    return RunDir(run_dir).checkpoint(iteration), success, iteration, how


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="embedded")
    parser.add_argument("--grpo-minutes", type=float, default=20.0)
    parser.add_argument("--distill-minutes", type=float, default=8.0)
    parser.add_argument("--teacher", choices=("newest", "best"), default="newest",
                        help="GRPO's checkpoint that teaches: its newest, or its best held-out")  # fmt: skip
    parser.add_argument("--student-options", default="",
                        help="options added to the distillation run's command, e.g. \"--train.lr 3e-5\"")  # fmt: skip
    parser.add_argument("--tag", default="", help="suffix of the distillation run's directory and of the outputs")
    parser.add_argument("--reuse-grpo", action="store_true",
                        help="use the GRPO run (and teacher) already in --out-dir; run the distillation only")  # fmt: skip
    parser.add_argument("--out-dir", default="/tmp/bench_distill", help="where the runs go")
    parser.add_argument("--out", default=str(results_dir(__file__)), help="where the JSON and the plot go")
    parser.add_argument("--report-only", action="store_true", help="read the runs in --out-dir, start none")
    parser.add_argument("--offline-eval", type=int, default=0, metavar="K",
                        help="no evaluation in the runs: every K-th version evaluated after each run (0: off)")  # fmt: skip
    args = parser.parse_args()
    if args.offline_eval < 0:
        parser.error(f"--offline-eval {args.offline_eval}: expected K >= 1, or 0 (off)")
    try:  # before anything is written
        student_options("", shlex.split(args.student_options))
    except ValueError as exc:
        parser.error(str(exc))
    k = args.offline_eval
    offline = ["--eval.every", "0", "--train.save_weights_every", str(k), "--run.keep_checkpoints", "1000"] if k else []
    root = Path(args.out_dir)
    root.mkdir(parents=True, exist_ok=True)
    grpo, student = root / f"{args.preset}-grpo", root / f"{args.preset}-distill{args.tag}"
    extra = shlex.split(args.student_options)
    if not args.report_only:
        for d in (student,) if args.reuse_grpo else (grpo, student):
            if d.exists():
                parser.error(f"{d} exists: remove it, or pass --report-only")
        if args.reuse_grpo and not (grpo / "metrics.jsonl").exists():
            parser.error(f"--reuse-grpo: {grpo} holds no run")
        if not args.reuse_grpo:
            keep = ["--run.keep_checkpoints", "1000"] if args.teacher == "best" and not k else []
            run(args.preset, grpo, args.grpo_minutes, offline + keep)
        if k:  # with --reuse-grpo after a failure: what was evaluated is kept, only the rest is played
            evaluate_versions(grpo, k)
    teacher_curve = held_out(grpo)
    source_file = root / f"{args.preset}-teacher.json"  # the teacher chosen, kept for --report-only and --reuse-grpo
    if args.report_only or (args.reuse_grpo and source_file.exists()):
        source = json.loads(source_file.read_text())
    else:
        if args.teacher == "best":
            how = "orchestrate.eval --versions, after the run" if k else "the run's evaluation"
            path, success, iteration = best_checkpoint(grpo, teacher_curve)
        else:
            path, success, iteration, how = newest_checkpoint(grpo, teacher_curve)
        source = {"path": str(path), "success": success, "iteration": iteration, "measured_by": how}
        source_file.write_text(json.dumps(source))
        if k:
            drop_evaluated(grpo, keep=Path(source["path"]))
    teacher_model, teacher = source["path"], source["success"]
    untrained = next((s for _, s, i in teacher_curve if i == 0), None)
    if not args.report_only and untrained is not None and teacher <= untrained + 1e-9:
        print(f"{args.preset}: GRPO's {args.teacher} checkpoint (iteration {source['iteration']}, {100 * teacher:.1f}% "
              f"held-out) is no better than the untrained model ({100 * untrained:.1f}%): nothing to distill, no "
              f"student started; GRPO's run stays in {grpo}", file=sys.stderr)  # fmt: skip
        return 1
    # a teacher measured after the run is a point of the run's curve too (GRPO had reached it by then); where
    # the run evaluated that checkpoint itself, held_out keeps the run's figure
    measured = {source["iteration"]: teacher}
    teacher_curve = held_out(grpo, measured=measured)
    if not args.report_only:
        run(args.preset, student, args.distill_minutes, student_options(teacher_model, offline + extra))
        if k:
            evaluate_versions(student, k)
            drop_evaluated(student)
    student_curve = held_out(student)
    # the same comparison with the evaluations' minutes left out (the student is evaluated more often)
    training = {"grpo": held_out(grpo, evaluations=False, measured=measured),
                "distill": held_out(student, evaluations=False)}  # fmt: skip
    g, s_ = first_reaching(training["grpo"], teacher), first_reaching(training["distill"], 0.9 * teacher)
    training_ratio = s_ / g if s_ is not None and g else None
    grpo_reached = first_reaching(teacher_curve, teacher)
    student_reached = first_reaching(student_curve, 0.9 * teacher)
    ratio = student_reached / grpo_reached if student_reached is not None and grpo_reached else None
    same = min(teacher_curve[-1][0], student_curve[-1][0])  # the shorter run's last evaluation
    rl_then, student_then = at(teacher_curve, same), at(student_curve, same)
    curves = compare_curves(student_curve, teacher_curve, same)
    results = {"preset": args.preset, "teacher": args.teacher, "teacher_checkpoint": source,
               "teacher_success": teacher, "grpo_minutes_to_teacher": grpo_reached,
               "student_minutes_to_90pct": student_reached, "time_ratio": ratio, "student_options": extra,
               "student_setting": setting(student),
               "offline_eval": k or None,
               "training_minutes": {"grpo_to_teacher": g, "student_to_90pct": s_, "time_ratio": training_ratio},
               "same_minutes": same, "grpo_at_same_minutes": rl_then[1], "student_at_same_minutes": student_then[1],
               "curves_to_same_minutes": curves,
               "grpo": teacher_curve, "distill": student_curve}  # fmt: skip
    print(f"{args.preset}: teacher (GRPO's {args.teacher} checkpoint, iteration {source['iteration']}) "
          f"{100 * teacher:.1f}% held-out, first reached at {grpo_reached:.1f} min")  # fmt: skip
    for label, points in (("GRPO", teacher_curve), ("distillation", student_curve)):
        print(f"  {label}: " + ", ".join(f"it {i} {m:.1f} min {100 * s:.1f}%" for m, s, i in points))
    if student_reached is None:
        print(f"  the student did not reach 90% of the teacher ({90 * teacher:.1f}%) within {args.distill_minutes} min")
    else:
        print(f"  the student reached {90 * teacher:.1f}% at {student_reached:.1f} min: {ratio:.2f} of GRPO's time")
    if training_ratio is not None:
        print(f"  without the evaluations' minutes: GRPO reached the teacher's at {g:.1f} min, the student 90% of it "
              f"at {s_:.1f} min: {training_ratio:.2f} of GRPO's time")  # fmt: skip
    print(f"  at {same:.1f} min: GRPO {100 * rl_then[1]:.1f}% (iteration {rl_then[2]}), the student "
          f"{100 * student_then[1]:.1f}% (iteration {student_then[2]})")  # fmt: skip
    spans, mean = curves["minutes"], curves["mean_success"]
    print(f"  to {same:.1f} min the student was ahead of GRPO for {spans['ahead']:.1f} min, level for "
          f"{spans['level']:.1f}, behind for {spans['behind']:.1f}; mean held-out success over them: the student "
          f"{100 * mean['student']:.1f}%, GRPO {100 * mean['rl']:.1f}%")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"distill_{args.preset}{args.tag}.json", results)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    curves = [
        (f"{rl_setting(grpo)} (makes the teacher)", teacher_curve, "-"),
        (f"distillation, {setting(student)}", student_curve, "-"),
    ]
    for other in sorted(root.glob(f"{args.preset}-distill*")):  # the other students of this teacher, dashed
        if other.is_dir() and other != student and (other / "metrics.jsonl").exists():
            curves.append((f"distillation, {setting(other)}", held_out(other), "--"))
    for label, points, style in curves:
        ax.plot([m for m, _, _ in points], [100 * s for _, s, _ in points], marker="o", linestyle=style, label=label)
    ax.axhline(90 * teacher, color="grey", linestyle=":", label="90% of the teacher")
    ax.set_xlabel("minutes from the command's start")
    ax.set_ylabel("held-out success (%)")
    ax.set_title(f"{args.preset}: distillation from GRPO's checkpoint")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"distill_{args.preset}{args.tag}.png", dpi=90)
    print(f"wrote {out / f'distill_{args.preset}{args.tag}.json'} and {out / f'distill_{args.preset}{args.tag}.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
