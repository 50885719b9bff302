"""Trainer work for multi-turn episodes: one row per episode vs one sample per LLM call.

    uv run python bench/bench_episode_tokens.py RUN_DIR [--iteration 1] [--time]

Reads an iteration's tapes from a run directory (e.g. a `--preset game` run),
builds the training batch twice, from the same calls:
  episode  - what the loop writes: one sample per episode (first prompt, then
             outputs and the environment's tokens, the latter masked);
  per-call - one sample per LLM call (its whole prompt again each turn), as a
             trainer without episodes would;
and prints the tokens the trainer computes for each (token slots of the
micro-batches, padding included, in the run's layout) and their ratio. With
--time it also runs one optimizer step of the real learner on each (the
run's model and train config; the per-call batch gives each call its turn's
reward) and prints seconds and their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from contract.batch import Sample  # noqa: E402
from finetune.microbatch import micro_batches  # noqa: E402
from orchestrate.loop.samples import tapes_to_samples  # noqa: E402
from tapes.store import read_tapes  # noqa: E402


def per_call_samples(tapes) -> list[dict]:
    out = []
    for tape in tapes:
        if tape.metadata.error:
            continue
        rewards = {s.turn: s.reward for s in tape.steps if getattr(s, "kind", "") == "env_observation" and s.turn}
        for call in tape.llm_calls:
            out.append({"prompt_ids": call.prompt_token_ids, "completion_ids": call.output_token_ids,
                        "behaviour_logprobs": call.logprobs, "reward": rewards.get(call.turn) or 0.0,
                        "group_id": tape.metadata.group_id, "temperature": call.sampling.temperature,
                        "turns": [{"index": call.turn - 1, "start": 0, "length": len(call.output_token_ids),
                                   "reward": rewards.get(call.turn) or 0.0}],
                        "episode_id": tape.metadata.id})  # fmt: skip
    return out


def slots(samples: list[Sample], budget: int, layout: str) -> tuple[int, int]:
    mbs = micro_batches(
        [s.prompt_ids for s in samples],
        [s.completion_ids for s in samples],
        budget,
        layout,
        trained=[s.trained_positions() for s in samples],
    )
    return sum(mb.n_tokens for mb in mbs), sum(mb.n_slots for mb in mbs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--iteration", type=int, default=1)
    parser.add_argument("--time", action="store_true", help="also time one learner step on each batch")
    args = parser.parse_args()
    path = args.run_dir / "tapes" / f"iter_{args.iteration:06d}.jsonl"
    if not path.is_file():
        parser.exit(2, f"error: {path} does not exist (a run directory and one of its iterations)\n")
    config = json.loads((args.run_dir / "config.json").read_text())
    train = config["train"]
    tapes = list(read_tapes(path))
    episode = [Sample.model_validate(s) for s in tapes_to_samples(tapes, require_ref=False)]
    per_call = [Sample.model_validate(s) for s in per_call_samples(tapes)]
    turns = sum(len(s.all_turns) for s in episode) / len(episode)
    print(f"{path}: {len(tapes)} episodes, {len(per_call)} LLM calls ({turns:.2f} turns per episode)")
    results = {}
    for name, batch in (("episode", episode), ("per-call", per_call)):
        tokens, total = slots(batch, train["token_budget"], train["layout"])
        results[name] = total
        print(
            f"{name:8s}: {len(batch):4d} samples, {tokens:7d} tokens, {total:7d} slots ({train['layout']}, "
            f"budget {train['token_budget']})"
        )
    print(f"tokens computed, per-call / episode: {results['per-call'] / results['episode']:.2f}x")
    if args.time:
        from finetune.config import TrainConfig
        from finetune.learner import Learner
        from orchestrate.serving.models import resolve_model

        cfg = TrainConfig.model_validate({k: v for k, v in train.items() if k in TrainConfig.model_fields})
        learner = Learner(resolve_model(config["model"]["policy"]), cfg)
        seconds = {}
        for name, batch in (("episode", episode), ("per-call", per_call), ("episode", episode)):
            start = time.perf_counter()
            learner.train_batch(batch, 0)
            seconds[name] = time.perf_counter() - start  # the second episode pass counts (warm)
            print(f"{name:8s}: one optimizer step {seconds[name]:.1f} s", flush=True)
        print(f"trainer seconds, per-call / episode: {seconds['per-call'] / seconds['episode']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
