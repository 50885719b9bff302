"""The adapter path (a LoRA run): each version's adapter folder in its checkpoint (megabytes), which the
servers load by path under a name of their own; whole weights never move."""

from __future__ import annotations

from pathlib import Path

from contract.rundir import ADAPTER_DIR
from finetune.publish.base import Publisher


class AdapterPublisher(Publisher):
    writes_final_folder = False  # every checkpoint holds its adapter already

    def gather(self, learner) -> dict:
        return learner.adapter_weights()

    def write(self, learner, tmp: Path, index: int, weights: dict, keep_folder: bool) -> None:
        learner.save_adapter(tmp / ADAPTER_DIR, weights)
