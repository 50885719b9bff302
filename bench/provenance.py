"""Where a bench result file goes and what it records of how it was made: the date, the commit, the command
line and the machine (CPU model, cores, memory; the GPUs if any). Every bench script that writes a result
file writes it through here, so bench/results/INDEX.md (`uv run python bench/index.py`) can say who wrote it.

    from provenance import results_dir, provenance, write_json, write_sidecar
    out = results_dir(__file__)                        # bench/results/SCRIPT/, the default place
    write_json(out / "TAG.json", figures)              # the figures with a "provenance" key beside them
    write_sidecar(out / "TAG.png")                     # a plot alone: TAG.provenance.json beside it
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SIDECAR = ".provenance.json"


def results_dir(script: str | Path) -> Path:
    """bench/results/SCRIPT/ for a script's file (`__file__`): where its result files go unless told otherwise."""
    return RESULTS / Path(script).stem


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> list[str]:
    """One 'NAME, MEMORY' per GPU that nvidia-smi lists; none without it (no torch import: it takes seconds)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def machine() -> dict:
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "gpus": _gpus(),
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def provenance(argv: list[str] | None = None) -> dict:
    """How this result was made: UTC date, commit (with `dirty` when the work tree had changes), the command
    line as typed (`argv`, default sys.argv) and the machine."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "command": shlex.join(["python", *(sys.argv if argv is None else argv)]),
        "machine": machine(),
    }


def write_json(path: str | Path, data: dict, argv: list[str] | None = None) -> Path:
    """`data` as indented JSON with its provenance under the key "provenance"."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**data, "provenance": provenance(argv)}, indent=1) + "\n")
    return path


def sidecar_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.stem + SIDECAR)


def write_sidecar(path: str | Path, argv: list[str] | None = None) -> Path:
    """A result file that cannot hold its provenance (a plot, a table) gets it in STEM.provenance.json."""
    out = sidecar_path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"file": Path(path).name, "provenance": provenance(argv)}, indent=1) + "\n")
    return out
