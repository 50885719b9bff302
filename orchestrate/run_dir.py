"""The run directory: one folder per run, everything in it written atomically.

    config.json              the resolved config
    state.json               last completed iteration (resume starts after it)
    phase.json               what the orchestrator is doing now: {"iteration", "phase", "since", "pid"}
    tapes/iter_000003.jsonl  rollout tapes of iteration 3
    tapes/eval_000005.jsonl  evaluation tapes after iteration 5 (eval_000000: before training)
    batches/000003.jsonl     training samples of iteration 3 (the finetune format)
    checkpoints/000003/      the policy after training on batch 3 (the newest K are kept)
    metrics.jsonl            one line per iteration
    train_metrics.jsonl      one line per optimizer step (written by the trainer)
    trainer_state.json, advantages/, train_config.json ...: shared with the trainer (finetune/rundir.py)
    plots/curves.png         redrawn every iteration
    logs/                    vLLM server and trainer logs

An iteration is complete when state.json says so; every file of it was
written before that. Files of an unfinished iteration are either complete
(and reused on resume) or carry a temporary name.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from finetune.durable import AtomicFile, atomic_write_json, atomic_write_text, fsync_dir
from finetune.rundir import RunDir as SharedRunDir
from tapes.store import TapeWriter

# What phase.json names, in the order of an iteration (see orchestrate/loop.py): "starting" before the first
# iteration (servers and trainer starting; iteration 0's evaluation is "eval"), "done" after the last one.
# The file is left as it was when the orchestrator stops or is killed: its "pid" tells whether it still runs.
LOOP_PHASES = ("rollouts", "reference", "samples", "training", "weight_reload", "eval", "metrics_state")


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


class RunState(BaseModel):
    completed_iteration: int = Field(0, ge=0)
    evaluated: list[int] = []


class RunDirError(ValueError):
    """A run directory file that cannot be read as what it should be; one line saying what to do."""


class RunDir(SharedRunDir):
    """The orchestrator's files, beside those it shares with the learner (finetune.rundir owns those)."""

    def __init__(self, root: str | Path):
        super().__init__(root)
        self.tapes = self.root / "tapes"
        self.logs = self.root / "logs"
        self.launcher_log = self.logs / "trainer.log"  # the trainer launcher's stdout/stderr (tracebacks)
        self.plots = self.root / "plots"
        self.config_path = self.root / "config.json"
        self.state_path = self.root / "state.json"
        self.metrics_path = self.root / "metrics.jsonl"
        self.phase_path = self.root / "phase.json"

    def create(self) -> None:
        for folder in (self.tapes, self.batches, self.checkpoints, self.logs, self.plots):
            folder.mkdir(parents=True, exist_ok=True)
        fsync_dir(self.root)  # the new folders survive a power loss with the files about to go in them

    def iteration_tapes(self, iteration: int) -> Path:
        return self.tapes / f"iter_{iteration:06d}.jsonl"

    def eval_tapes(self, iteration: int) -> Path:
        return self.tapes / f"eval_{iteration:06d}.jsonl"

    def load_state(self) -> RunState:
        if not self.state_path.exists():
            return RunState()
        try:
            return RunState.model_validate_json(self.state_path.read_bytes())
        except (OSError, ValidationError) as exc:
            reason = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else exc
            raise RunDirError(f"{self.state_path} is not a run state ({reason}); restore it, or pass a new "
                              "--run-dir") from None  # fmt: skip

    def save_state(self, state: RunState) -> None:
        atomic_write_text(self.state_path, state.model_dump_json(indent=2) + "\n")

    def write_phase(self, iteration: int, phase: str) -> None:
        """phase.json: the orchestrator entered `phase` of `iteration` now (replaced atomically, so a reader
        always sees a whole record; for people and scripts watching a run)."""
        record = {"iteration": iteration, "phase": phase, "since": round(time.time(), 3), "pid": os.getpid()}
        atomic_write_json(self.phase_path, record, indent=None)

    def read_phase(self) -> dict | None:
        """phase.json's record (None before the first phase)."""
        try:
            return json.loads(self.phase_path.read_bytes())
        except FileNotFoundError:
            return None

    def saved_config(self) -> dict | None:
        if not self.config_path.exists():
            return None
        try:
            config = json.loads(self.config_path.read_bytes())
        except (OSError, ValueError) as exc:  # not JSON, not UTF-8, unreadable
            raise RunDirError(f"{self.config_path} is not readable JSON ({exc}); restore it, or pass a new "
                              "--run-dir") from None  # fmt: skip
        if not isinstance(config, dict):
            raise RunDirError(f"{self.config_path} holds a {type(config).__name__}, not a run config; restore "
                              "it, or pass a new --run-dir")  # fmt: skip
        return config

    def save_config(self, config: dict) -> None:
        atomic_write_json(self.config_path, config)

    def prune_checkpoints(self, keep: int, protect: set[Path] = frozenset()) -> None:
        """Delete all but the newest `keep` checkpoints (never one in `protect`, nor the newest one with a
        trainer state: the learner resumes from it)."""
        complete = self.published()
        with_state = [i for i in complete if self.has_trainer_state(i)]
        protect = set(protect) | ({self.checkpoint(with_state[-1])} if with_state else set())
        for old in complete[:-keep] if keep > 0 else complete:
            if self.checkpoint(old) not in protect:
                shutil.rmtree(self.checkpoint(old), ignore_errors=True)


def save_tapes(path: str | os.PathLike, tapes) -> Path:
    """A tape file of the run: written under `.partial`, renamed when whole (finetune.durable.AtomicFile)."""
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
