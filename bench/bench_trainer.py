"""Trainer throughput: finetune's GRPO step vs a plain transformers loop, same tokens, same run.

    uv run python bench/bench_trainer.py [--repeats 3] [--token-budget 1024] [--layouts padded,packed]

One batch shaped like the embedded preset: 16 prompts x 4 attempts = 64
completions of 16..128 tokens (varied, seeded) after the preset's chat prompt
(instruction, one worked example, the question), temperature 0.7, the
embedded model (SmolLM2-135M-Instruct, fp32 on CPU). Each repeat times, in
alternating order, one optimizer step over the whole batch:
  finetune - Learner.train_batch: length-sorted micro-batches by token budget,
             log-probs at completion positions only, GRPO loss, AdamW step;
  plain    - the textbook loop: the same number of micro-batches in batch
             order, each padded to its longest row with an attention mask,
             model(input_ids).logits / T -> log_softmax -> gather at the
             completion tokens -> loss.backward(), then clip and AdamW step.
Both train the same model and optimizer (one copy in memory). finetune's
default layout, shared_prefix, computes each group's prompt once for its 4
completions; padded is timed too. Prints tokens/s (the batch's prompt +
completion tokens per sample, whatever a side computes, padding not counted)
of each, the median and
spread over repeats, tokens per CPU-second (steadier when other jobs share
the machine), the peak memory, and last the ratio finetune/plain (target
>= 0.9).
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time

import torch
from transformers import AutoTokenizer

from contract.batch import Sample
from finetune.config import TrainConfig
from finetune.learner import Learner
from finetune.microbatch import micro_batches
from orchestrate.serving.models import resolve_model

INSTRUCTION = "Put the final answer in \\boxed{}."
EXAMPLE = ("What is 31 + 46?", "31 + 46 = 77. The answer is \\boxed{77}.")


def preset_batch(tokenizer, seed: int = 0, prompts: int = 16, attempts: int = 4, max_tokens: int = 128) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for p in range(prompts):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        messages = [
            {"role": "user", "content": f"{EXAMPLE[0]} {INSTRUCTION}"},
            {"role": "assistant", "content": EXAMPLE[1]},
            {"role": "user", "content": f"What is {a} + {b}? {INSTRUCTION}"},
        ]
        prompt = list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        for _k in range(attempts):
            n = rng.randint(16, max_tokens)
            completion = [rng.randrange(1000, 40000) for _ in range(n)]
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    completion_ids=completion,
                    behaviour_logprobs=[-2.0] * n,
                    reward=float(rng.random() < 0.4),
                    group_id=p,
                    temperature=0.7,
                )
            )
    return samples


def plain_step(lm, optimizer, samples: list[Sample], n_micro: int, pad_id: int) -> None:
    """The loop most people write first, over the same samples."""
    n_completion = sum(len(s.completion_ids) for s in samples)
    adv = torch.tensor([s.reward - 0.4 for s in samples])
    for part in torch.tensor_split(torch.arange(len(samples)), n_micro):
        rows = [samples[i] for i in part.tolist()]
        width = max(len(s.prompt_ids) + len(s.completion_ids) for s in rows)
        ids = torch.full((len(rows), width), pad_id)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width - 1))
        for r, s in enumerate(rows):
            seq = s.prompt_ids + s.completion_ids
            ids[r, : len(seq)] = torch.tensor(seq)
            attention[r, : len(seq)] = 1
            mask[r, len(s.prompt_ids) - 1 : len(seq) - 1] = 1
        logits = lm(input_ids=ids, attention_mask=attention).logits[:, :-1] / 0.7
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * mask * adv[part][:, None]).sum() / n_completion
        loss.backward()
    torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB -> GiB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    # 1024 rather than the default 2048: the plain loop, padded and with full logits, peaks at
    # ~10 GiB with 2048-token micro-batches; at 1024 both stay under ~6.5 GiB.
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument(
        "--layouts",
        default="shared_prefix,padded",
        help="comma-separated finetune layouts to time; the first one is compared with plain",
    )
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: torch's choice). On a shared "
        "machine fewer threads than cores avoid the slowdown of descheduled OpenMP threads",
    )
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = preset_batch(tokenizer)
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    completion = sum(len(s.completion_ids) for s in samples)
    print(
        f"batch: {len(samples)} samples, {tokens} tokens ({completion} completion), "
        f"prompt {len(samples[0].prompt_ids)} tokens, torch threads {torch.get_num_threads()}"
    )

    layouts = args.layouts.split(",")
    learner = Learner(
        model_dir,
        TrainConfig(
            lr=1e-6,
            token_budget=args.token_budget,
            layout=layouts[0],
            gradient_checkpointing=args.gradient_checkpointing,
        ),
    )
    lm = learner.accelerator.unwrap_model(learner.model).lm
    optimizer = learner.optimizer.optimizer  # the bare torch AdamW under accelerate's wrapper
    print(f"memory before any step: {peak_gb():.2f} GiB peak RSS")

    def run_finetune(layout: str) -> int:
        learner.config.layout = layout
        (m,) = learner.train_batch(samples)
        return m["micro_batches"]

    def timed(fn, *a) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process): CPU time is less disturbed by other jobs."""
        wall, cpu = time.perf_counter(), time.process_time()
        fn(*a)
        return time.perf_counter() - wall, time.process_time() - cpu

    # Warm-up (first-call allocations), and the trainer's peak before the plain loop ever runs.
    n_first = run_finetune(layouts[0])
    print(
        f"finetune step peak RSS: {peak_gb():.2f} GiB ({n_first} micro-batches of {layouts[0]} at token budget "
        f"{args.token_budget})"
    )
    # The plain loop gets as many micro-batches as padded rows need at this budget (the same memory).
    n_micro = len(
        micro_batches([s.prompt_ids for s in samples], [s.completion_ids for s in samples], args.token_budget, "padded")
    )
    for layout in layouts[1:]:
        run_finetune(layout)
    lm.train()
    plain_step(lm, optimizer, samples, n_micro, learner.pad_id)
    print(f"peak RSS after the plain loop too: {peak_gb():.2f} GiB")

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in [*layouts, "plain"]}
    for r in range(args.repeats):
        order = [*layouts, "plain"] if r % 2 == 0 else ["plain", *layouts]
        for name in order:
            if name == "plain":
                times[name].append(timed(plain_step, lm, optimizer, samples, n_micro, learner.pad_id))
            else:
                times[name].append(timed(run_finetune, name))
        print(
            f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1][0]:.1f} s (cpu {v[-1][1]:.1f} s)" for k, v in times.items()),
            flush=True,
        )

    medians = {}
    for name, values in times.items():
        wall = [tokens / w for w, _ in values]
        cpu = [tokens / c for _, c in values]
        medians[name] = statistics.median(wall), statistics.median(cpu)
        label = f"finetune ({name})" if name != "plain" else "plain transformers"
        print(
            f"{label:>22}: {medians[name][0]:7.1f} tokens/s (min {min(wall):.1f}, max {max(wall):.1f}); "
            f"{medians[name][1]:.1f} tokens per CPU-second"
        )
    # Each repeat times both sides back to back: the ratio within a repeat is the figure other jobs disturb least.
    pairs = [p[0] / f[0] for f, p in zip(times[layouts[0]], times["plain"])]
    cpu_pairs = [p[1] / f[1] for f, p in zip(times[layouts[0]], times["plain"])]
    print(
        f"ratio finetune ({layouts[0]}) / plain, median of {len(pairs)} paired repeats: "
        f"{statistics.median(pairs):.2f} wall clock (pairs {min(pairs):.2f}-{max(pairs):.2f}), "
        f"{statistics.median(cpu_pairs):.2f} CPU time (pairs {min(cpu_pairs):.2f}-{max(cpu_pairs):.2f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
