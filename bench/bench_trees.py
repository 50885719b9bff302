"""Chains against trees on a multi-turn preset, for the same wall time: held-out success against minutes, generated
tokens and environment steps; then the learner's time per logical token on one of the tree run's batches, with
its shared prefixes computed once against the same batch unshared.

    uv run --no-sync python bench/bench_trees.py --minutes 25                    # game preset, both runs
    uv run --no-sync python bench/bench_trees.py --preset countdown --minutes 25
    uv run --no-sync python bench/bench_trees.py --preset python_tool --minutes 8 --options "--eval.every 1"
    uv run --no-sync python bench/bench_trees.py --report-only --out-dir DIR     # the table of runs already made
    uv run --no-sync python bench/bench_trees.py --arms tree --tag _wide --minutes 30 \
        --tree-options "--rollouts.attempts 4 --tree.width 3 --tree.points 2 --train.estimator tree"   # another tree

Each run is `orchestrate.rl --preset P --run.max_minutes M` started from its untrained model (the chain run as the
preset has it; the tree run with the preset's TREE_OPTIONS, chosen to generate about the chain's tokens per
iteration on the game and countdown), one after the other, with nothing else running. Generated tokens are
counted from the saved tapes (a fork's own calls: its replayed ones are its parent's) and environment steps too
(a fork's replayed turns are stepped again: they count). Prints a table and, at the highest held-out success both runs reached,
the tokens each generated to first reach it (the tree's as a share of the chain's); writes
OUT/trees_PRESET[TAG].json and OUT/trees_PRESET[TAG].png.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import results_dir, write_json  # noqa: E402

from orchestrate.loop.metrics import read_metrics  # noqa: E402
from orchestrate.loop.trees import generated_tokens  # noqa: E402
from tapes.store import read_tapes  # noqa: E402
from tapes.tape import EnvObservation  # noqa: E402

# Per preset: the tree run's options, chosen to generate about the chain run's tokens per iteration. The game
# (5 turns): two roots per task, branched into three at one point, twice deep. Countdown (2 turns, the second a
# retry after a wrong answer): two roots per task, each wrong first answer's retry sampled four times. The python
# tool (a tool call, then the answer after its output): one root per task, its answer after the tool's output
# sampled twice more, the tool's run restored in the sandbox by replaying the root's tape (about 0.4 of the
# chain's tokens an iteration: the turn the untrained model gets wrong is the answer).
TREE_OPTIONS = {
    "game": ["--rollouts.attempts", "2", "--tree.width", "3", "--tree.depth", "2", "--tree.token_budget", "160",
             "--train.estimator", "tree"],
    "countdown": ["--rollouts.attempts", "2", "--tree.width", "4", "--tree.depth", "1", "--tree.token_budget", "200",
                  "--train.estimator", "tree"],
    "python_tool": ["--rollouts.attempts", "1", "--tree.width", "3", "--train.estimator", "tree"],
}  # fmt: skip


def run(preset: str, run_dir: Path, minutes: float, extra: list[str]) -> float:
    """One loop run to its time limit; its wall seconds."""
    cmd = [sys.executable, "-m", "orchestrate.rl", "--preset", preset, "--run-dir", str(run_dir),
           "--run.max_minutes", str(minutes), "--iterations", "1000", *extra]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    start = time.time()
    with open(run_dir.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.time() - start


def tape_counts(run_dir: Path) -> dict[int, dict[str, int]]:
    """Per iteration: tokens its own calls generated, environment steps taken, episodes (forks included)."""
    out = {}
    for path in sorted((run_dir / "tapes").glob("iter_*.jsonl")):
        tokens = steps = episodes = 0
        for tape in read_tapes(path):
            episodes += 1
            tokens += generated_tokens(tape)
            steps += sum(isinstance(s, EnvObservation) and s.turn > 0 for s in tape.steps)
        out[int(path.stem.split("_")[1])] = {"tokens": tokens, "steps": steps, "episodes": episodes}
    return out


def curve(run_dir: Path) -> list[dict]:
    """Held-out points: iteration, minutes, success, and the generated tokens and environment steps so far."""
    counts = tape_counts(run_dir)
    points = []
    for r in read_metrics(run_dir / "metrics.jsonl"):
        if r.get("eval_success_rate") is None or "elapsed_s" not in r:
            continue
        i = r["iteration"]
        done = [c for k, c in counts.items() if k <= i]
        points.append({"iteration": i, "minutes": r["elapsed_s"] / 60, "success": r["eval_success_rate"],
                       "tokens": sum(c["tokens"] for c in done), "env_steps": sum(c["steps"] for c in done)})  # fmt: skip
    return points


def tokens_at_equal_success(runs: dict) -> dict | None:
    """The highest held-out success both the chain and the tree reached after training started, the generated
    tokens (and minutes) each first reached it with, and the tree's tokens as a share of the chain's. None when
    an arm is missing, or when that success is no better than the untrained model's (an arm never improved)."""
    if not {"chain", "tree"} <= set(runs):
        return None
    curves = {label: [p for p in runs[label]["curve"] if p["iteration"] > 0] for label in ("chain", "tree")}
    start = max((p["success"] for label in curves for p in runs[label]["curve"] if p["iteration"] == 0), default=0.0)
    if not all(curves.values()):
        return None
    level = min(max(p["success"] for p in c) for c in curves.values())
    if level <= start + 1e-9:
        return None
    first = {label: next(p for p in c if p["success"] >= level - 1e-9) for label, c in curves.items()}
    out = {"success": level, **{label: {"tokens": p["tokens"], "minutes": p["minutes"], "iteration": p["iteration"]}
                                for label, p in first.items()}}  # fmt: skip
    out["token_ratio"] = first["tree"]["tokens"] / first["chain"]["tokens"] if first["chain"]["tokens"] else None
    return out


def learner_figures(run_dir: Path) -> dict:
    """The run's trainer seconds per logical token and computed tokens per logical token, over its iterations."""
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train_logical_tokens" in r]
    logical = sum(r["train_logical_tokens"] * r.get("train_steps", 1) for r in records)
    computed = sum(r["train_tokens"] * r.get("train_steps", 1) for r in records)
    seconds = sum(r.get("train_seconds", 0.0) for r in records)
    return {"iterations": len(records), "logical_tokens": logical, "computed_tokens": computed,
            "computed_per_logical": computed / logical if logical else None,
            "train_s_per_1k_logical": 1000 * seconds / logical if logical else None}  # fmt: skip


def shared_vs_unshared(run_dir: Path) -> dict:
    """One learner step on the tree run's largest batch from the same weights, its forks sharing their
    parents' prefixes (the default) and not (each fork computed whole): seconds per logical token of each."""
    import finetune.passes as passes
    from contract.batch import read_batch
    from finetune.config import TrainConfig
    from finetune.learner import Learner

    config = json.loads((run_dir / "train_config.json").read_text())
    batch = max((run_dir / "batches").glob("*.jsonl"), key=lambda p: p.stat().st_size)
    samples = read_batch(batch)
    logical = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    model = json.loads((run_dir / "config.json").read_text())["model"]["policy"]
    from orchestrate.serving.models import resolve_model

    out = {"batch": batch.name, "samples": len(samples), "forks": sum(s.branch is not None for s in samples),
           "logical_tokens": logical}  # fmt: skip
    real = passes.fork_parents
    for label, parents in (("unshared", lambda s: [None] * len(s)), ("shared", real), ("shared_again", real)):
        passes.fork_parents = parents
        try:
            learner = Learner(resolve_model(model), TrainConfig.model_validate(config))
            start = time.perf_counter()
            metrics = learner.train_batch(samples, batch_index=1)
            seconds = time.perf_counter() - start
        finally:
            passes.fork_parents = real
        computed = sum(m["tokens"] for m in metrics)
        out[label] = {"seconds": seconds, "computed_tokens": computed, "s_per_1k_logical": 1000 * seconds / logical}
        print(f"  {label}: {seconds:.1f} s, {computed} tokens computed of {logical} logical", flush=True)
    best = min(out["shared"]["seconds"], out["shared_again"]["seconds"])
    out["time_ratio"] = best / out["unshared"]["seconds"]
    return out


def plot(results: dict, path: Path, preset: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, r in results["runs"].items():
        pts = r["curve"]
        axes[0].plot([p["minutes"] for p in pts], [100 * p["success"] for p in pts], marker="o", label=label)
        axes[1].plot([p["tokens"] / 1000 for p in pts], [100 * p["success"] for p in pts], marker="o", label=label)
    axes[0].set_xlabel("minutes from the command's start")
    axes[1].set_xlabel("generated tokens (thousands)")
    for ax in axes:
        ax.set_ylabel("held-out success (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{preset}: chains against trees")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="game")
    parser.add_argument("--minutes", type=float, default=25.0, help="each run's run.max_minutes")
    parser.add_argument("--out-dir", default="/tmp/bench_trees", help="where the runs go")
    parser.add_argument("--out", default=str(results_dir(__file__)), help="where the JSON and the plot go")
    parser.add_argument("--report-only", action="store_true", help="read the runs in --out-dir, start none")
    parser.add_argument("--skip-learner", action="store_true", help="no shared-against-unshared learner step")
    parser.add_argument("--arms", default="chain,tree", help="which runs to make: chain, tree or both")
    parser.add_argument("--tree-options", default=None,
                        help="the tree run's options instead of the preset's TREE_OPTIONS, e.g. \"--tree.width 3 ...\"")  # fmt: skip
    parser.add_argument("--options", default="",
                        help="options both runs take, e.g. \"--eval.every 1\" (the tree's own come after them)")  # fmt: skip
    parser.add_argument("--tag", default="", help="suffix of the runs' directories and of the outputs")
    args = parser.parse_args()
    root = Path(args.out_dir)
    root.mkdir(parents=True, exist_ok=True)
    if args.preset not in TREE_OPTIONS and args.tree_options is None:
        parser.error(f"--preset {args.preset}: no tree options for it here (have: {', '.join(TREE_OPTIONS)}); "
                     "pass --tree-options")  # fmt: skip
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or set(arms) - {"chain", "tree"}:
        parser.error(f"--arms {args.arms}: chain, tree or chain,tree")
    tree = shlex.split(args.tree_options) if args.tree_options is not None else TREE_OPTIONS[args.preset]
    both = shlex.split(args.options)
    runs = {label: both + extra for label, extra in (("chain", []), ("tree", tree)) if label in arms}
    results: dict = {"preset": args.preset, "minutes": args.minutes, "options": both, "tree_options": tree, "runs": {}}
    for label, extra in runs.items():
        run_dir = root / f"{args.preset}-{label}{args.tag}"
        if not args.report_only:
            if run_dir.exists():
                parser.error(f"{run_dir} exists: remove it, or pass --report-only")
            run(args.preset, run_dir, args.minutes, extra)
        results["runs"][label] = {"curve": curve(run_dir), "learner": learner_figures(run_dir)}
    print(f"\n{args.preset}: held-out success (iteration, minutes, generated tokens, environment steps)")
    for label, r in results["runs"].items():
        print(f"  {label}: " + "; ".join(f"it {p['iteration']} {p['minutes']:.1f} min {100 * p['success']:.0f}% "
                                         f"{p['tokens']} tok {p['env_steps']} steps" for p in r["curve"]))  # fmt: skip
        best = max(r["curve"], key=lambda p: (p["success"], -p["minutes"]), default=None)
        if best:
            print(f"  {label}: best {100 * best['success']:.0f}% at {best['minutes']:.1f} min, {best['tokens']} tokens")
        print(f"  {label}: learner {r['learner']}")
    equal = results["equal_success"] = tokens_at_equal_success(results["runs"])
    if equal:
        print(f"  at {100 * equal['success']:.0f}% held-out (the lower of the two bests): chain {equal['chain']['tokens']} "
              f"tokens ({equal['chain']['minutes']:.1f} min), tree {equal['tree']['tokens']} tokens "
              f"({equal['tree']['minutes']:.1f} min): the tree's tokens {equal['token_ratio']:.2f} of the chain's")  # fmt: skip
    if not args.skip_learner and "tree" in runs:
        print("learner step on the tree run's largest batch:")
        results["layout"] = shared_vs_unshared(root / f"{args.preset}-tree{args.tag}")
        print(f"  shared / unshared time per logical token: {results['layout']['time_ratio']:.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"trees_{args.preset}{args.tag}"
    write_json(out / f"{name}.json", results)
    plot(results, out / f"{name}.png", args.preset)
    print(f"wrote {out / f'{name}.json'} and {out / f'{name}.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
