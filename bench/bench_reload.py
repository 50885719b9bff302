"""Weight sync: vLLM `reload_weights` into a running server vs a server restart, same run.

    uv run python bench/bench_reload.py [--repeats 3] [--model smollm2]

Two checkpoint folders of the embedded model (its untied copy, and the same
with every MLP down-projection scaled by 1.01) are swapped in turn:
  reload  - POST /collective_rpc reload_weights + /reset_prefix_cache on the
            running server (what the loop does after each training step),
            timed without the log-prob check the loop also makes;
  restart - stop the server, start it on the other folder, wait for /health
            (what a loop without weight reload would pay).
Prints the seconds of each (median and spread over repeats) and last the
ratio restart / reload (how many times faster the reload is).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from orchestrate.serving.models import resolve_model, untied_copy
from orchestrate.serving.vllm_server import ServerConfig, VLLMServer


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.2f} s (min {min(xs):.2f}, max {max(xs):.2f}, n={len(xs)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()

    base = untied_copy(resolve_model(args.model))
    with tempfile.TemporaryDirectory(prefix="bench-reload-") as tmp:
        other = Path(tmp) / "changed"
        model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("down_proj.weight"):
                    p.mul_(1.01)
        model.save_pretrained(other)
        del model
        for f in base.iterdir():  # tokenizer and chat template
            if f.is_file() and not (other / f.name).exists():
                (other / f.name).write_bytes(f.read_bytes())

        server = VLLMServer(
            base, log_path=Path(tmp) / "server.log", config=ServerConfig(max_model_len=1024, kv_cache_gib=1)
        )
        reload_s, restart_s = [], []
        try:
            t = time.perf_counter()
            server.start()
            print(f"first start: {time.perf_counter() - t:.1f} s")
            before = server.probe_logprobs()
            current = base
            for r in range(args.repeats):
                current = other if current == base else base  # always swap in the folder not being served
                reload_s.append(server.reload_weights(current, verify=False))
                assert server.probe_logprobs() != before, "reload did not change the weights"
                before = server.probe_logprobs()
                current = other if current == base else base
                t = time.perf_counter()
                server.stop()
                server.model = str(current)
                server.start()
                restart_s.append(time.perf_counter() - t)
                assert server.probe_logprobs() != before, "restart did not change the weights"
                before = server.probe_logprobs()
                print(f"repeat {r + 1}: reload {reload_s[-1]:.2f} s, restart {restart_s[-1]:.1f} s", flush=True)
        finally:
            server.stop()
    print(f"reload_weights: {spread(reload_s)}")
    print(f"restart:        {spread(restart_s)}")
    ratios = [b / a for a, b in zip(reload_s, restart_s)]
    print(f"ratio restart/reload: {statistics.median(ratios):.1f}x (pairs {min(ratios):.1f}-{max(ratios):.1f})")


if __name__ == "__main__":
    main()
