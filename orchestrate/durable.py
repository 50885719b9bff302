"""metrics.jsonl as state.json knows it, when a run resumes (the writes themselves: contract.durable).

`repair_jsonl` runs when a run resumes: it drops the torn tail and the
records the state file does not count yet (a crash between the metrics
append and state.json), so that iteration's record is written once, when it
is redone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from contract.durable import atomic_write_bytes


def repair_jsonl(path: str | os.PathLike, keep: Callable[[dict], bool]) -> int:
    """Keep the whole records that `keep` accepts, each iteration once; returns how many lines were dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    data = path.read_bytes()
    lines = [raw for raw in data.split(b"\n") if raw.strip()]
    kept, seen = [], set()
    for raw in lines:
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(record, dict) or not keep(record):
            continue
        if (key := record.get("iteration")) is not None:
            if key in seen:
                continue
            seen.add(key)
        kept.append(raw)
    new = b"".join(raw + b"\n" for raw in kept)
    if new != data:
        atomic_write_bytes(path, new)
    return len(lines) - len(kept)


def repair_metrics(path: str | os.PathLike, completed_iteration: int, evaluated: list[int]) -> int:
    """metrics.jsonl as state.json knows it: iteration records up to `completed_iteration`, the
    evaluation before training (iteration 0) only if it is in `evaluated`."""

    def keep(record: dict) -> bool:
        it = record.get("iteration")
        if not isinstance(it, int):
            return True  # not ours to judge
        return it in evaluated if it == 0 else it <= completed_iteration

    return repair_jsonl(path, keep)
