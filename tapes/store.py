"""Tapes on disk: JSON lines, one tape per line, one file per iteration.

This module knows the format only: how a file is made durable is the
writer's caller's choice (the run directory writes tape files with
contract.durable.AtomicFile: under a `.partial` name, renamed when whole, so a
crash never leaves a file that looks complete but is not). Reading streams line by line (a run's files can be large) and a bad line
is refused with an error naming the file and the line.

Floats read back exactly as written, NaN and +-inf included: they are the
bare constants NaN, Infinity and -Infinity on the line (see tapes.tape).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from pydantic import ValidationError

from tapes.tape import Tape


class TapeFileError(ValueError):
    """A tape file line that is not a valid tape."""


class TapeWriter:
    """Writes tapes, one JSON line each, to a text file object: the caller chooses how the file is made
    durable (the run directory passes contract.durable.AtomicFile: written under `.partial`, renamed when
    whole). With a path, a new plain file is written (for tools and tests; it must not exist).
    """

    def __init__(self, target: str | os.PathLike | IO[str]):
        if isinstance(target, (str, os.PathLike)):
            self.path: Path | None = Path(target)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] = open(self.path, "x", encoding="utf-8")  # tape files are written once
            self._owned = True
        else:
            self.path = getattr(target, "path", None)
            self._file = target
            self._owned = False  # the caller closes (commits) it
        self.count = 0

    def write(self, tape: Tape) -> None:
        self._file.write(tape.model_dump_json() + "\n")
        self.count += 1

    def __enter__(self) -> TapeWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._owned:
            self._file.close()


def write_tapes(target: str | os.PathLike | IO[str], tapes: Iterable[Tape]) -> Path | None:
    """Write `tapes` to a new file at a path (or to a file object); returns the path."""
    with TapeWriter(target) as writer:
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
