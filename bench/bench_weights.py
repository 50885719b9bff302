"""New weights into a running vLLM server: in memory (gloo) against a reload from disk, and what the
learner writes per iteration before and after the full state went on a schedule. Same run, same server.

    uv run python bench/bench_weights.py [--repeats 3] [--model smollm2] [--state-every 25]

The embedded model (SmolLM2-135M, fp32 on CPU) in a learner (finetune.learner.Learner) and one policy
server started as the loop starts it with --server.weight_transfer gloo. Each repeat, in alternating
order, puts a new version on the server (every weight scaled by a factor that changes each time, so each
version differs):
  disk   - the learner writes the version's model folder, the server reloads it by path
           (Transport.serve on the disk path: /collective_rpc reload_weights + /reset_prefix_cache);
  memory - the learner packs the version into checked buckets and broadcasts them while the server
           receives them (CollectiveTransport.serve in memory: the loop's weight_sync), then acks;
  shm    - the learner writes the version's model folder into shared memory (/dev/shm, nothing synced), the
           server reloads it by path (ShmTransport.serve).
The learner's side of disk and shm is timed with the checkpoint's publication (its syncs included).
weight_sync is the time the loop waits in Transport.serve; the learner's side is timed apart:
  before - what the learner wrote after every batch until this change: the model folder and its full
           trainer state (finetune.learner.Learner.save_checkpoint);
  after  - per batch: the weights gathered and packed (in memory) or the model folder alone (disk), plus
           the full state and a model folder every --state-every batches (amortized).
Prints medians over the repeats and the ratios (targets: weight_sync memory/disk <= 0.3; the learner's
per-batch checkpoint time gone between full states).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from contract.durable import atomic_write_json
from contract.rundir import LEARNER_RECORD, TRANSFER_MANIFEST, RunDir
from contract.weight_paths import select
from finetune.config import TrainConfig
from finetune.learner import Learner
from finetune.publish.collective import CollectivePublisher
from finetune.publish.shm import ShmPublisher
from orchestrate.serving.models import resolve_model, untied_copy
from orchestrate.serving.vllm_server import ServerConfig, VLLMServer
from orchestrate.serving.weights import transport_for


class _OwnTrainer:
    external = False

    def check_alive(self) -> None:
        pass


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--state-every", type=int, default=TrainConfig().save_state_every)
    args = parser.parse_args()

    model = untied_copy(resolve_model(args.model))
    learner = Learner(model, TrainConfig())
    params = dict(learner.accelerator.unwrap_model(learner.model).lm.named_parameters())
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        run = RunDir(Path(tmp) / "run")
        run.checkpoints.mkdir(parents=True)
        server = VLLMServer(model, log_path=Path(tmp) / "server.log",
                            config=ServerConfig(weight_transfer="gloo", max_model_len=1024)).start()  # fmt: skip
        try:
            weights = transport_for(run, [server], select("gloo"), 120, _OwnTrainer())
            sender = CollectivePublisher(run, select("gloo"))
            joining = threading.Thread(target=lambda: (_await_group(run), sender.join(run.read_json(run.weight_group))))
            joining.start()
            weights.start()
            joining.join()
            shm_weights = transport_for(run, [server], select("shm"), 120, _OwnTrainer())
            shm_weights.start()
            shm_sender = ShmPublisher(run, select("shm"))
            sync = {"disk": [], "memory": [], "shm": []}
            learner_s = {"checkpoint": [], "gather_pack": [], "folder": [], "disk_out": [], "shm_out": []}
            version = 0
            paths = ("disk", "memory", "shm")
            for r in range(args.repeats):
                for path in paths[r % 3 :] + paths[: r % 3]:  # each first in turn
                    version += 1
                    with torch.no_grad():
                        for p in params.values():
                            p.mul_(1.0 + 1e-3 * (-1) ** version)
                    state = learner.policy_weights()
                    tmp_ck = run.temp_checkpoint(version)
                    atomic_write_json(tmp_ck / LEARNER_RECORD, {"batch": version, "weights_changed": True})
                    if path == "shm":
                        learner_s["shm_out"].append(timed(lambda s=state, t=tmp_ck, v=version: (
                            shm_sender.write(learner, t, v, s, keep_folder=False), run.publish_checkpoint(t, v))))  # fmt: skip
                        sync["shm"].append(timed(lambda v=version: shm_weights.serve(v, verify=False)))
                        continue
                    if path == "disk":
                        start = time.perf_counter()
                        learner_s["folder"].append(timed(lambda s=state, t=tmp_ck: learner.save_weights(t, s)))
                        run.publish_checkpoint(tmp_ck, version)
                        learner_s["disk_out"].append(time.perf_counter() - start)
                        weights.in_memory = False  # the collective's own disk path
                        sync["disk"].append(timed(lambda v=version: weights.serve(v, verify=False)))
                        weights.in_memory = True
                        continue
                    start = time.perf_counter()
                    packed = sender.pack(learner.policy_weights().items(), learner.save_dtype)  # as finetune.train
                    learner_s["gather_pack"].append(time.perf_counter() - start)
                    manifest = {"version": version, "generation": sender.generation, **packed.manifest}
                    atomic_write_json(tmp_ck / TRANSFER_MANIFEST, manifest)
                    run.publish_checkpoint(tmp_ck, version)
                    result: list = []
                    sender.packed = packed  # as CollectivePublisher.write leaves it
                    sending = threading.Thread(target=lambda v=version, s=state, result=result: result.append(
                        sender.deliver(learner, v, s)))  # fmt: skip
                    sending.start()
                    sync["memory"].append(timed(lambda v=version: weights.serve(v)))
                    sending.join()
                    assert result == [None], result
                # the model folder and the full state: every batch before, every --state-every batches after
                learner_s["checkpoint"].append(timed(lambda r=r: learner.save_checkpoint(Path(tmp) / f"ck-{r}", {})))
        finally:
            shm_weights.close()
            server.stop()
            for line in (Path(tmp) / "server.log").read_text().splitlines():
                if "received in" in line:  # the engine's own split of each in-memory version
                    print("server:", line.split("] ")[-1])

    disk, memory = median(sync["disk"]), median(sync["memory"])
    before = median(learner_s["checkpoint"])
    after = median(learner_s["gather_pack"]) + before / args.state_every
    print(
        f"weight_sync, disk reload: {disk:.2f} s (n={len(sync['disk'])}: {', '.join(f'{x:.2f}' for x in sync['disk'])})"
    )
    print(f"weight_sync, in memory (gloo): {memory:.2f} s (n={len(sync['memory'])}: "
          f"{', '.join(f'{x:.2f}' for x in sync['memory'])})")  # fmt: skip
    print(f"ratio memory / disk: {memory / disk:.2f} (target <= 0.3)")
    shm = median(sync["shm"])
    print(f"weight_sync, shared memory (shm): {shm:.2f} s (n={len(sync['shm'])}: "
          f"{', '.join(f'{x:.2f}' for x in sync['shm'])}); ratio shm / disk {shm / disk:.2f}")  # fmt: skip
    disk_out, shm_out = median(learner_s["disk_out"]), median(learner_s["shm_out"])
    print(f"learner per version, model folder written and published: disk {disk_out:.2f} s, shm {shm_out:.2f} s; "
          f"a version both sides: disk {disk_out + disk:.2f} s, shm {shm_out + shm:.2f} s, ratio "
          f"{(shm_out + shm) / (disk_out + disk):.2f}")  # fmt: skip
    print(f"learner per batch, before (model folder + full state every batch): {before:.2f} s")
    folder = median(learner_s["folder"]) + before / args.state_every
    print(f"learner per batch, disk path after (model folder {median(learner_s['folder']):.2f} s, full state "
          f"{before:.2f} s / {args.state_every}): {folder:.2f} s; ratio {folder / before:.2f}")  # fmt: skip
    print(
        f"learner per batch, after (gather + pack {median(learner_s['gather_pack']):.2f} s, full state "
        f"{before:.2f} s / {args.state_every}): {after:.2f} s; ratio {after / before:.2f}"
    )


def _await_group(run: RunDir) -> None:
    while not run.read_json(run.weight_group).get("port"):
        time.sleep(0.05)


if __name__ == "__main__":
    main()
