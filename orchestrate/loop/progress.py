"""Progress for every phase of a run: a tqdm bar on a terminal, a few plain lines in a log.

On a terminal (the stream, stderr by default, is a TTY) `progress_bar(...)` is a tqdm bar. In a log (CI,
nohup, Slurm: stderr is a file or a pipe) a bar's refreshes would pile up there (about 30 kB for a
two-iteration run), so it writes instead at most one line every `every_s` seconds (30) while the phase
runs, and one line when it ends:

    iteration 1 rollouts: 512/1024 episode [30 s]
    iteration 1 rollouts: 1024/1024 episode, done in 41 s

Every progress bar of orchestrate is made here; `disable=True` writes nothing in either case.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from typing import IO, Any

EVERY_S = 30.0


def progress_bar(
    iterable: Iterable | None = None,
    *,
    desc: str = "",
    total: float | None = None,
    unit: str = "it",
    disable: bool = False,
    file: IO[str] | None = None,
    every_s: float = EVERY_S,
    **tqdm_kwargs: Any,
):
    """A tqdm bar if `file` (default: stderr) is a terminal, else a LineProgress; both are used alike (update,
    refresh, set_description_str, n and total, close, `with`, iteration)."""
    file = sys.stderr if file is None else file
    if not disable and not _is_tty(file):
        return LineProgress(iterable, desc=desc, total=total, unit=unit, file=file, every_s=every_s)
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, disable=disable, file=file, **tqdm_kwargs)


def _is_tty(file: IO[str]) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class LineProgress:
    """The part of tqdm's interface the run uses, writing whole lines, at most one every `every_s` seconds
    plus one at the end."""

    def __init__(self, iterable: Iterable | None = None, *, desc: str = "", total: float | None = None,
                 unit: str = "it", file: IO[str], every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.iterable, self.desc, self.unit, self.file, self.every_s, self.clock = (
            iterable,
            desc,
            unit,
            file,
            every_s,
            clock,
        )
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.n = total, 0
        self.start = self.last = clock()
        self.closed = False

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        self.refresh()

    def set_description_str(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc
        if refresh:
            self.refresh()

    def refresh(self) -> None:
        now = self.clock()
        if not self.closed and now - self.last >= self.every_s:
            self.last = now
            self._write(f"[{now - self.start:.0f} s]")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._write(f"done in {self.clock() - self.start:.0f} s", sep=", ")

    def _write(self, when: str, sep: str = " ") -> None:
        if self.total is None and not self.n:  # a phase without a count (waiting for the trainer)
            self.file.write(f"{self.desc}{sep if self.desc else ''}{when}\n")
        else:
            count = f"{self.n:g}/{self.total:g}" if self.total is not None else f"{self.n:g}"
            self.file.write(f"{self.desc}{': ' if self.desc else ''}{count} {self.unit}{sep}{when}\n")
        self.file.flush()
