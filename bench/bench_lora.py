"""LoRA against full fine-tuning on the embedded preset, the same wall time each: one table, one plot.

    uv run python bench/bench_lora.py --out /tmp/lora [--minutes 30] [--marks 10,20,30] [--lr 1e-4]
        [--arms full,r1,r8,r32] [--eval-every 3] [--report-only]
    uv run python bench/bench_lora.py --out /tmp/lora-sweep --sweep 5e-5,1e-4,2e-4 [--minutes 5]

Each arm is one real run of `orchestrate.rl --preset embedded` (vLLM servers, accelerate-launched trainer),
one after the other, for --minutes of wall time, through bench/compare_algorithms.py's machinery (run
directories OUT/ARM, resumable over several sessions: a later command with more --minutes goes on where the
runs stopped; held-out success at the --marks, OUT/table.md, OUT/lora.png). Every arm adds a KL term
(`--train.kl_coef 0.001`), so that a reference pass runs: full fine-tuning scores it on a reference server,
a LoRA run on its policy server's base model (no reference server). The LoRA arms train adapters of rank 1, 8
and 32 on every projection of the layers, at alpha 32 (so one learning rate serves every rank: "LoRA
Without Regret", Schulman et al. 2025) and --lr (chosen by `--sweep`: rank 8 at each learning rate for
--minutes, ranked by the training reward of the last iterations).

Besides held-out success it reports, per arm, from the runs' own records (metrics.jsonl): iterations per
hour, the mean seconds per iteration of generation, the reference pass, training and the weight update (the
servers reloading the new weights, or loading the new adapter), the size of what a version publishes, and
the peak memory (proportional set size, sampled every 2 s) of the trainer's processes and of the vLLM
servers' (OUT/memory.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import compare_algorithms as ca  # noqa: E402
from proc_tree import children, cmdline, descendants, pss_gib  # noqa: E402
from provenance import write_sidecar  # noqa: E402

from orchestrate.loop.metrics import read_metrics  # noqa: E402

KL = ("--train.kl_coef", "0.001")  # a reference pass in every arm
ALPHA = "32"
RANKS = {"r1": 1, "r8": 8, "r32": 32}
PAPER = "LoRA: arXiv:2106.09685; alpha and learning rate: thinkingmachines.ai/blog/lora (2025)"


def study(lr: float, arms: list[str]) -> ca.Study:
    recipes = {"full": ca.Recipe(KL, "the embedded preset (lr 1e-5), every weight trained")}
    for name, rank in RANKS.items():
        recipes[name] = ca.Recipe((*KL, "--train.lora.rank", str(rank), "--train.lora.alpha", ALPHA,
                                   "--train.lr", f"{lr:g}"), PAPER)  # fmt: skip
    return ca.Study({k: v for k, v in recipes.items() if k in arms}, "lora", "bench/bench_lora.py")


def sweep_study(lrs: list[float]) -> ca.Study:
    recipes = {f"r8_lr{lr:g}": ca.Recipe((*KL, "--train.lora.rank", "8", "--train.lora.alpha", ALPHA,
                                          "--train.lr", f"{lr:g}"), PAPER) for lr in lrs}  # fmt: skip
    return ca.Study(recipes, "lora_sweep", "bench/bench_lora.py --sweep")


# -- memory of each arm's processes ----------------------------------------------------------------------------


class MemorySampler(threading.Thread):
    """Every 2 s: the PSS of the trainer's and the servers' process trees under each orchestrate.rl this
    process runs, by arm (its --run-dir's name); the peak of each is kept in OUT/memory.json."""

    def __init__(self, out: Path):
        super().__init__(daemon=True)
        self.out, self.stop = out, threading.Event()
        write_sidecar(out / "memory.json")  # the command whose arms these peaks are
        try:
            self.peaks = json.loads((out / "memory.json").read_text())
        except (OSError, ValueError):
            self.peaks = {}

    def run(self) -> None:
        while not self.stop.wait(2.0):
            tree = children()
            for pid in descendants(os.getpid(), tree):
                cmd = cmdline(pid)
                if "orchestrate.rl" not in cmd or "--run-dir" not in cmd:
                    continue
                arm = Path(cmd.split("--run-dir", 1)[1].split()[0]).name
                sums = {"trainer_gib": 0.0, "servers_gib": 0.0}
                for child in tree.get(pid, []):
                    kind = "trainer_gib" if "finetune" in cmdline(child) or "accelerate" in cmdline(child) else (
                        "servers_gib" if "vllm" in cmdline(child) else None)  # fmt: skip
                    if kind:
                        sums[kind] += sum(pss_gib(p) for p in descendants(child, tree))
                peak = self.peaks.setdefault(arm, {"trainer_gib": 0.0, "servers_gib": 0.0})
                for kind, value in sums.items():
                    peak[kind] = round(max(peak[kind], value), 2)
            (self.out / "memory.json").write_text(json.dumps(self.peaks, indent=1) + "\n")


# -- the second table: where an iteration's time goes ----------------------------------------------------------


def folder_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20 if path.is_dir() else 0.0


def published_mib(run_dir: Path) -> float | None:
    """What one version publishes for the servers: the adapter folder, or the model folder."""
    for ck in sorted((run_dir / "checkpoints").glob("[0-9]*"), reverse=True):
        if (ck / "adapter").is_dir():
            return folder_mib(ck / "adapter")
        if (ck / "config.json").is_file():
            return sum(f.stat().st_size for f in ck.iterdir() if f.is_file()) / 2**20
    return None


def costs(out: Path, arms: list[str], last_minute: float) -> str:
    try:
        memory = json.loads((out / "memory.json").read_text())
    except (OSError, ValueError):
        memory = {}
    head = ["arm", "iterations / hour", "generate s", "reference s", "train s", "weight update s", "published MiB",
            "trainer peak GiB", "servers peak GiB"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in arms:
        records = [r for m, r in ca.timeline(read_metrics(out / arm / "metrics.jsonl")) if m <= last_minute]
        its = [r for r in records if r.get("iteration", 0) > 0 and "time_total" in r]
        if not its:
            continue
        hours = sum(r["time_total"] for r in its) / 3600

        def mean(key, its=its):
            return f"{statistics.fmean(r.get(key, 0.0) for r in its):.2f}"

        mib = published_mib(out / arm)
        mem = memory.get(arm, {})
        cells = [arm, f"{len(its) / hours:.0f}", mean("time_generate"), mean("time_reference"), mean("time_train"),
                 mean("time_weight_sync"), f"{mib:.1f}" if mib is not None else "?",
                 f"{mem.get('trainer_gib', 0):.2f}", f"{mem.get('servers_gib', 0):.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_lora.py", add_help=False, usage=argparse.SUPPRESS,
                                     description="LoRA against full fine-tuning; the options of this script:")  # fmt: skip
    parser.add_argument("--lr", type=float, default=1e-4, help="the LoRA arms' learning rate (default 1e-4)")
    parser.add_argument("--arms", default=",".join(["full", *RANKS]),
                        help=f"comma-separated, of: full, {', '.join(RANKS)} (default: all)")  # fmt: skip
    parser.add_argument("--sweep", default=None, help="comma-separated learning rates: rank 8 at each, ranked")
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if "-h" in rest or "--help" in rest:
        print(parser.format_help() + "\nand those of bench/compare_algorithms.py, which runs the arms:\n")
    try:
        if not 0 < ours.lr < 1:
            raise ca.Refused(f"--lr: a learning rate in (0, 1), got {ours.lr:g}")
        arms = [a.strip() for a in ours.arms.split(",") if a.strip()]
        if unknown := [a for a in arms if a not in ("full", *RANKS)]:
            raise ca.Refused(f"--arms: unknown {', '.join(unknown)} (known: full, {', '.join(RANKS)})")
        lrs = [float(x) for x in ours.sweep.split(",")] if ours.sweep else []
        if ours.sweep and (not lrs or not all(0 < x < 1 for x in lrs)):
            raise ca.Refused(f"--sweep: comma-separated learning rates in (0, 1), got {ours.sweep!r}")
    except ValueError:
        print(f"error: --sweep: comma-separated learning rates, got {ours.sweep!r}", file=sys.stderr)
        return 2
    except ca.Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    chosen = sweep_study(lrs) if lrs else study(ours.lr, arms)
    out = Path(rest[rest.index("--out") + 1]) if "--out" in rest else None
    sampler = None
    if out is not None and "--report-only" not in rest:
        out.mkdir(parents=True, exist_ok=True)
        sampler = MemorySampler(out)
        sampler.start()
    try:
        code = ca.main(rest, chosen)
    finally:
        if sampler is not None:
            sampler.stop.set()
            sampler.join()
    if code == 2 or out is None:
        return code
    marks = ca.parse_args(rest, chosen).marks
    text = costs(out, list(chosen.recipes), marks[-1])
    if lrs:  # the sweep's ranking: mean training reward of the last 3 iterations
        ranked = []
        for name in chosen.recipes:
            its = [r for r in read_metrics(out / name / "metrics.jsonl") if r.get("iteration", 0) > 0]
            if its:
                ranked.append((statistics.fmean(r.get("reward_mean", 0.0) for r in its[-3:]), name))
        text += "\n\nmean training reward, last 3 iterations: " + ", ".join(
            f"{n} {r:+.3f}" for r, n in sorted(ranked, reverse=True)
        )
    print("\n" + text)
    (out / "costs.md").write_text(text + "\n")
    write_sidecar(out / "costs.md")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
