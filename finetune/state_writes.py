"""The full trainer state of a published checkpoint on its way in: written aside (every process adds its
part), synced and renamed into the checkpoint in whole, then the older full states removed. With
TrainConfig.async_state the learner takes a copy in host memory and a thread writes it while training goes
on; it is renamed in between batches once every process has written its part. A kill before the rename
leaves the previous full state to resume from (and the aside folder, removed at the next start)."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from contract.rundir import STATE_ASIDE, TRAINER_STATE_DIR, RunDir

log = logging.getLogger("finetune")


@dataclass
class StateWrite:
    """A full trainer state on its way into checkpoint `index`."""

    index: int
    aside: Path
    why: str
    started: float
    taken_s: float = 0.0
    thread: threading.Thread | None = None  # the background write (None: written already)
    errors: list[str] = field(default_factory=list)


class StateWrites:
    """The learner process's full-state writes, one at a time; `set_state` updates its state file
    (state_writing: the version being written in the background)."""

    def __init__(self, run: RunDir, learner, set_state: Callable[..., None]):
        self.run, self.learner, self.set_state = run, learner, set_state
        self.accelerator = learner.accelerator
        self.main = self.accelerator.is_main_process
        self.in_flight: StateWrite | None = None

    def save(self, index: int, progress: dict, why: str) -> None:
        """trainer_state/ of published checkpoint `index`: written aside (every process adds its part),
        synced, renamed in whole, then the older full states removed (land). With
        TrainConfig.async_state the learner takes a copy in host memory and goes on training while a thread
        writes it; otherwise it writes it now. A kill before the rename leaves the previous full state to
        resume from (and the aside folder, removed at the next start)."""
        from accelerate.utils import broadcast_object_list

        self.land(block=True)  # one at a time (the host copy's buffers are reused)
        folder = self.run.checkpoint(index)
        aside = folder / STATE_ASIDE if self.main else None
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        aside = Path(broadcast_object_list([str(aside) if aside else None])[0])
        start = time.perf_counter()
        if not self.learner.writes_state_in_background:
            self.learner.save_trainer_state(aside, progress)
            self.in_flight = StateWrite(index, aside, why, start)
            self.land(block=True)
            return
        write = self.learner.stage_trainer_state(aside, progress)
        pending = self.in_flight = StateWrite(index, aside, why, start, taken_s=time.perf_counter() - start)

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 - reported by land, in the main thread
                pending.errors.append(f"{type(exc).__name__}: {exc}")

        pending.thread = threading.Thread(target=run, name=f"trainer-state-{index}", daemon=True)
        pending.thread.start()
        self.set_state(state_writing=index)
        log.info("full trainer state of version %d taken in %.1f s, written in the background (%s)", index,
                 pending.taken_s, why)  # fmt: skip

    def land(self, block: bool = False) -> None:
        """The full state being written, renamed into its checkpoint once every process has written its
        part (block: wait for that; else only when it is done). Every process calls it at the same points:
        between batches, and before the next full state or a clean stop. A write that failed fails the
        learner, naming why."""
        from accelerate.utils import gather_object

        from contract.durable import fsync_dir, fsync_tree

        pending = self.in_flight
        if pending is None:
            return
        if block and pending.thread is not None:
            pending.thread.join()
        done, errors = pending.thread is None or not pending.thread.is_alive(), pending.errors
        if self.accelerator.num_processes > 1:
            done = all(gather_object([done]))
            if done:
                errors = gather_object(list(errors))
        if not done:
            return
        self.in_flight = None
        if errors:
            raise RuntimeError(f"writing the full trainer state of version {pending.index} failed: {errors[0]}")
        self.accelerator.wait_for_everyone()
        if self.main:
            folder = self.run.checkpoint(pending.index)
            fsync_tree(pending.aside)
            os.rename(pending.aside / TRAINER_STATE_DIR, folder / TRAINER_STATE_DIR)
            fsync_dir(folder)
            shutil.rmtree(pending.aside, ignore_errors=True)
            self.run.drop_old_trainer_states(keep=pending.index)
            seconds = time.perf_counter() - pending.started
            if pending.thread is None:
                log.info("full trainer state of version %d saved in %.1f s (%s)", pending.index, seconds, pending.why)
            else:
                log.info("full trainer state of version %d saved, %.1f s after it was taken in %.1f s (%s)",
                         pending.index, seconds - pending.taken_s, pending.taken_s, pending.why)  # fmt: skip
        if pending.thread is not None:
            self.set_state(state_writing=None)
        self.accelerator.wait_for_everyone()  # every process sees the state in place (a clean stop looks for it)
