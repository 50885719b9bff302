"""The shared-memory path: every server reloads the version's model folder from /dev/shm (contract.shm_folder)
by path, checked by a change of log-probs as the disk path is; a version that is not there (a learner that
resumed and wrote it to the disk) comes from its checkpoint folder instead. The run's versions in shared
memory are removed when the run stops."""

from __future__ import annotations

import shutil
from pathlib import Path

from contract.durable import atomic_write_json
from contract.rundir import WEIGHTS_FILE
from contract.shm_folder import shm_root, shm_version
from orchestrate.serving.transports.disk import DiskTransport


class ShmTransport(DiskTransport):  # the disk path's reload, from another folder
    def start(self) -> None:
        shutil.rmtree(shm_root(self.run.root), ignore_errors=True)  # what a killed run left in memory
        # the learner publishes by what is announced (finetune.publish.announced): this mechanism, from now on
        generation = int(self.run.read_json(self.run.weight_group).get("generation", 0)) + 1
        atomic_write_json(self.run.weight_group, {"generation": generation, "backend": self.mechanism.name})

    def folder(self, version: int) -> Path:
        shared = shm_version(self.run.root, version)
        return shared if (shared / WEIGHTS_FILE).is_file() else self.wait_for_folder(version)

    def close(self) -> None:
        shutil.rmtree(shm_root(self.run.root), ignore_errors=True)
