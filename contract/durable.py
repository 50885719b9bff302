"""Files that survive a crash whole: the one place the run directory's writes get their guarantee.

Every file of the protocol is written one of two ways, and both give the same guarantee: after a crash
(kill -9, power loss) a reader sees the old content or the whole new content, never a torn one, and a
file that was reported written is still there.

- Replaced whole (state files, batches, advantages, tape files, config): `atomic_write_bytes` /
  `atomic_write_text` / `atomic_write_json` write at once, `AtomicFile` streams (tape files are written
  tape by tape under `<name>.partial`, readable while they grow). Both write a temporary file in the same
  folder, flush and fsync it, rename it over the target, then fsync the folder (without that, a power loss
  can undo the rename).
- Grown line by line (metrics.jsonl, train_metrics.jsonl): `append_line` writes one JSON record with one
  write and fsyncs it; a write that fails part-way (disk full, file-size limit) is cut back, and a torn
  tail left by a crash is cut off before the next record, so no record is ever glued to half of another.
  `read_jsonl` returns the whole records only.

finetune stands alone (it imports nothing of the other packages); the orchestrator imports this module
for its own files, and hands `AtomicFile` to tapes.store, which knows the format only.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

PARTIAL_SUFFIX = ".partial"


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename or a new file in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | os.PathLike) -> None:
    """fsync every file and folder under `folder` (a checkpoint before it is renamed into place)."""
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that the file is either the old one or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, default=str) + "\n")


class AtomicFile:
    """A text file written in a stream under `<path>.partial` and renamed to `path` when closed whole.

        with AtomicFile(path) as f:
            f.write(line)

    Each write is flushed, so what an interrupted writer wrote can be read from the .partial file; it never
    looks complete. On an exception the .partial stays (for inspection) and `path` is not created.
    A file is written once: `path` must not exist.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.exists():
            raise FileExistsError(f"{self.path} exists: it is written once")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.partial = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
        self._file = open(self.partial, "w", encoding="utf-8")

    def write(self, text: str) -> int:
        n = self._file.write(text)
        self._file.flush()
        return n

    def commit(self) -> Path:
        """fsync, rename into place, fsync the folder."""
        if not self._file.closed:
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.partial, self.path)
            fsync_dir(self.path.parent)
        return self.path

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self._file.close()


def _cut_torn_tail(fd: int) -> int:
    """Truncate an unterminated last line; the file's size after."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    end = size  # walk back to the last newline (records are small: read the tail in blocks)
    while end > 0:
        start = max(0, end - 65536)
        cut = os.pread(fd, end - start, start).rfind(b"\n")
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
    data = line.rstrip("\n").encode("utf-8") + b"\n"
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
    """Whole records of a JSON-lines file (a torn or garbled line is left out; no file: none)."""
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
