"""What the processor can do: its bf16 instructions. The orchestrator notes a bf16 learner this processor would
emulate (orchestrate/loop/preflight.py); bench/bench_bf16.py reports them beside its figures. The learner's
`dtype auto` does not read them yet: fp32 on CPU until bf16 is measured to learn as well (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path


def cpu_bf16(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The processor's bf16 instructions ("amx_bf16", "avx512_bf16"), the first found, or None (torch then
    emulates bf16 on the CPU: slower than fp32, bench/bench_bf16.py)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return next((flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags), None)
