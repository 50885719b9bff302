"""Where the shared-memory weight path puts a version: a model folder in /dev/shm (tmpfs, so in host memory:
no byte goes through the disk and nothing is synced), named from the run directory so that the learner's end
(finetune.publish.shm) and the orchestrator's (orchestrate.serving.transports.shm) find the same folder; both
processes and the servers run on one machine (contract.weight_paths: same_machine)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SHM_ROOT = Path(os.environ.get("TAPELOOP_SHM_ROOT", "/dev/shm"))  # a tmpfs; tests may point elsewhere


def shm_root(run_root: str | os.PathLike) -> Path:
    """This run's folder of versions in shared memory (one per run directory, by its absolute path)."""
    key = hashlib.sha256(str(Path(run_root).resolve()).encode()).hexdigest()[:16]
    return SHM_ROOT / f"tapeloop-{key}"


def shm_version(run_root: str | os.PathLike, version: int) -> Path:
    """Version `version`'s model folder; whole once its config.json is there (contract.rundir.WEIGHTS_FILE)."""
    return shm_root(run_root) / f"{version:06d}"
