"""The learner process under FSDP on a GPU, full fine-tuning and LoRA: trains, publishes, stops, resumes.

    PYTHONPATH=. python bench/check_fsdp_gpu.py [--out DIR]
    PYTHONPATH=. python bench/check_fsdp_gpu.py --accelerate-config finetune/accelerate/cpu.yaml  # the logic, on CPU

For a GPU machine with torch, transformers, accelerate, peft and pydantic but no vLLM and no model hub (FSDP
does not run on CPU here). A tiny Llama built from a config; `accelerate launch --config_file
finetune/accelerate/multi_gpu_fsdp.yaml --num_processes N -m finetune.train --once` as the loop starts it,
for full fine-tuning and for LoRA rank 8:
1. two batches, then a clean stop: checkpoints 1 and 2 published (the model folder, or the adapter), the
   full state with checkpoint 2;
2. a third batch in a new process: it resumes from checkpoint 2's state and publishes checkpoint 3, whose
   weights differ from checkpoint 2's; the clean stops' full states were written in the background (a host
   copy, TrainConfig.async_state auto) with CUDA and not under FSDP, and at once otherwise.
With --accelerate-config finetune/accelerate/one_gpu.yaml the same checks run without FSDP.
Prints one line per check (PASS or FAIL) and writes fsdp_check.json to --out (or $OUT).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # provenance.py, also when this file is loaded by its path

from provenance import results_dir, write_json  # noqa: E402


def batch(seed: int):
    from contract.batch import Sample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for group in range(4):
        prompt = torch.randint(0, 256, (6,), generator=g).tolist()
        for k in range(4):
            n = int(torch.randint(3, 9, (1,), generator=g))
            samples.append(Sample(prompt_ids=prompt, completion_ids=torch.randint(0, 256, (n,), generator=g).tolist(),
                                  behaviour_logprobs=[-5.5] * n, reward=float(k % 2), group_id=f"{seed}-{group}"))  # fmt: skip
    return samples


def launch(config: str, processes: int, model: Path, run: Path, extra: list[str]) -> tuple[int, float]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes",
           str(processes), "-m", "finetune.train", "--model", str(model), "--run-dir", str(run), "--once",
           "--poll-seconds", "0.2", "--lr", "1e-3", *extra]  # fmt: skip
    start = time.perf_counter()
    with open(run / "process.out", "ab") as out:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=600).returncode
    return rc, time.perf_counter() - start


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def check(name: str, ok: bool, results: list, detail: str = "") -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""), flush=True)
    results.append({"check": name, "ok": bool(ok), "detail": detail})
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--accelerate-config", default="finetune/accelerate/multi_gpu_fsdp.yaml", help="relative to the repository"
    )
    ap.add_argument("--num-processes", type=int, default=max(1, torch.cuda.device_count()))
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(results_dir(__file__)),
        help="folder for fsdp_check.json (default $OUT, else bench/results/check_fsdp_gpu)",
    )
    args = ap.parse_args()

    from contract.batch import batch_file, write_batch
    from contract.rundir import RunDir
    from finetune.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="fsdp_check_"))
    model = make_tiny_model(work / "model")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"device {device}; {args.num_processes} process(es); {args.accelerate_config}", flush=True)
    results: list[dict] = []
    for label, extra in (("full", []), ("lora", ["--lora.rank", "8"])):
        run = work / label
        run.mkdir()
        rd = RunDir(run)
        for i in (1, 2):
            write_batch(batch_file(run / "batches", i), batch(i))
        rc, seconds = launch(args.accelerate_config, args.num_processes, model, run, extra)
        tail = (run / "process.out").read_text()[-1500:] if rc else ""
        if not check(f"{label}: two batches and a clean stop ({seconds:.0f} s)", rc == 0, results, tail):
            continue
        check(f"{label}: checkpoints 1 and 2 published", rd.published() == [1, 2], results, str(rd.published()))
        check(f"{label}: full state with checkpoint 2", rd.has_trainer_state(2), results)

        def version(i: int, rd=rd, lora=bool(extra)) -> Path:
            return rd.checkpoint(i) / "adapter" if lora else rd.checkpoint(i)

        check(f"{label}: checkpoint 2 has its {'adapter' if extra else 'model folder'}",
              bool(tensors(version(2))), results)  # fmt: skip
        write_batch(batch_file(run / "batches", 3), batch(3))
        rc, seconds = launch(args.accelerate_config, args.num_processes, model, run, extra)
        tail = (run / "process.out").read_text()[-1500:] if rc else ""
        if not check(f"{label}: a new process trains batch 3 ({seconds:.0f} s)", rc == 0, results, tail):
            continue
        log = (run / "trainer.log").read_text()
        started = [line.split(", config")[0] for line in log.splitlines() if "learner starting" in line]
        check(f"{label}: the learner ran under {started[-1].split('learner starting: ')[-1] if started else '?'}",
              bool(started) and ("FSDP" in started[-1] or "fsdp" not in args.accelerate_config), results)  # fmt: skip
        check(f"{label}: it resumed from checkpoint 2's state", "resumed from" in log and "batch 2" in log, results)
        # TrainConfig.async_state auto: the full state from a host copy by a thread on CUDA, not under FSDP
        background = torch.cuda.is_available() and "fsdp" not in args.accelerate_config
        landed = [line.split("INFO ")[-1] for line in log.splitlines() if "full trainer state of version" in line]
        check(f"{label}: the clean stop's full state {'written in the background' if background else 'written at once'}",
              ("written in the background" in log) == background and any("saved" in line for line in landed), results,
              "; ".join(landed[-2:]))  # fmt: skip
        check(f"{label}: checkpoint 3 published", rd.published() == [1, 2, 3] or rd.published()[-1] == 3, results,
              str(rd.published()))  # fmt: skip
        two, three = tensors(version(2)), tensors(version(3))
        moved = any(not torch.equal(two[k].float(), three[k].float()) for k in two if k in three)
        check(f"{label}: batch 3 changed the weights", moved, results)
    ok = all(r["ok"] for r in results)
    print(f"RESULT: {'PASS' if ok else 'FAIL'} ({sum(r['ok'] for r in results)}/{len(results)} checks)", flush=True)
    if args.out:
        write_json(
            Path(args.out) / "fsdp_check.json",
            {"device": device, "config": args.accelerate_config, "processes": args.num_processes, "results": results},
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
