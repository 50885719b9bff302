"""The shared-memory path: each version's model folder written into host memory (/dev/shm, a tmpfs:
contract.shm_folder), which the servers on this machine reload by path. Nothing is synced or written to the
disk but the model folders a full state or --train.save_weights_every asks for; the newest two versions stay
(the one served and the new one)."""

from __future__ import annotations

import shutil
from pathlib import Path

from contract.shm_folder import shm_root, shm_version
from finetune.publish.base import Publisher

KEEP = 2  # versions left in shared memory: the servers may still load the one before while the new one lands


class ShmPublisher(Publisher):
    def write(self, learner, tmp: Path, index: int, weights: dict, keep_folder: bool) -> None:
        if keep_folder:
            learner.save_weights(tmp, weights)
        folder = shm_version(self.run.root, index)
        shutil.rmtree(folder, ignore_errors=True)  # a version trained again after a resume
        learner.save_weights(folder, weights)  # config.json last: whole once it is there
        for old in sorted(p for p in shm_root(self.run.root).iterdir() if p.name.isdigit())[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)

    def close(self, failed: bool = False) -> None:
        shutil.rmtree(shm_root(self.run.root), ignore_errors=True)
