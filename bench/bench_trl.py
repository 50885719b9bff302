"""Seconds per RL step: tapeloop's loop vs TRL's GRPOTrainer, same work, same run.

    uv run --with trl python bench/bench_trl.py [--steps 3] [--betas 0,0.04]

TRL is brought in for this benchmark only (`--with trl`), never a project
dependency. Both sides get the embedded preset's work: SmolLM2-135M-Instruct
(fp32, this machine's CPU), 16 arithmetic prompts x 4 completions (one GRPO
group per prompt) per step, the preset's chat prompt (instruction + worked
example), at most 128 new tokens, temperature 0.7, learning rate 1e-5, one
optimizer step per 64 completions, reward +1/0/-1 from agents.rewards, and
KL coefficient (beta) 0 and > 0.
  tapeloop - `python -m orchestrate.rl` (vLLM policy server, tapes, the
             accelerate finetune process; with beta > 0 also the reference
             server), evaluation off; seconds per iteration from its
             metrics.jsonl (start-up of servers and trainer not counted);
  trl      - GRPOTrainer as a user runs it on a machine without a GPU
             (generation with transformers; TRL's vLLM modes need a GPU),
             per_device_train_batch_size 16 x gradient_accumulation_steps 4,
             num_generations 4; seconds per optimizer step from a callback
             (model loading not counted).
The first step of each side is reported but not counted in the median
(warm-up). Prints every step, the median and spread per side and beta, and
last the ratio trl / tapeloop (target >= 2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agents.agent import ChatAgent  # noqa: E402
from agents.env_spec import EnvSpec  # noqa: E402
from agents.rewards import math_reward  # noqa: E402
from orchestrate.loop.command_line import resolve  # noqa: E402
from orchestrate.serving.models import resolve_model  # noqa: E402
from tapes.tape import SamplingParams  # noqa: E402

TASKS, ATTEMPTS, MAX_TOKENS, TEMPERATURE, LR = 16, 4, 128, 0.7, 1e-5


def spread(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    return f"median {statistics.median(xs):.1f} s (min {min(xs):.1f}, max {max(xs):.1f}, n={len(xs)})"


def tapeloop_steps(steps: int, beta: float, workdir: Path) -> list[float]:
    run = workdir / f"tapeloop-beta{beta}"
    cmd = [
        sys.executable,
        "-m",
        "orchestrate.rl",
        "--run-dir",
        str(run),
        "--iterations",
        str(steps),
        "--eval.every",
        "0",
        "--train.kl_coef",
        str(beta),
        "--rollouts.tasks_per_iteration",
        str(TASKS),
        "--rollouts.attempts",
        str(ATTEMPTS),
        "--rollouts.max_tokens",
        str(MAX_TOKENS),
        "--rollouts.temperature",
        str(TEMPERATURE),
        "--train.lr",
        str(LR),
    ]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"tapeloop run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    out = []
    for m in lines:
        if m.get("iteration", 0) >= 1 and "time_total" in m:
            parts = {k.removeprefix("time_"): v for k, v in m.items() if k.startswith("time_") and k != "time_total"}
            print(
                f"  tapeloop beta={beta} iteration {m['iteration']}: {m['time_total']:.1f} s "
                + " ".join(f"{k} {v:.1f}" for k, v in parts.items()),
                flush=True,
            )
            out.append(m["time_total"])
    return out


def trl_steps(steps: int, beta: float, workdir: Path) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    config = resolve("embedded", {})
    agent = ChatAgent(config.agent, SamplingParams(), chat=None)  # only its first prompt is used
    env = EnvSpec(config.env.id, config.env.options, "train", config.run.seed).make()
    rows = []
    for seed in range(TASKS * steps):  # the episode seeds tapeloop's iterations take, in order
        question, info = env.reset(seed)
        rows.append({"prompt": agent.first_messages(question), "answer": info["answer"]})
    data = Dataset.from_list(rows)
    # shuffle_dataset=False and one pass: TRL sees the tasks in the order tapeloop does

    def reward(prompts, completions, answer, **_):
        return [math_reward(c[-1]["content"], a).value for c, a in zip(completions, answer)]

    out: list[float] = []

    class Clock(TrainerCallback):  # on_step_begin/end bracket one optimizer step, generation included
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            out.append(time.perf_counter() - self.start)
            print(f"  trl beta={beta} step {len(out)}: {out[-1]:.1f} s", flush=True)

    args = GRPOConfig(
        output_dir=str(workdir / f"trl-beta{beta}"), use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=TASKS, gradient_accumulation_steps=ATTEMPTS, num_generations=ATTEMPTS,
        max_completion_length=MAX_TOKENS, temperature=TEMPERATURE, learning_rate=LR, beta=beta,
        lr_scheduler_type="constant", max_steps=steps, logging_steps=1, save_strategy="no", report_to="none",
        shuffle_dataset=False, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    model = str(resolve_model("smollm2"))
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, callbacks=[Clock()])
    torch.manual_seed(0)
    trainer.train()
    del trainer
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="steps (iterations) per side and beta")
    parser.add_argument("--betas", default="0,0.04", help="KL coefficients, comma-separated")
    parser.add_argument("--only", choices=["tapeloop", "trl"], help="run one side only")
    args = parser.parse_args()
    try:
        import trl
    except ImportError:
        if args.only != "tapeloop":
            raise SystemExit("TRL is not installed: run `uv run --with trl python bench/bench_trl.py`") from None
    else:
        print(f"trl {trl.__version__}")
    print(f"machine: {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d')}")
    results: dict[tuple[str, float], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        for beta in (float(b) for b in args.betas.split(",")):
            if args.only != "trl":
                results["tapeloop", beta] = tapeloop_steps(args.steps, beta, Path(tmp))
            if args.only != "tapeloop":
                results["trl", beta] = trl_steps(args.steps, beta, Path(tmp))
    print()
    for (side, beta), xs in results.items():
        counted = xs[1:] if len(xs) > 1 else xs
        print(f"{side:9s} beta={beta:<5g} seconds/step {spread(counted)}  (first step {xs[0]:.1f} s)")
    for beta in sorted({b for _, b in results}):
        a, b = results.get(("tapeloop", beta)), results.get(("trl", beta))
        if a and b:
            ta = statistics.median(a[1:] or a)
            tb = statistics.median(b[1:] or b)
            print(f"ratio trl/tapeloop, beta={beta:g}: {tb / ta:.2f}x")


if __name__ == "__main__":
    main()
