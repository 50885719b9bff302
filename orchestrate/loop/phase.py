"""The phase the loop is in, for the test hook that kills it there (bench/bench_kill.py); phase.json's names
are contract.rundir.LOOP_PHASES.
"""

from __future__ import annotations

import os
import signal
import threading
import time

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
