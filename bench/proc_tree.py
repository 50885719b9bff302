"""Process trees and their memory from /proc, for the benchmarks that report what a run's processes hold."""

from __future__ import annotations

import os
from pathlib import Path


def children() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, for every process on this machine."""
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(pid: int, tree: dict[int, list[int]] | None = None) -> list[int]:
    """`pid` and every process below it."""
    tree = children() if tree is None else tree
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += tree.get(p, [])
    return seen


def pss_gib(pid: int) -> float:
    """The process's proportional set size (shared pages split among their users), GiB; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
