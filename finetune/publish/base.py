"""What a learner's end of a weight path does (contract.weight_paths names one per mechanism).

finetune.train's session drives it: after each batch every process `gather`s the version's weights, the
main process `write`s into the checkpoint being built, and once the checkpoint is in place `deliver`s it
(sends it, when the mechanism sends). Between batches the main process calls `between_batches` (join a new
group, say) and answers the orchestrator's request for a version's model folder (`asked_for`).
"""

from __future__ import annotations

from pathlib import Path


class Publisher:
    writes_final_folder = True  # a clean stop writes the last version's model folder (finetune.train finish)

    def __init__(self, run, mechanism):
        self.run = run  # contract.rundir.RunDir
        self.mechanism = mechanism  # contract.weight_paths.Mechanism

    def gather(self, learner) -> dict:
        """Every process: the version's weights as this mechanism publishes them."""
        return learner.policy_weights()

    def write(self, learner, tmp: Path, index: int, weights: dict, keep_folder: bool) -> None:
        """Main process: version `index` into the checkpoint folder being built (`tmp`). `keep_folder`: its
        model folder is due anyway (a full state, --train.save_weights_every)."""
        raise NotImplementedError

    def deliver(self, learner, index: int, weights: dict) -> str | None:
        """Main process, checkpoint `index` in place: send it where the mechanism sends; why it failed, or None
        (a failed send leaves the version's model folder written, for the servers to reload)."""
        return None

    def between_batches(self) -> None:
        """Main process, while waiting for a batch: set up what the orchestrator announced since."""

    def asked_for(self, last: int | None) -> bool:
        """Main process: the orchestrator asks for the model folder of the newest version `last` (a server
        that must reload it), and it is not written yet."""
        request = self.run.read_json(self.run.weights_request)
        return last is not None and request.get("version") == last and not self.run.has_weights(last)

    def close(self, failed: bool = False) -> None:
        """Leave what the publisher joined (another mechanism takes over, or a send failed)."""
