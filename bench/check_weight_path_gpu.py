"""The learner's end of an in-memory transfer on a GPU, without vLLM: what a one-GPU machine can run of it.

    python3 bench/check_weight_path_gpu.py [--gib 0.6] [--out DIR]    # torch only; CPU: the same over gloo

NCCL refuses two ranks on one GPU, so a learner and a server cannot meet on a one-GPU machine; a group of
one rank can run. Checked, each printed PASS or FAIL (a record in --out/check_weight_path.json):
  group    - contract.weight_wire's group (nccl on a GPU) formed by CollectivePublisher.join: built with
             NCCL_GROUP_ENV, the process's own variables back after, its first broadcast passed; left by a
             shutdown, joined again, left by an abort (a failed transfer's way out);
  on_gpu   - a version of --gib GiB (bf16 weights on the GPU) packed where staging_device says with room:
             on the GPU, checksums as the manifest says; sent (blocking waits);
  via_host - the same version with no room on the GPU (the margin raised): packed into page-locked host
             buckets, the same bytes and checksums as on the GPU, kept for the next version (packed over
             them), sent one bucket at a time through the GPU.
Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the project's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contract import weight_wire as wt  # noqa: E402
from contract.weight_paths import select  # noqa: E402
from finetune.publish.collective import CollectivePublisher  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # provenance.py, also when loaded by its path

from provenance import results_dir, write_json  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=0.6, help="size of the version in GiB (bf16)")
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(results_dir(__file__)),
        help="folder for check_weight_path.json (default $OUT, else bench/results/check_weight_path_gpu)",
    )
    args = ap.parse_args()
    if args.gib <= 0:
        ap.error("--gib must be positive")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    backend = "nccl" if cuda else "gloo"
    record: dict = {"device": torch.cuda.get_device_name(0) if cuda else "CPU", "backend": backend,
                    "torch": torch.__version__, "checks": {}}  # fmt: skip
    print(f"device: {record['device']}, backend {backend}, torch {torch.__version__}")

    def check(name: str, ok: bool, detail: str) -> None:
        record["checks"][name] = {"ok": bool(ok), "detail": detail}
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")

    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    info = {"backend": backend, "host": "127.0.0.1", "port": store.port, "world_size": 1, "timeout_s": 60}
    before = {k: os.environ.get(k) for k in wt.NCCL_GROUP_ENV}
    sender = CollectivePublisher(None, select(backend))
    try:
        sender.join({**info, "generation": 1})
        formed = sender.group is not None and sender.generation == 1
        restored = {k: os.environ.get(k) for k in wt.NCCL_GROUP_ENV} == before
        sender.close()
        sender.join({**info, "generation": 2})
        again = sender.generation == 2
        check("group", formed and restored and again and sender.group is not None,
              f"formed {formed}, variables restored {restored}, joined again {again}")  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - reported, the other checks go on
        check("group", False, f"{type(exc).__name__}: {exc}")
        sender.group = None

    n = int(args.gib * 2**30) // 2  # bf16 elements
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(8192, 2048)] * max(1, n // (8192 * 2048))
    weights = {f"layer.{i}.weight": torch.randn(s, generator=g, device=device, dtype=torch.bfloat16)
               for i, s in enumerate(shapes)}  # fmt: skip
    gib = sum(t.numel() * 2 for t in weights.values()) / 2**30

    def send(packed) -> str:
        if sender.group is None:
            return "not sent (no group)"
        seconds = sender.send(packed)
        return f"sent in {seconds:.3f} s ({gib / seconds:.1f} GiB/s)"

    try:
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        start = time.perf_counter()
        gpu = sender.pack(weights.items(), "bfloat16")
        sync()
        pack_s = time.perf_counter() - start
        where = {b.device.type for b in gpu.buckets}
        sums = [wt.checksum(b) for b in gpu.buckets] == [b["checksum"] for b in gpu.manifest["buckets"]]
        check("on_gpu", where == {device.type} and sums,
              f"{gib:.2f} GiB in {len(gpu.buckets)} buckets on {where}, packed in {pack_s:.3f} s, checksums "
              f"{sums}; {send(gpu)}")  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        check("on_gpu", False, f"{type(exc).__name__}: {exc}")
        gpu = None

    margin = wt.STAGING_MARGIN
    wt.STAGING_MARGIN = 2**62  # no GPU has this much room: host staging
    try:
        times, ptrs = [], []
        for _ in range(2):
            start = time.perf_counter()
            host = sender.pack(weights.items(), "bfloat16")
            times.append(time.perf_counter() - start)
            ptrs.append([b.data_ptr() for b in host.buckets])
        on_host = all(b.device.type == "cpu" for b in host.buckets)
        pinned = all(b.is_pinned() for b in host.buckets) if cuda else True
        same = gpu is not None and host.manifest == gpu.manifest
        kept = ptrs[0] == ptrs[1]
        check("via_host", on_host and pinned and same and kept,
              f"in host memory {on_host}, page-locked {pinned}, same bytes and checksums as on the GPU {same}, "
              f"kept for the next version {kept}; packed in {times[0]:.3f} s then {times[1]:.3f} s; {send(host)}")  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        check("via_host", False, f"{type(exc).__name__}: {exc}")
    finally:
        wt.STAGING_MARGIN = margin

    try:
        sender.close(failed=True)
        check("abort", sender.group is None, "left by an abort")
    except Exception as exc:  # noqa: BLE001
        check("abort", False, f"{type(exc).__name__}: {exc}")
    failed = [k for k, v in record["checks"].items() if not v["ok"]]
    print(f"{len(record['checks']) - len(failed)} of {len(record['checks'])} checks passed")
    if args.out:
        write_json(Path(args.out) / "check_weight_path.json", record)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
