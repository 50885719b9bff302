"""The disk path: each version's model folder in its checkpoint, which the servers reload by path."""

from __future__ import annotations

from pathlib import Path

from finetune.publish.base import Publisher


class DiskPublisher(Publisher):
    def write(self, learner, tmp: Path, index: int, weights: dict, keep_folder: bool) -> None:
        learner.save_weights(tmp, weights)
