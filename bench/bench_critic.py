"""Does the PPO critic learn? Replays a run's batches through the critic alone and prints, for each batch, the
critic's explained variance of its returns before it trains on that batch (the figure the loop logs as
train_explained_variance), for one or more critic settings side by side.

    uv run python bench/bench_critic.py RUN_DIR --set "critic_lr=1e-5" --set "critic_lr=1e-4,critic_steps=4"

RUN_DIR is any run directory with batches/ (a PPO run's, or a GRPO run's: the samples are the same; only the
policy that made them differs). Each setting builds the learner the trainer builds (finetune.learner.Learner,
the run's train_config.json with the setting's ppo options, the separate critic initialised from the model),
then for each batch in order: explained variance, value mean and return mean of the critic's values as the
batch arrives (Learner.critic_batch), then `critic_steps` optimizer steps of the critic alone on the batch
(Learner.critic_step; 1 stands for the critic's share of the loop's one PPO step per batch). The policy is
not trained: the batches are fixed, so its updates could not change what the critic sees.

Setting keys: critic_lr, value_clip, critic_steps (default 1), head_init (zero, the learner's, or normal:
N(0, 1/sqrt(hidden)) weights, a bias of 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KEYS = {"critic_lr": float, "value_clip": float, "critic_steps": int, "head_init": str}


def parse_setting(text: str) -> dict:
    setting = {"critic_steps": 1, "head_init": "zero"}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in KEYS or not value:
            raise ValueError(f"--set {text!r}: {part!r} is not KEY=VALUE with KEY one of {', '.join(KEYS)}")
        setting[key] = KEYS[key](value)
    if setting["head_init"] not in ("zero", "normal") or setting["critic_steps"] < 1:
        raise ValueError(f"--set {text!r}: head_init is zero or normal, critic_steps >= 1")
    return setting


def replay(run: Path, setting: dict, batches: list[Path], threads: int) -> list[dict]:
    import torch

    from contract.batch import read_batch
    from finetune.config import TrainConfig
    from finetune.learner import Learner
    from orchestrate.serving.models import resolve_model

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    values = json.loads((run / "train_config.json").read_text())
    values["algorithm"] = "ppo"
    values.setdefault("ppo", {})
    values["ppo"].update({k: setting[k] for k in ("critic_lr", "value_clip") if k in setting}, critic="separate")
    config = TrainConfig.model_validate(values)
    model = resolve_model(json.loads((run / "config.json").read_text())["model"]["policy"])
    learner = Learner(model, config)
    if setting["head_init"] == "normal":
        head = learner.accelerator.unwrap_model(learner.value_model).value_head
        torch.nn.init.normal_(head.weight, std=head.in_features**-0.5)
    rows = []
    for path in batches:
        samples = read_batch(path)
        critic = learner.critic_batch(samples)
        stats = critic.stats
        t0 = time.perf_counter()
        losses = [learner.critic_step(samples, critic)["value_loss"] for _ in range(setting["critic_steps"])]
        rows.append({**stats, "value_loss": losses[0], "seconds": time.perf_counter() - t0})
        ev = stats["explained_variance"]
        print(
            f"  batch {path.stem}: explained variance {'-' if ev is None else f'{ev:+.3f}'}  value mean "
            f"{stats['value_mean']:.3f}  return mean {stats['returns_mean']:.3f}  value loss {losses[0]:.4f} -> "
            f"{losses[-1]:.4f}  ({rows[-1]['seconds']:.0f} s)",
            flush=True,
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run directory with batches/ and train_config.json")
    parser.add_argument("--set", action="append", dest="settings", default=[], help="KEY=VALUE,... (repeatable)")
    parser.add_argument("--batches", type=int, default=10, help="the first N batches (default 10)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    run = Path(args.run)
    for name in ("train_config.json", "config.json", "batches"):
        if not (run / name).exists():
            parser.error(f"{run}: no {name} (not a run directory with batches)")
    try:
        settings = [parse_setting(s) for s in args.settings or [""]]
    except ValueError as exc:
        parser.error(str(exc))
    if args.batches < 2:
        parser.error("--batches: at least 2")
    from contract.batch import list_batches

    batches = [path for _, path in sorted(list_batches(run / "batches").items())][: args.batches]
    if len(batches) < 2:
        parser.error(f"{run}/batches: {len(batches)} batch files, 2 needed")
    summary = []
    for setting in settings:
        print(f"{setting}:", flush=True)
        rows = replay(run, setting, batches, args.threads)
        evs = [r["explained_variance"] for r in rows if r["explained_variance"] is not None]
        summary.append((setting, evs, statistics.median(r["seconds"] for r in rows)))
    print("\nsetting | explained variance, batch by batch | last 3 (mean) | critic s/batch")
    for setting, evs, seconds in summary:
        last = statistics.mean(evs[-3:]) if evs else float("nan")
        print(f"{setting} | {' '.join(f'{e:+.2f}' for e in evs)} | {last:+.3f} | {seconds:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
