"""The critic's cost: seconds and peak memory of one training step, GRPO vs PPO (value head, separate critic).

    uv run python bench/bench_ppo.py [--repeats 2] [--token-budget 1024]

The batch is bench_trainer's, shaped like the embedded preset (16 prompts x 4
attempts, 16..128 completion tokens, the embedded model, fp32 on CPU). Each
configuration runs in its own process (so its peak RSS is its own): it builds
the Learner, trains one warm-up step, then times one step (train_batch over
the whole batch, one epoch, one optimizer step). The configurations
alternate their order over repeats. Prints each one's median seconds per
step and peak RSS, and last the ratios PPO / GRPO in the same run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "grpo": {"algorithm": "grpo"},
    "ppo, value head": {"algorithm": "ppo", "ppo": {"critic": "head"}},
    "ppo, separate critic": {"algorithm": "ppo", "ppo": {"critic": "separate"}},
}


def one(config: dict, token_budget: int) -> dict:
    """In a child process: one warm-up step, then one timed step."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_trainer import preset_batch
    from transformers import AutoTokenizer

    from finetune.config import TrainConfig
    from finetune.learner import Learner
    from orchestrate.serving.models import resolve_model

    model_dir = resolve_model("smollm2")
    samples = preset_batch(AutoTokenizer.from_pretrained(model_dir))
    learner = Learner(model_dir, TrainConfig(lr=1e-6, token_budget=token_budget, **config))
    learner.train_batch(samples, 0)
    start = time.perf_counter()
    learner.train_batch(samples, 1)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "tokens": sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one(json.loads(args.child), args.token_budget)))
        return 0

    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for r in range(args.repeats):
        order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--token-budget",
                    str(args.token_budget),
                    "--child",
                    json.dumps(CONFIGS[name]),
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            m = results[name][-1]
            print(
                f"repeat {r + 1} {name:>21}: {m['seconds']:6.1f} s per step, peak RSS {m['peak_gib']:.2f} GiB",
                flush=True,
            )
    tokens = results["grpo"][0]["tokens"]
    print(f"\none step over a batch of {tokens} tokens (prompt + completion), token budget {args.token_budget}:")
    base = statistics.median(m["seconds"] for m in results["grpo"])
    base_mem = max(m["peak_gib"] for m in results["grpo"])
    for name, ms in results.items():
        sec = statistics.median(m["seconds"] for m in ms)
        mem = max(m["peak_gib"] for m in ms)
        print(
            f"{name:>21}: median {sec:6.1f} s per step ({min(m['seconds'] for m in ms):.1f}-"
            f"{max(m['seconds'] for m in ms):.1f}), peak RSS {mem:.2f} GiB; "
            f"x{sec / base:.2f} the time and x{mem / base_mem:.2f} the memory of grpo"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
