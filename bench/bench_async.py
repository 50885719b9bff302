"""Asynchronous pipeline: the embedded preset at async levels 0, 1 and 2, side by side, in one run.

    uv run python bench/bench_async.py [--iterations 10] [--levels 0,1,2] [--eval-every 5]
                                       [--root /tmp/bench_async] [--plot bench/results/bench_async/async_levels.png]

A level written with an `i` (`--levels 1,1i`) is that level with `--run.in_flight_swaps`: new weights enter
the server under the calls in flight instead of after draining them; the table then compares the seconds
calls were held back per iteration (time_weight_sync) and the share of calls that spanned two versions.

Each level is one real run (`python -m orchestrate.rl`, the embedded preset: vLLM server, reference
server, accelerate-launched trainer), one after the other, with the policy server and the trainer on
disjoint CPU cores (`--server.cpus` / `--trainer.cpus`, as separate accelerators would be). From each run's
metrics.jsonl it prints: iterations per hour (training iterations over the minutes from the first
iteration's start to the last record), mean trainer and generator busy fractions, held-out success at each
evaluation against wall minutes; then the issue's targets as ratios against level 0 in this same run:

  - level 1 iterations per hour >= 1.5x level 0's;
  - trainer busy >= 80% of wall time at level 1;
  - level 1 reaches level 0's last held-out success in <= 0.75x level 0's minutes.

Where a target is missed it prints the bound that stops it on this machine and the figure the same
schedule gives with two accelerators, from level 0's measured phase times: with generation (rollouts,
reward, reference, reload, evaluation: G seconds per iteration) and training (T seconds per batch) on
separate devices, a level >= 1 iteration takes max(G, T) instead of G + T.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # provenance.py, also when this file is loaded by its path

from provenance import results_dir, write_sidecar  # noqa: E402

GEN_PHASES = ("generate", "reward", "reference", "weight_sync", "eval")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument(
        "--levels", default="0,1,2",
        help="comma-separated async levels, each optionally with an i (in-flight swaps); the first is the baseline",
    )  # fmt: skip
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-tasks", type=int, default=200)
    parser.add_argument("--root", type=Path, default=Path("/tmp/bench_async"), help="run directories (replaced)")
    parser.add_argument("--plot", type=Path, default=results_dir(__file__) / "async_levels.png")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the server and the trainer to cores")
    parser.add_argument(
        "--report-only", action="store_true", help="run nothing: report and plot the runs already under --root"
    )
    parser.add_argument(
        "--extra", default="", help="more orchestrate.rl options, e.g. '--rollouts.tasks_per_iteration 8'"
    )
    args = parser.parse_args(argv)
    args.levels = [x.strip() for x in args.levels.split(",") if x.strip()]
    if not args.levels or not all(x.removesuffix("i").isdigit() for x in args.levels):
        parser.error(f"--levels: comma-separated integers >= 0, each optionally with an i, got {args.levels!r}")
    if any(x.endswith("i") and int(x[:-1]) == 0 for x in args.levels):
        parser.error("--levels: in-flight swaps (i) need a level of 1 or more")
    if args.iterations <= 0 or args.eval_every <= 0 or args.eval_tasks <= 0:
        parser.error("--iterations, --eval-every and --eval-tasks must be > 0")
    cores = sorted(os.sched_getaffinity(0))
    if not args.no_pin and len(cores) < 2:
        parser.error(f"pinning needs two cores, this process may use {cores}; pass --no-pin")
    args.cores = cores
    return args


def run_level(level: str, args: argparse.Namespace) -> list[dict]:
    run = args.root / f"level{level}"
    shutil.rmtree(run, ignore_errors=True)
    command = [
        sys.executable, "-m", "orchestrate.rl", "--run-dir", str(run), "--iterations", str(args.iterations),
        "--run.async_level", level.removesuffix("i"), "--eval.every", str(args.eval_every),
        "--eval.tasks", str(args.eval_tasks),
    ]  # fmt: skip
    if level.endswith("i"):
        command += ["--run.in_flight_swaps", "true"]
    if not args.no_pin:  # half the cores each: the server first, the trainer the rest
        half = len(args.cores) // 2
        command += ["--server.cpus", ",".join(map(str, args.cores[:half])),
                    "--trainer.cpus", ",".join(map(str, args.cores[half:]))]  # fmt: skip
    command += args.extra.split()
    print(f"level {level}: {' '.join(command[1:])}", flush=True)
    start = time.time()
    with open(args.root / f"level{level}.log", "w") as log:
        out = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if out.returncode != 0:
        raise SystemExit(f"level {level} failed (exit {out.returncode}); see {args.root / f'level{level}.log'}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    print(f"level {level}: done in {(time.time() - start) / 60:.1f} min", flush=True)
    shutil.rmtree(run / "checkpoints", ignore_errors=True)  # the disk is finite; metrics and tapes stay
    return records


def read_level(level: str, args: argparse.Namespace) -> list[dict]:
    path = args.root / f"level{level}" / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"--report-only: no {path} (run the levels first)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def schedule_seconds(phases: list[tuple[float, float, float]], level: int) -> float:
    """Wall seconds of the loop's schedule at async `level` with generation and training on two devices, from
    measured per-iteration (generation side g, training t, evaluation after it e) seconds: iteration i is
    generated once the generator is free (records j <= i - 1 - level are complete, so checkpoint i - 1 - level
    is served); the trainer trains batches in order as they arrive; record j waits for checkpoint j and then
    runs its evaluation on the generator. Level 0 gives the sum of all phases."""
    n = len(phases)
    done = [0.0] * (n + 1)  # done[i]: checkpoint i written (0: the initial weights)
    generator = trainer = 0.0
    completed = 0

    def complete(j: int) -> float:
        return max(generator, done[j]) + phases[j - 1][2]

    for i in range(1, n + 1):
        generator += phases[i - 1][0]
        trainer = done[i] = max(trainer, generator) + phases[i - 1][1]
        while completed < i - level:
            completed += 1
            generator = complete(completed)
    while completed < n:
        completed += 1
        generator = complete(completed)
    return generator


def summarise(records: list[dict]) -> dict:
    """Figures of one run, timed from the end of the evaluation before training (the servers are up)."""
    t0 = next((r["elapsed_s"] for r in records if r["iteration"] == 0), 0.0)
    train = [r for r in records if r["iteration"] > 0]
    minutes = (train[-1]["elapsed_s"] - t0) / 60
    evals = [
        ((r["elapsed_s"] - t0) / 60 if r["iteration"] else 0.0, r["iteration"], r["eval_success_rate"])
        for r in records
        if "eval_success_rate" in r
    ]
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in train)  # noqa: E731
    return {
        "iterations_per_hour": len(train) / minutes * 60, "minutes": minutes, "evals": evals,
        "trainer_busy": mean("trainer_busy_frac"), "generator_busy": mean("generator_busy_frac"),
        "gen_s": statistics.median(sum(r.get(f"time_{p}", 0.0) for p in GEN_PHASES) for r in train),
        "train_s": statistics.median(r.get("train_seconds", 0.0) for r in train),
        "iteration_s": statistics.median(r.get("time_total", 0.0) for r in train),
        "phases": [(sum(r.get(f"time_{p}", 0.0) for p in GEN_PHASES if p != "eval"), r.get("train_seconds", 0.0),
                    r.get("time_eval", 0.0)) for r in train],
        "held_s": mean("time_weight_sync"), "swapped": mean("swapped_call_rate"),
    }  # fmt: skip


def minutes_to_reach(evals: list[tuple[float, int, float]], target: float) -> float | None:
    return next((m for m, i, s in evals if i > 0 and s >= target), None)


def report(results: dict[str, dict]) -> None:
    print("\nlevel | iterations/hour | trainer busy | generator busy | weight swap s/it | calls over 2 versions | "
          "held-out success (minutes)")  # fmt: skip
    for level, s in results.items():
        evals = ", ".join(f"it{i} {v:.3f} ({m:.1f})" for m, i, v in s["evals"])
        print(
            f"{level:>5} | {s['iterations_per_hour']:15.1f} | {s['trainer_busy']:12.0%} | "
            f"{s['generator_busy']:14.0%} | {s['held_s']:16.2f} | {s['swapped']:21.1%} | {evals}"
        )
    for level in [k for k in results if k.endswith("i") and k[:-1] in results]:
        drained, kept = results[level[:-1]], results[level]
        print(f"\nin-flight swaps at level {level[:-1]}: calls held back {kept['held_s']:.2f} s per iteration against "
              f"{drained['held_s']:.2f} s draining; iterations per hour x{kept['iterations_per_hour'] / drained['iterations_per_hour']:.2f}")  # fmt: skip
    levels = [k for k in results if not k.endswith("i")]  # the drained levels, measured against the first
    if not levels:
        return
    base = results[levels[0]]
    one = results.get("1")
    if one is None:
        return
    speedup = one["iterations_per_hour"] / base["iterations_per_hour"]
    two_accel = (base["gen_s"] + base["train_s"]) / max(base["gen_s"], base["train_s"])
    # the same schedule on two accelerators, from level 0's measured phase times (this run's iterations and
    # evaluations: the pipeline's fill and drain and the evaluations' stalls included)
    sync_s = schedule_seconds(base["phases"], 0)
    busy_bound = {k: sum(t for _, t, _ in base["phases"]) / schedule_seconds(base["phases"], int(k)) for k in levels}
    print(f"\nlevel 1 / level {levels[0]} iterations per hour: x{speedup:.2f} (target >= 1.5)")
    print(
        f"  level {levels[0]} per iteration: generation side {base['gen_s']:.1f} s, training {base['train_s']:.1f} s,"
        f" wall {base['iteration_s']:.1f} s; steady state with overlap: (G + T) / max(G, T) = x{two_accel:.2f}"
    )
    for k in levels[1:]:
        print(f"  the schedule of these {len(base['phases'])} iterations and their evaluations at level {k} on two "
              f"accelerators, from level {levels[0]}'s phase times: x{sync_s / schedule_seconds(base['phases'], int(k)):.2f}"
              f" (measured here: x{results[k]['iterations_per_hour'] / base['iterations_per_hour']:.2f}), trainer "
              f"busy {busy_bound[k]:.0%}")  # fmt: skip
    print(
        f"level 1 trainer busy: {one['trainer_busy']:.0%} of wall time (target >= 80%; {busy_bound.get('1', 0):.0%} "
        f"on two accelerators by the schedule above). Here the orchestrator (tokenising, the environment, the "
        f"HTTP client) has no core of its own and slows the side it shares a core with, and each evaluation "
        f"stops generation while the trainer, at most one batch ahead, runs out of work."
    )
    target = base["evals"][-1][2] if base["evals"] else None
    if target is not None:
        base_min = base["evals"][-1][0]
        reach = minutes_to_reach(one["evals"], target)
        if reach is None:
            print(
                f"level 1 never reached level {levels[0]}'s last held-out success {target:.3f} (target: within "
                f"0.75x of {base_min:.1f} min)"
            )
        else:
            print(
                f"level 1 reached level {levels[0]}'s last held-out success {target:.3f} in {reach:.1f} min against "
                f"{base_min:.1f} min: x{reach / base_min:.2f} (target <= 0.75)"
            )


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for level, s in results.items():
        ax.plot(
            [m for m, _, _ in s["evals"]],
            [v for _, _, v in s["evals"]],
            marker="o",
            label=f"async_level {level.removesuffix('i')}{' in-flight' * level.endswith('i')}: "
            f"{s['iterations_per_hour']:.0f} it/h",
        )
    ax.set_xlabel("wall minutes (after the first evaluation)")
    ax.set_ylabel("held-out success")
    ax.set_title("embedded preset: async levels")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    write_sidecar(path)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        results = {level: summarise(read_level(level, args)) for level in args.levels}
    else:
        results = {level: summarise(run_level(level, args)) for level in args.levels}
    report(results)
    plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
