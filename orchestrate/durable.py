"""JSON-lines files that only grow and never tear: metrics.jsonl.

`append_line` writes a record with one write and fsyncs it; if the write
fails part-way (disk full, file-size limit) the file is cut back to where it
was, so no torn half-line is left for the next record to be glued to. A torn
tail left by a crash (power loss, kill -9 mid-write) is cut off before the
next append.

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

from tapes.store import atomic_write_bytes, fsync_dir


def _cut_torn_tail(fd: int) -> int:
    """Truncate an unterminated last line; the file's size after."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    # walk back to the last newline (records are small: read the tail in blocks)
    end = size
    while end > 0:
        start = max(0, end - 65536)
        block = os.pread(fd, end - start, start)
        cut = block.rfind(b"\n")
        if cut >= 0:
            size = start + cut + 1
            break
        end = start
    else:
        size = 0
    os.ftruncate(fd, size)
    return size


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append `line` (one JSON record, no newline) whole, or leave the file as it was."""
    path = Path(path)
    data = line.rstrip("\n").encode() + b"\n"
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        size = _cut_torn_tail(fd)
        try:
            written = 0
            while written < len(data):  # os.pwrite may write less than asked
                n = os.pwrite(fd, data[written:], size + written)
                if n <= 0:
                    raise OSError(f"{path}: short write")
                written += n
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, size)  # no torn half-record left behind
            raise
    finally:
        os.close(fd)
    if created:
        fsync_dir(path.parent)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Whole records of a JSON-lines file (a torn or garbled line is left out)."""
    out = []
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return out
    for raw in data.split(b"\n"):
        try:
            record = json.loads(raw)
        except ValueError:  # torn, not UTF-8, not JSON
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


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
