"""The learner process's liveness: it never outlives the orchestrator (a thread that ends it when its parent or
--parent-pid is gone), and its main process beats RUN/trainer_heartbeat.json for an orchestrator that did not
start it (--trainer.launch external)."""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("finetune")


# ---- never outlive the orchestrator -----------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a dead parent not yet reaped is a zombie
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def start_parent_watch(parent_pid: int | None, interval: float = 1.0) -> Callable[[], None]:
    """A thread that ends the process when its parent (or --parent-pid) is gone; returns its stop function.

    os._exit on purpose: nothing half-written is ever visible, and the
    orchestrator that would read a clean shutdown is gone anyway. The thread
    is stopped before a normal exit: a daemon thread still running at
    interpreter shutdown can abort the process ("terminate called without an
    active exception") once torch.distributed is loaded.
    """
    ppid = os.getppid()
    done = threading.Event()

    def watch():
        while not done.wait(interval):
            reason = None
            if os.getppid() != ppid:
                reason = f"parent process {ppid} exited"
            elif parent_pid is not None and not _alive(parent_pid):
                reason = f"--parent-pid {parent_pid} exited"
            if reason:
                log.error("%s: exiting now", reason)
                logging.shutdown()
                os._exit(3)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()

    def stop():
        done.set()
        thread.join()

    return stop


# ---- a heartbeat for an orchestrator that did not start us -----------------------------------


def start_heartbeat(run, interval: float, **fields) -> Callable[[str], None]:
    """Beat at once, then every `interval` seconds from a thread (run.write_heartbeat); returns stop(status),
    which ends the thread and writes a last beat with that status ("stopped" or "failed").

    A thread, so that the beats go on through a long training step; a
    trainer that dies or loses its machine stops beating, which is what an
    orchestrator on another machine can see (--trainer.launch external). The
    trainer_id tells this trainer's beats from an earlier one's.
    """
    trainer_id, beat, done = uuid.uuid4().hex, [0], threading.Event()

    def write(status: str) -> None:
        beat[0] += 1
        try:
            run.write_heartbeat(trainer_id=trainer_id, beat=beat[0], status=status, interval_s=interval, **fields)
        except OSError as exc:  # a full or unreachable disk: the next beat tries again
            log.warning("could not write %s: %s", run.trainer_heartbeat, exc)

    def loop():
        while not done.wait(interval):
            write("alive")

    write("alive")
    thread = threading.Thread(target=loop, name="heartbeat", daemon=True)
    thread.start()

    def stop(status: str) -> None:
        done.set()
        thread.join()
        write(status)

    return stop
