"""The learner's ends of the weight paths (contract.weight_paths): one publisher per mechanism.

`publisher_for` gives the publisher of the mechanism the registry selects (by the orchestrator's announcement
and --train.lora.rank); the interface each implements is finetune.publish.base.Publisher.
"""

from __future__ import annotations

from contract.weight_paths import load, select


def announced(run) -> str | None:
    """The mechanism the orchestrator set up (RUN/weight_group.json; None: none yet)."""
    return run.read_json(run.weight_group).get("backend")


def publisher_for(run, name: str | None, lora_rank: int, current=None):
    """The publisher of mechanism `name` (select: LoRA's whatever the name); `current` when it is that
    mechanism's already, else a new one (`current` is closed: it leaves its group)."""
    mechanism = select(name, lora_rank)
    if current is not None and current.mechanism == mechanism:
        return current
    if current is not None:
        current.close()
    return load(mechanism.publisher)(run, mechanism)
