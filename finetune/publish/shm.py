"""The shared-memory path: each version's model folder written into host memory (/dev/shm, a tmpfs:
contract.shm_folder), which the servers on this machine reload by path. Nothing is synced or written to the
disk but the model folders a full state or --train.save_weights_every asks for; the newest two versions stay
(the one served and the new one). A version that /dev/shm has no room for (its bytes and a tenth more free,
after the older versions are removed; a write that fails for want of room) goes to its checkpoint folder
instead, from which the servers reload it (orchestrate.serving.transports.shm)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from contract.shm_folder import shm_root, shm_version
from finetune.publish.base import Publisher

KEEP = 2  # versions left in shared memory: the servers may still load the one before while the new one lands
ROOM = 1.1  # free space /dev/shm must have, per byte of a version: vLLM and NCCL keep segments there too

log = logging.getLogger("finetune.publish")


def version_bytes(weights: dict) -> int:
    """The bytes of a version's tensors (in the served dtype: what its safetensors files hold)."""
    return sum(t.numel() * t.element_size() for t in weights.values() if hasattr(t, "element_size"))


class ShmPublisher(Publisher):
    def write(self, learner, tmp: Path, index: int, weights: dict, keep_folder: bool) -> None:
        if keep_folder:
            learner.save_weights(tmp, weights)
        root = shm_root(self.run.root)
        root.mkdir(parents=True, exist_ok=True)
        folder = shm_version(self.run.root, index)
        shutil.rmtree(folder, ignore_errors=True)  # a version trained again after a resume
        older = sorted(p for p in root.iterdir() if p.name.isdigit())
        for old in older[: len(older) - (KEEP - 1)]:  # removed before the new one lands: room for it
            shutil.rmtree(old, ignore_errors=True)
        need, free = version_bytes(weights), shutil.disk_usage(root).free
        try:
            if free < ROOM * need:
                raise OSError(f"{free / 2**30:.1f} GiB free, the version needs {need / 2**30:.1f} GiB")
            learner.save_weights(folder, weights)  # config.json last: whole once it is there
        except OSError as exc:
            shutil.rmtree(folder, ignore_errors=True)
            log.warning("version %d through the disk: no room in %s (%s)", index, root.parent, exc)
            if not keep_folder:
                learner.save_weights(tmp, weights)

    def close(self, failed: bool = False) -> None:
        shutil.rmtree(shm_root(self.run.root), ignore_errors=True)
