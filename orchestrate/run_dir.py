"""The orchestrator's helpers around the run directory (whose names contract.rundir owns): tape files
written whole, the differences between two configs, and the test hook that kills the loop in a phase.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from contract.durable import AtomicFile
from tapes.store import TapeWriter

KILL_AT_ENV = "TAPELOOP_KILL_AT"


# Held while a pending kill checks the phase and fires, and while the loop leaves a phase: a delayed kill
# then lands inside its phase or not at all (never just after phase.json names the next one).
PHASE_LOCK = threading.Lock()


def kill_hook(phase: str, still_in=lambda: True) -> None:
    """Test hook, for bench/bench_kill.py; no effect unless TAPELOOP_KILL_AT is set. With
    TAPELOOP_KILL_AT="PHASE[:DELAY_S]", entering PHASE SIGKILLs this process at once, or DELAY_S seconds later
    if `still_in()` then says it is still in that phase (else nothing: the next entry arms it again). The
    caller changes what `still_in` reads under PHASE_LOCK before it writes the next phase."""
    spec = os.environ.get(KILL_AT_ENV)
    if not spec or spec.partition(":")[0] != phase:
        return
    delay = float(spec.partition(":")[2] or 0)

    def kill() -> None:
        with PHASE_LOCK:
            if still_in():
                os.kill(os.getpid(), signal.SIGKILL)

    if delay <= 0:
        kill()
    else:
        threading.Thread(target=lambda: (time.sleep(delay), kill()), daemon=True).start()


def save_tapes(path: str | os.PathLike, tapes) -> Path:
    """A tape file of the run: written under `.partial`, renamed when whole (contract.durable.AtomicFile)."""
    with AtomicFile(path) as f, TapeWriter(f) as writer:
        for tape in tapes:
            writer.write(tape)
    return Path(path)


def config_differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted names whose values differ between two config dicts."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out
