"""The learner on CPU in bf16 autocast against fp32, on the same batch in one run.

    uv run python bench/bench_bf16.py [--model smollm2|qwen-coder-0.5b] [--repeats 3] [--lora-rank 0] [--prompts 16]

One learner (fp32 master weights, as on GPUs) and the embedded preset's batch shape (bench_trainer.py's: 64
completions of 16..128 tokens after the preset's prompt). Each repeat times, in alternating order, one
optimizer step (Learner.train_batch, GRPO, lr 1e-7 so the model barely moves) with the learner's forward and
backward under `torch.autocast("cpu", dtype=torch.bfloat16)` and without (fp32). Before that, on the same
weights, it compares the two:
  - the loss and its gradient (a policy-gradient loss over the batch's completion tokens): the losses'
    difference, the gradients' cosine and relative difference |g_bf16 - g_fp32| / |g_fp32|;
  - the log-probs of the completion tokens against fp32's, which is what vLLM on CPU samples with (float32):
    the importance ratio the loss sees at the first epoch is exp(learner - sampler), so |ratio - 1| is how far
    bf16 alone moves it (mean, 99th percentile and max), and the share of tokens past PPO's clip of 0.2.
Prints whether the processor has bf16 instructions (avx512_bf16 or amx_bf16; `contract.processor.cpu_bf16`):
without them torch emulates bf16 (measured on an AVX2-only EPYC: 26x slower than fp32), so there a smaller batch
(`--prompts 1`: 4 completions) keeps the run to minutes; the agreement figures hold either way (the same
bf16 rounding of each matmul's inputs, accumulated in fp32). Writes bench/results/bench_bf16/TAG.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # provenance, when run as a script
from bench_trainer import peak_gb, preset_batch  # noqa: E402
from provenance import results_dir, write_json  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from contract.processor import cpu_bf16  # noqa: E402
from finetune.config import LoraOptions, TrainConfig  # noqa: E402
from finetune.learner import Learner  # noqa: E402
from orchestrate.serving.models import resolve_model  # noqa: E402


def bf16(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else nullcontext()


def loss_and_grads(learner: Learner, samples, autocast: bool) -> tuple[float, torch.Tensor]:
    """-sum(advantage x log-prob) / tokens over the batch and its gradient, flattened (fp32 either way)."""
    passes, model = learner.passes, learner.model
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    mean = statistics.fmean(s.reward for s in samples)
    n = sum(len(s.completion_ids) for s in samples)
    total = 0.0
    for mb in passes.micro_batches(samples):
        inv_temp = torch.tensor([1.0 / samples[i].temperature for i in mb.indices for _ in range(samples[i].n_trained)])
        adv = torch.tensor([samples[i].reward - mean for i in mb.indices for _ in range(samples[i].n_trained)])
        with bf16(autocast):
            logp = passes.policy(mb, inv_temp, False).logp
        loss = -(logp.float() * adv).sum() / n
        loss.backward()
        total += float(loss.detach())
    grads = torch.cat([p.grad.flatten() for p in params])
    for p in params:
        p.grad = None
    return total, grads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a model name (smollm2, qwen-coder-0.5b) or folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16, help="the batch's prompts (4 completions each)")
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: full)")
    parser.add_argument("--tag", default=None, help="the result file's name (default: the model's)")
    args = parser.parse_args()
    if min(args.repeats, args.token_budget, args.prompts) < 1 or args.lora_rank < 0:
        parser.error("--repeats, --prompts and --token-budget must be at least 1, --lora-rank 0 or more")

    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = preset_batch(tokenizer, prompts=args.prompts)
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    has = cpu_bf16()
    print(f"model {args.model}; batch: {len(samples)} samples, {tokens} tokens; torch threads "
          f"{torch.get_num_threads()}; processor bf16 instructions: {has or 'none (torch emulates bf16)'}")  # fmt: skip
    config = TrainConfig(lr=1e-7, token_budget=args.token_budget, dtype="float32",
                         lora=LoraOptions(rank=args.lora_rank))  # fmt: skip
    learner = Learner(model_dir, config)  # fp32 weights; autocast around its passes gives the bf16 side

    fp32_loss, fp32_grads = loss_and_grads(learner, samples, False)
    bf16_loss, bf16_grads = loss_and_grads(learner, samples, True)
    a, b = fp32_grads.double(), bf16_grads.double()  # float32 sums over 1e8+ entries drift past a cosine of 1
    cosine = float(a @ b / (a.norm() * b.norm()))
    rel = float((b - a).norm() / a.norm())
    del a, b
    del fp32_grads, bf16_grads
    sampler = torch.cat(learner.logprobs(samples))
    with bf16(True):
        learned = torch.cat(learner.logprobs(samples))
    ratio_err = (learned - sampler).exp().sub(1).abs()
    agreement = {"loss_fp32": fp32_loss, "loss_bf16": bf16_loss, "loss_abs_diff": abs(bf16_loss - fp32_loss),
                 "grad_cosine": cosine, "grad_rel_diff": rel,
                 "logprob_abs_diff_mean": float((learned - sampler).abs().mean()),
                 "ratio_err_mean": float(ratio_err.mean()), "ratio_err_p99": float(ratio_err.quantile(0.99)),
                 "ratio_err_max": float(ratio_err.max()), "past_clip_0.2": float((ratio_err > 0.2).float().mean())}  # fmt: skip
    print(f"loss fp32 {fp32_loss:.6f}, bf16 {bf16_loss:.6f} (|diff| {agreement['loss_abs_diff']:.2e}); gradient "
          f"cosine {cosine:.5f}, relative difference {rel:.4f}")  # fmt: skip
    print(f"log-probs bf16 learner vs fp32 sampler: mean |diff| {agreement['logprob_abs_diff_mean']:.4f}; "
          f"|ratio - 1| mean {agreement['ratio_err_mean']:.4f}, p99 {agreement['ratio_err_p99']:.4f}, max "
          f"{agreement['ratio_err_max']:.4f}; tokens past a 0.2 clip {100 * agreement['past_clip_0.2']:.2f}%")  # fmt: skip

    def step(autocast: bool) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        with bf16(autocast):
            learner.train_batch(samples)
        return time.perf_counter() - wall, time.process_time() - cpu

    step(False), step(True)  # warm-up: first-call allocations, oneDNN's bf16 kernels
    times: dict[str, list[tuple[float, float]]] = {"fp32": [], "bf16": []}
    for r in range(args.repeats):
        for name in ("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32"):
            times[name].append(step(name == "bf16"))
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1][0]:.1f} s" for k, v in times.items()), flush=True)
    speed = {k: statistics.median(tokens / w for w, _ in v) for k, v in times.items()}
    ratios = [f / b for (f, _), (b, _) in zip(times["fp32"], times["bf16"])]
    print(f"learner step: fp32 {speed['fp32']:.1f} tokens/s, bf16 autocast {speed['bf16']:.1f} tokens/s; "
          f"speed-up bf16/fp32 median {statistics.median(ratios):.2f}x (repeats: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}); peak RSS {peak_gb():.2f} GiB")  # fmt: skip
    result = {"model": args.model, "lora_rank": args.lora_rank, "samples": len(samples), "tokens": tokens, "cpu_bf16": has,
              "torch_threads": torch.get_num_threads(), "agreement": agreement, "tokens_per_s": speed,
              "seconds": times, "speedup": statistics.median(ratios), "peak_rss_gib": peak_gb()}  # fmt: skip
    path = write_json(results_dir(__file__) / f"{args.tag or Path(args.model).name}.json", result)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
