"""Tapes on disk: JSON lines, one tape per line, one file per iteration.

A file is written once, append-only, under a `.partial` name and renamed when
it is complete, so a crash never leaves a file that looks complete but is
not. Reading streams line by line (a run's files can be large) and a bad line
is refused with an error naming the file and the line.

Floats read back exactly as written, NaN and +-inf included: they are the
bare constants NaN, Infinity and -Infinity on the line (see tapes.tape).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tapes.tape import Tape

PARTIAL_SUFFIX = ".partial"


class TapeFileError(ValueError):
    """A tape file line that is not a valid tape."""


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename or a new file in `folder` durable: without it, after a power loss the
    directory may still list the old file (or none) while later files are there."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


class TapeWriter:
    """Appends tapes to `<path>.partial`; `close()` makes it `<path>`.

    Each line is flushed as it is written, so the tapes of an interrupted
    write can still be read from the `.partial` file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.exists():
            raise FileExistsError(f"{self.path} exists: tape files are written once")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.partial = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
        self._file = open(self.partial, "w", encoding="utf-8")
        self.count = 0

    def write(self, tape: Tape) -> None:
        self._file.write(tape.model_dump_json() + "\n")
        self._file.flush()
        self.count += 1

    def close(self) -> Path:
        if not self._file.closed:
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.partial, self.path)
            fsync_dir(self.path.parent)
        return self.path

    def __enter__(self) -> TapeWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # keep the .partial for inspection; it never looks complete
            self._file.close()


def write_tapes(path: str | os.PathLike, tapes: Iterable[Tape]) -> Path:
    with TapeWriter(path) as writer:
        for tape in tapes:
            writer.write(tape)
    return writer.path


def _decode(raw: bytes, path: str | os.PathLike, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TapeFileError(f"{path}:{lineno}: not UTF-8 text at byte {exc.start} (a binary or foreign file?); "
                            "tape files are JSON lines") from None  # fmt: skip


def parse_tape_line(line: str, path: str | os.PathLike = "<string>", lineno: int = 0) -> Tape:
    try:
        return Tape.model_validate_json(line)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "tape"
        msg = first.get("msg", str(exc))
        if first.get("type") == "json_invalid":
            msg = f"not valid JSON ({first.get('ctx', {}).get('error', msg)})"
        raise TapeFileError(f"{path}:{lineno}: {where}: {msg}") from None


def read_tapes(path: str | os.PathLike) -> Iterator[Tape]:
    """Stream the tapes of one file, in order."""
    path = Path(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                yield parse_tape_line(_decode(raw, path, lineno), path, lineno)


def line_offsets(path: str | os.PathLike) -> list[int]:
    """Byte offset of each non-blank line: random access into big files."""
    offsets = []
    with open(path, "rb") as f:
        pos = 0
        for line in f:
            if line.strip():
                offsets.append(pos)
            pos += len(line)
    return offsets


def read_tape_at(path: str | os.PathLike, offset: int, lineno: int = 0) -> Tape:
    with open(path, "rb") as f:
        f.seek(offset)
        return parse_tape_line(_decode(f.readline(), path, lineno), path, lineno)
