"""What staging a version in host memory costs a server on a GPU, against staging it on the GPU.

    python3 bench/bench_staging_gpu.py [--gib 2.5] [--repeats 3]    # a GPU machine: torch only
    python3 bench/bench_staging_gpu.py --gib 0.25 --device cpu        # the same code path on CPU

With NCCL a server stages a version on its GPU while it has room for it (contract.weight_wire.
staging_device), else in page-locked host memory: each bucket then arrives in one buffer on the GPU, its
checksum is taken there, and it is copied out; loading copies each weight back to the GPU. This times
those steps for a version of --gib GiB (2.5: a 1B model in bf16; 16: 8B) in the buckets the learner packs
(contract.weight_wire.BUCKET_BYTES), with the broadcast itself left out (it is the same either way):
  on the GPU  - checksum each bucket; load = one copy on the GPU per bucket;
  via host    - checksum each bucket on the GPU, copy it to its host bucket; load = one copy from host to
                GPU per bucket.
Prints each path's seconds per version (medians) and the difference, the cost of staging in host memory.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the project's root on the path
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contract.weight_wire import BUCKET_BYTES, checksum, new_buffer  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.5, help="version size in GiB (2.5: 1B in bf16; 16: 8B)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.gib <= 0 or args.repeats < 1:
        ap.error("--gib and --repeats must be positive")
    device = torch.device(args.device)
    total = int(args.gib * 2**30)
    sizes = [BUCKET_BYTES] * (total // BUCKET_BYTES) + ([total % BUCKET_BYTES] if total % BUCKET_BYTES else [])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; version {total / 2**30:.2f} GiB in {len(sizes)} buckets of up to {BUCKET_BYTES >> 20} MiB")

    on_gpu = [torch.randint(0, 256, (n,), dtype=torch.uint8, device=device) for n in sizes]  # as received
    params = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]  # the model's weights
    bounce = torch.empty(max(sizes), dtype=torch.uint8, device=device)
    start = time.perf_counter()
    host = [new_buffer(n, "cpu") for n in sizes]  # page-locked where CUDA is; kept between versions
    pinned_s = time.perf_counter() - start

    def staged_on_gpu() -> float:
        sync(device)
        start = time.perf_counter()
        sums = [checksum(b) for b in on_gpu]
        for p, b in zip(params, on_gpu):
            p.copy_(b)
        sync(device)
        assert len(sums) == len(sizes)
        return time.perf_counter() - start

    def staged_in_host() -> float:
        sync(device)
        start = time.perf_counter()
        for h, b in zip(host, on_gpu):
            view = bounce[: b.numel()]
            view.copy_(b)  # stands for the broadcast into the one buffer on the GPU
            checksum(view)
            h.copy_(view)
        for p, h in zip(params, host):
            p.copy_(h)
        sync(device)
        return time.perf_counter() - start

    staged_in_host()  # first touch of every buffer
    gpu, via_host = [], []
    for _ in range(args.repeats):
        gpu.append(staged_on_gpu())
        via_host.append(staged_in_host())
    for p, b in zip(params, on_gpu):
        assert torch.equal(p, b)
    a, b = statistics.median(gpu), statistics.median(via_host)
    print(f"host buffers allocated (once per server): {pinned_s:.2f} s")
    print(f"staged on the GPU: checksums + load {a:.3f} s per version (n={args.repeats})")
    print(f"staged in host memory: checksums + copies out + load from host {b:.3f} s per version")
    print(f"cost of staging in host memory: {b - a:.3f} s per version ({total / 2**30:.2f} GiB), "
          f"GPU memory for staging {max(sizes) / 2**20:.0f} MiB instead of {total / 2**20:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
