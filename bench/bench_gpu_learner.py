"""The learner on a GPU: step time, tokens/s, MFU, peak memory, and what publishing each version costs.

    PYTHONPATH=. python bench/bench_gpu_learner.py [--budgets 16384,32768] [--state-every 10] [--out DIR]
    PYTHONPATH=. python bench/bench_gpu_learner.py --tiny        # the same path on CPU, in seconds

Self-contained for a GPU machine with torch, transformers and accelerate (and pydantic) but no vLLM and no
model hub: the model is Llama-3.2-1B's shape built from its config (random weights, saved bf16), the batch
is shaped like the gsm8k preset's (16 tasks x 64 attempts = 1024 samples, prompts of 120-220 tokens,
completions of 64-512, KL 0.001 against reference log-probs). The learner is finetune.learner.Learner under
accelerate with bf16 autocast and fp32 master weights, as `accelerate launch --config_file
finetune/accelerate/one_gpu.yaml -m finetune.train` runs it.

Per token budget: one warm-up step, then one timed optimizer step over the whole batch (tokens/s counts
prompt + completion tokens; MFU = 6 x parameters x tokens / seconds / the GPU's dense bf16 peak, 989
TFLOP/s for an H100 or H200), and the peak memory of that step.

Publishing, at the first budget:
- before (every iteration until this change): the whole checkpoint, a Hugging Face folder in bf16 plus
  trainer_state/ (fp32 weights, AdamW state, RNG), written and synced;
- after: per iteration, the weights gathered in the served dtype and packed into checked buckets
  (contract.weight_wire: what the NCCL broadcast sends; the broadcast itself needs a vLLM server on
  another GPU and is not timed here), plus the full state every --state-every iterations (amortized):
  its model folder before the version is published, its trainer state after the version went out;
- the ratio of each to the optimizer step (target: after <= 10%);
- with the trainer state in the background (TrainConfig.async_state, finetune.staging): the copy to host
  memory the learner waits for, then steps trained while a thread writes it, against as many steps with no
  write timed right after; twice (the first copy allocates the page-locked buffers).
With LoRA (--lora-rank, --lora-8b), what a LoRA version publishes instead: its adapter folder and its trainer
state (the adapters and their optimizer state only), written and synced.
Prints a table and writes gpu_learner.json to --out (or $OUT when set).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # provenance.py, also when loaded by its path

from provenance import results_dir, write_json, write_sidecar  # noqa: E402

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16, SXM


# meta-llama/Llama-3.2-1B's and Llama-3.1-8B's config.json (the fields that set the shape)
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64, tie_word_embeddings=True,
               rope_factor=32.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, head_dim=128,
               tie_word_embeddings=False, rope_factor=8.0),
}  # fmt: skip


def llama_config(shape: str):
    from transformers import LlamaConfig

    if shape == "tiny":
        return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                           max_position_embeddings=2048)  # fmt: skip
    fields = dict(SHAPES[shape])
    factor = fields.pop("rope_factor")
    return LlamaConfig(
        vocab_size=128256, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"factor": factor, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        bos_token_id=128000, eos_token_id=128001, **fields,
    )  # fmt: skip


def build_model(folder: Path, config) -> int:
    """Random weights of the config's shape, saved in bf16 (built on the GPU when there is one: fast)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return params


def gsm8k_batch(vocab: int, tasks: int, attempts: int, prompt=(120, 220), completion=(64, 512), seed: int = 0):
    from contract.batch import Sample

    rng = random.Random(seed)
    samples = []
    for t in range(tasks):
        prompt_ids = [rng.randrange(vocab) for _ in range(rng.randint(*prompt))]
        for _ in range(attempts):
            n = rng.randint(*completion)
            behaviour = [-rng.random() * 2 for _ in range(n)]
            samples.append(Sample(
                prompt_ids=prompt_ids, completion_ids=[rng.randrange(vocab) for _ in range(n)],
                behaviour_logprobs=behaviour, ref_logprobs=[b + rng.gauss(0, 0.05) for b in behaviour],
                reward=float(rng.choice([1, 0, -1])), group_id=f"task-{t}", temperature=0.7,
            ))  # fmt: skip
    return samples


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def disk_sync() -> None:
    """What was written reaches the disk (timings of a write include it)."""
    subprocess.run(["sync"], check=False)


def timed(fn):
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def folder_gib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**30


def measure(label: str, model_dir: Path, config, samples, tokens: int, params: int, warmup: bool = True):
    """One learner: (optional) warm-up step, then one timed optimizer step over the whole batch."""
    from accelerate import Accelerator

    from finetune.learner import Learner

    gpu = torch.cuda.is_available()
    acc = Accelerator(mixed_precision="bf16" if gpu else "no")
    learner, load_s = timed(lambda: Learner(model_dir, config, acc))
    first_s = None
    if warmup:
        _, first_s = timed(lambda: learner.train_batch(samples, 1))  # kernels chosen (compiled), allocator settled
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    metrics, step_s = timed(lambda: learner.train_batch(samples, 2))
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if gpu else float("nan")
    peak = next((v for k, v in PEAK_FLOPS.items() if gpu and k in torch.cuda.get_device_name(0)), None)
    mfu = 6 * params * tokens / step_s / peak if peak else float("nan")
    trainable = sum(p.numel() for g in learner.optimizer.param_groups for p in g["params"])
    run = {"run": label, "token_budget": config.token_budget, "lora_rank": config.lora.rank, "warmup": warmup,
           "layout": config.layout, "compile": config.compile, "load_s": round(load_s, 2),
           "first_step_s": first_s and round(first_s, 2), "step_s": round(step_s, 3), "tokens_per_s": round(tokens / step_s),
           "mfu": round(mfu, 4), "peak_gib": round(peak_gib, 2), "trainable": trainable,
           "micro_batches": metrics[-1].get("micro_batches")}  # fmt: skip
    print(f"{label}: step {step_s:.2f} s{'' if warmup else ' (first step, no warm-up)'}, {tokens / step_s:,.0f} "
          f"tokens/s, MFU {mfu:.1%} (6 x all parameters), peak {peak_gib:.1f} GiB, {trainable / 1e6:.1f} M trained, "
          f"{run['micro_batches']} micro-batches" + (f"; first step {first_s:.1f} s" if first_s else ""),
          flush=True)  # fmt: skip
    return learner, acc, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model and batch: the same code path on CPU")
    ap.add_argument("--budgets", default="16384,32768", help="token budgets per micro-batch to time (full fine-tuning)")
    ap.add_argument("--state-every", type=int, default=25, help="full trainer state every this many iterations")
    ap.add_argument("--no-publish", action="store_true", help="skip the publishing measurements")
    ap.add_argument("--lora-rank", type=int, default=0, help="also time LoRA at this rank (first budget)")
    ap.add_argument("--lora-8b", action="store_true", help="also train Llama-3.1-8B's shape with LoRA (one step)")
    ap.add_argument("--only-8b", action="store_true", help="with --lora-8b: skip the 1B runs")
    ap.add_argument("--checkpointing", action="store_true", help="gradient checkpointing in the 8B run")
    ap.add_argument(
        "--layouts",
        default="shared_prefix",
        help="micro-batch layouts to time at the first budget (full fine-tuning): shared_prefix,padded,packed",
    )
    ap.add_argument(
        "--compile",
        default="auto",
        help="TrainConfig.compile of the runs; a list (on,off) also times the others at the first budget",
    )
    ap.add_argument(
        "--profile-tasks",
        type=int,
        default=0,
        help="also profile one step on this many tasks' samples, per layout: where the GPU's time goes",
    )
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(results_dir(__file__)),
        help="folder for gpu_learner.json (default $OUT, else bench/results/bench_gpu_learner)",
    )
    args = ap.parse_args()

    from contract.weight_wire import pack
    from finetune.config import TrainConfig

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    work = Path(tempfile.mkdtemp(prefix="bench_gpu_learner_"))
    cfg = llama_config("tiny" if args.tiny else "1b")
    params = build_model(work / "model", cfg)
    samples = (gsm8k_batch(cfg.vocab_size, 2, 4, (8, 16), (4, 32)) if args.tiny
               else gsm8k_batch(cfg.vocab_size, 16, 64))  # fmt: skip
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    print(
        f"device {gpu}; model {params / 1e9:.3f} B parameters; batch {len(samples)} samples, {tokens} tokens "
        f"({sum(len(s.completion_ids) for s in samples)} completion)",
        flush=True,
    )
    report = {"device": gpu, "parameters": params, "samples": len(samples), "tokens": tokens, "runs": []}
    budgets = [min(int(b), 512) if args.tiny else int(b) for b in args.budgets.split(",")]
    layouts, compiles = args.layouts.split(","), args.compile.split(",")

    def full(budget: int, layout: str, compile: str):
        return (f"full, token budget {budget}, {layout}, compile {compile}",
                TrainConfig(lr=1e-6, kl_coef=0.001, token_budget=budget, layout=layout, compile=compile))  # fmt: skip

    runs = [full(b, layouts[0], compiles[0]) for b in budgets]
    runs += [full(budgets[0], lay, compiles[0]) for lay in layouts[1:]]
    runs += [full(budgets[0], layouts[0], c) for c in compiles[1:]]
    if args.profile_tasks:
        few = samples[: args.profile_tasks * (4 if args.tiny else 64)]
        for lay in layouts:
            config = TrainConfig(lr=1e-6, kl_coef=0.001, token_budget=budgets[0], layout=lay, compile=compiles[0])
            report.setdefault("profiles", []).append(profile_step(f"{lay}_compile_{compiles[0]}", work / "model",
                                                                  config, few, args.out))  # fmt: skip
    if args.lora_rank:
        runs.append((f"LoRA r{args.lora_rank}, token budget {budgets[0]}, compile {compiles[0]}",
                     TrainConfig(lr=1e-5, kl_coef=0.001, token_budget=budgets[0], lora={"rank": args.lora_rank},
                                 compile=compiles[0])))  # fmt: skip
    for i, (label, config) in enumerate([] if args.only_8b else runs):
        try:
            learner, acc, run = measure(label, work / "model", config, samples, tokens, params)
        except Exception as exc:  # noqa: BLE001 - one run failing leaves the others' figures
            print(f"{label}: failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
            report["runs"].append({"run": label, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            continue
        if i == 0 and not args.no_publish:
            run["publish"] = publishing(learner, work, run["step_s"], args.state_every, pack)
            pub = run["publish"]
            pub["background"] = background_state(learner, work, samples, args.state_every, pub["weights_folder_s"],
                                                 pub["gather_s"] + pub["pack_s"])  # fmt: skip
        if config.lora.rank:
            run["publish"] = lora_publishing(learner, work, run["step_s"])
        report["runs"].append(run)
        del learner, acc
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.lora_8b:
        shutil.rmtree(work / "model")
        cfg8 = llama_config("tiny" if args.tiny else "8b")
        params8, build_s = timed(lambda: build_model(work / "model8b", cfg8))
        print(f"8B shape: {params8 / 1e9:.3f} B parameters, built and saved in {build_s:.0f} s", flush=True)
        config = TrainConfig(lr=1e-5, kl_coef=0.001, token_budget=budgets[0], lora={"rank": args.lora_rank or 16},
                             gradient_checkpointing=args.checkpointing, compile=compiles[0])  # fmt: skip
        try:
            learner, acc, run = measure(f"8B shape, LoRA r{config.lora.rank}, frozen bf16"
                                        + (", gradient checkpointing" if args.checkpointing else ""), work / "model8b", config,
                                        samples, tokens, params8, warmup=False)  # fmt: skip
            run["parameters"] = params8
            run["publish"] = lora_publishing(learner, work, run["step_s"])
            report["runs"].append(run)
        except torch.OutOfMemoryError as exc:
            print(f"8B shape with LoRA: out of memory ({str(exc).splitlines()[0]})", flush=True)
            report["runs"].append({"run": "8B LoRA", "error": "out of memory"})

    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_json(Path(args.out) / "gpu_learner.json", report)
    shutil.rmtree(work, ignore_errors=True)


def profile_step(label: str, model_dir: Path, config, samples, out: str | None, top: int = 22) -> dict:
    """One warm step under torch.profiler: the kernels that take the device's time, and how busy it was."""
    from accelerate import Accelerator
    from torch.profiler import ProfilerActivity, profile

    from finetune.learner import Learner

    gpu = torch.cuda.is_available()
    learner = Learner(model_dir, config, Accelerator(mixed_precision="bf16" if gpu else "no"))
    learner.train_batch(samples, 1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        _, wall = timed(functools.partial(learner.train_batch, samples, 2))
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    events = prof.key_averages()
    table = events.table(sort_by=key, row_limit=top, max_name_column_width=70)
    busy = sum(getattr(e, key) for e in events if gpu and e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    line = (f"profile {label}: {len(samples)} samples, {tokens} tokens, step {wall:.2f} s under the profiler, "
            f"device busy {busy:.2f} s ({busy / wall:.0%})")  # fmt: skip
    print(line + "\n" + table, flush=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"profile_{label}.txt").write_text(line + "\n" + table)
        write_sidecar(Path(out) / f"profile_{label}.txt")
    del learner
    if gpu:
        torch.cuda.empty_cache()
    return {"layout": label, "samples": len(samples), "tokens": tokens, "wall_s": round(wall, 3),
            "device_busy_s": round(busy, 3)}  # fmt: skip


def lora_publishing(learner, work: Path, step_s: float) -> dict:
    """A LoRA version: its adapter folder (what the servers load, every iteration) and its trainer state (the
    adapters and their AdamW state, not the frozen base), each gathered, written and synced."""

    def write_adapter():
        learner.save_adapter(work / "adapter", learner.adapter_weights())
        disk_sync()

    def write_state():
        learner.save_trainer_state(work / "lora_state", {"batch": 2})
        disk_sync()

    _, adapter_s = timed(write_adapter)
    _, state_s = timed(write_state)
    out = {"adapter_s": round(adapter_s, 3), "adapter_mib": round(folder_gib(work / "adapter") * 1024, 1),
           "state_s": round(state_s, 3), "state_mib": round(folder_gib(work / "lora_state") * 1024, 1),
           "adapter_of_step": round(adapter_s / step_s, 4)}  # fmt: skip
    print(f"LoRA publishing: adapter {out['adapter_mib']:.1f} MiB in {adapter_s:.2f} s ({adapter_s / step_s:.1%} of "
          f"the step); trainer state {out['state_mib']:.1f} MiB in {state_s:.2f} s", flush=True)  # fmt: skip
    shutil.rmtree(work / "adapter", ignore_errors=True)
    shutil.rmtree(work / "lora_state", ignore_errors=True)
    return out


def background_state(learner, work: Path, samples, state_every: int, folder_s: float, send_s: float) -> dict:
    """The full state as the learner writes it with async_state (finetune.staging): what the learner waits
    for is the copy to host memory; then steps train while a thread writes it, and how much slower they are
    than steps with no write (timed right after, the same number) is the write's cost to training. Twice: the
    first copy allocates the page-locked buffers, later ones reuse them."""
    import threading

    def write_synced(write, finished: list) -> None:
        write()
        disk_sync()
        finished.append(time.perf_counter())

    index, attempts = 10, []
    for attempt in (1, 2):
        folder = work / f"background{attempt}"
        write, taken_s = timed(functools.partial(learner.stage_trainer_state, folder, {"batch": 2}))
        finished: list[float] = []
        thread = threading.Thread(target=write_synced, args=(write, finished))
        start = time.perf_counter()
        thread.start()
        during = []
        while thread.is_alive() or not during:
            index += 1
            during.append(timed(functools.partial(learner.train_batch, samples, index))[1])
        thread.join()
        written_s = finished[0] - start
        plain = []
        for _ in during:
            index += 1
            plain.append(timed(functools.partial(learner.train_batch, samples, index))[1])
        shutil.rmtree(folder)
        slower_s = sum(during) - sum(plain)
        attempts.append({"taken_s": round(taken_s, 3), "written_s": round(written_s, 3), "steps_during": len(during),
                         "step_during_s": round(sum(during) / len(during), 3), "step_plain_s": round(sum(plain) / len(plain), 3),
                         "slower_s": round(slower_s, 3)})  # fmt: skip
        print(f"full state in the background (save {attempt}): taken in {taken_s:.2f} s, written in {written_s:.1f} s "
              f"while {len(during)} steps trained ({sum(during) / len(during):.2f} s each against "
              f"{sum(plain) / len(plain):.2f} s with no write: {slower_s:+.2f} s in all)", flush=True)  # fmt: skip
    last = attempts[-1]
    step_s = last["step_plain_s"]
    # the learner's cost per iteration: gathering and packing the version to send, and once every state_every
    # iterations the copy, the slowdown and the model folder (written before the version is published)
    per_iteration = send_s + (last["taken_s"] + max(last["slower_s"], 0.0) + folder_s) / state_every
    out = {"saves": attempts, "kept_host_gib": round(learner.state.stage.kept_bytes / 2**30, 2),
           "per_iteration_s": round(per_iteration, 3), "of_step": round(per_iteration / step_s, 4)}  # fmt: skip
    print(f"publishing with the full state every {state_every} in the background: gather + pack {send_s:.2f} s + "
          f"(copy {last['taken_s']:.2f} s + slowdown "
          f"{max(last['slower_s'], 0.0):.2f} s + model folder {folder_s:.2f} s) / {state_every} = "
          f"{per_iteration:.2f} s per iteration, {per_iteration / step_s:.1%} of the {step_s:.2f} s step; "
          f"{out['kept_host_gib']:.1f} GiB of page-locked host memory kept", flush=True)  # fmt: skip
    return out


def publishing(learner, work: Path, step_s: float, state_every: int, pack) -> dict:
    before_dir = work / "before"
    _, before_s = timed(lambda: (learner.save_checkpoint(before_dir, {"batch": 2}), disk_sync()))
    before_gib = folder_gib(before_dir)
    shutil.rmtree(before_dir)

    weights, gather_s = timed(learner.policy_weights)
    packed, pack_s = timed(lambda: pack(weights.items(), learner.save_dtype))
    sent_gib = sum(b.numel() for b in packed.buckets) / 2**30
    del packed
    state_dir = work / "state"
    _, state_s = timed(lambda: (learner.save_trainer_state(state_dir, {"batch": 2}), disk_sync()))
    _, folder_s = timed(lambda: (learner.save_weights(state_dir, weights), disk_sync()))
    state_gib = folder_gib(state_dir)
    shutil.rmtree(state_dir)
    weights = None  # noqa: F841 - freed before the next budget
    after_s = gather_s + pack_s + (state_s + folder_s) / state_every
    # what the servers wait for: the trainer state is written after the version went out (finetune.train)
    critical_s = gather_s + pack_s + folder_s / state_every
    out = {"before_s": round(before_s, 3), "before_gib": round(before_gib, 2), "before_of_step": round(before_s / step_s, 4),
           "gather_s": round(gather_s, 3), "pack_s": round(pack_s, 3), "sent_gib": round(sent_gib, 3),
           "full_state_s": round(state_s + folder_s, 3), "trainer_state_s": round(state_s, 3),
           "weights_folder_s": round(folder_s, 3), "full_state_gib": round(state_gib, 2),
           "state_every": state_every, "after_s": round(after_s, 3), "after_of_step": round(after_s / step_s, 4),
           "critical_s": round(critical_s, 3), "critical_of_step": round(critical_s / step_s, 4)}  # fmt: skip
    print(
        f"publishing before: {before_s:.2f} s per iteration ({before_gib:.2f} GiB written), "
        f"{before_s / step_s:.0%} of the step",
        flush=True,
    )
    print(
        f"publishing after: gather {gather_s:.2f} s + pack {pack_s:.2f} s ({sent_gib:.2f} GiB to send) + full "
        f"state {state_s + folder_s:.2f} s / {state_every} = {after_s:.2f} s per iteration, "
        f"{after_s / step_s:.1%} of the step",
        flush=True,
    )
    print(
        f"  of which the servers wait for: gather + pack + model folder {folder_s:.2f} s / {state_every} = "
        f"{critical_s:.2f} s ({critical_s / step_s:.1%}); trainer state {state_s:.2f} s / {state_every} after the "
        "version went out",
        flush=True,
    )
    return out


if __name__ == "__main__":
    main()
