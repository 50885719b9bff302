"""The files the learner shares with the orchestrator, in one run folder.

    RUN/batches/000003.jsonl      written by the orchestrator (finetune.batch.write_batch)
    RUN/checkpoints/000003/       written by the learner after training batch 3 (with learner.json: whether
                                  the weights changed, read by the orchestrator before it reloads)
    RUN/advantages/000003.jsonl   the returns and advantages the learner trained batch 3 with, one line per
                                  sample: {"sample_id", "turns": [{"index", "reward", "return", "advantage"}]}
                                  (written before the checkpoint appears; what tools show, never recomputed)
    RUN/train_metrics.jsonl       one JSON line per optimizer step, appended
    RUN/trainer_state.json        where the learner is (status, last batch, checkpoint)
    RUN/trainer.log               the learner's log
    RUN/trainer.stop              created by the orchestrator: exit after the current batch
    RUN/trainer_heartbeat.json    rewritten every few seconds by the learner's rank 0 while it lives (the
                                  orchestrator's only sign of a trainer it did not start: --trainer.launch external)

Everything that appears complete is complete: files are written to a temp
name and renamed, folders are built under checkpoints/.tmp-000003, fsynced,
then renamed. See finetune.train for the protocol as a whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

from finetune.batch import list_batches
from finetune.durable import append_line, atomic_write_json, atomic_write_text, fsync_dir, fsync_tree

CHECKPOINT_NAME = re.compile(r"^(\d+)$")
ADVANTAGES_DIR = "advantages"
LEARNER_RECORD = "learner.json"  # in each checkpoint: {batch, samples, steps, weights_changed}


def advantages_file(root: str | os.PathLike, index: int) -> Path:
    """RUN/advantages/000003.jsonl: what the learner trained batch 3 with."""
    return Path(root) / ADVANTAGES_DIR / f"{index:06d}.jsonl"


def read_advantages(root: str | os.PathLike, index: int) -> dict[str, list[dict]]:
    """sample_id -> its turns ({index, reward, return, advantage}) for batch `index`; {} if not written."""
    path = advantages_file(root, index)
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            out[str(record.get("sample_id"))] = record.get("turns", [])
    return out


class RunDir:
    """The one owner of the files the orchestrator and the learner share (the orchestrator's
    orchestrate.run_dir.RunDir adds its own files to these)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.batches = self.root / "batches"
        self.checkpoints = self.root / "checkpoints"
        self.advantages = self.root / ADVANTAGES_DIR
        self.train_metrics = self.root / "train_metrics.jsonl"
        self.trainer_state = self.root / "trainer_state.json"
        self.trainer_log = self.root / "trainer.log"
        self.trainer_stop = self.root / "trainer.stop"
        self.train_config = self.root / "train_config.json"  # the orchestrator's trainer options (--config)
        self.trainer_heartbeat = self.root / "trainer_heartbeat.json"

    def batch(self, index: int) -> Path:
        return self.batches / f"{index:06d}.jsonl"

    def checkpoint(self, index: int) -> Path:
        return self.checkpoints / f"{index:06d}"

    def learner_record(self, index: int) -> dict:
        """checkpoints/N/learner.json: what the learner says of the batch it trained ({} if none). Written into
        the checkpoint before it is published, so it is there as soon as the checkpoint is."""
        try:
            return json.loads((self.checkpoint(index) / LEARNER_RECORD).read_text())
        except (OSError, ValueError):
            return {}

    def checkpoint_done(self, index: int) -> bool:
        """Whether checkpoint `index` is published (built aside, renamed whole: its config.json is there)."""
        return (self.checkpoint(index) / "config.json").is_file()

    def newest_checkpoint(self) -> int:
        """The number of the newest published checkpoint (0: none yet); the learner publishes in batch order."""
        if not self.checkpoints.is_dir():
            return 0
        found = [int(m.group(1)) for p in self.checkpoints.iterdir() if (m := CHECKPOINT_NAME.match(p.name))]
        return max((i for i in found if self.checkpoint_done(i)), default=0)

    def write_advantages(self, index: int, credit: list[dict]) -> Path:
        path = advantages_file(self.root, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, "".join(json.dumps(c) + "\n" for c in credit))
        return path

    def next_batch(self, after: int | None) -> tuple[int, Path] | None:
        """The lowest-numbered complete batch file above `after` (None: any)."""
        for index, path in list_batches(self.batches).items():
            if after is None or index > after:
                return index, path
        return None

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        """The newest checkpoint that can be resumed from (has its trainer state)."""
        if not self.checkpoints.is_dir():
            return None
        found = sorted((int(m.group(1)), p) for p in self.checkpoints.iterdir() if (m := CHECKPOINT_NAME.match(p.name)))
        if not found:
            return None
        index, path = found[-1]
        if not (path / "trainer_state" / "progress.json").is_file():
            raise RuntimeError(
                f"{path} is the newest checkpoint but has no trainer_state/progress.json, so training cannot "
                "resume from it (was it deleted by hand?). Restore it, or move it away to resume from the one before."
            )
        return index, path

    def temp_checkpoint(self, index: int) -> Path:
        """A fresh folder to build checkpoint `index` in (same file system, so rename is atomic)."""
        tmp = self.checkpoints / f".tmp-{index:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def publish_checkpoint(self, tmp: Path, index: int) -> Path:
        """fsync the temp folder's files and rename it into place."""
        final = self.checkpoint(index)
        fsync_tree(tmp)
        if final.exists():
            raise FileExistsError(f"{final} exists already: batch {index} was trained before; not overwriting it")
        os.rename(tmp, final)
        fsync_dir(self.checkpoints)
        return final

    def drop_old_trainer_states(self, keep: int) -> None:
        """Optimizer state is large (2x the weights): keep it only in the newest checkpoint."""
        for p in self.checkpoints.iterdir():
            m = CHECKPOINT_NAME.match(p.name)
            if m and int(m.group(1)) != keep and (p / "trainer_state").exists():
                shutil.rmtree(p / "trainer_state", ignore_errors=True)

    def clean_temp(self) -> None:
        """Remove half-built checkpoints left by a crash."""
        if self.checkpoints.is_dir():
            for p in self.checkpoints.glob(".tmp-*"):
                shutil.rmtree(p, ignore_errors=True)

    def write_state(self, **fields) -> None:
        atomic_write_json(self.trainer_state, {**fields, "pid": os.getpid(), "updated": time.time()}, indent=1)

    def read_state(self) -> dict | None:
        try:
            return json.loads(self.trainer_state.read_text())
        except FileNotFoundError:
            return None

    def write_heartbeat(self, **fields) -> None:
        """One beat: fields such as {trainer_id, beat, status, num_processes}, with the host and pid. The
        reader compares beats, never clocks: the trainer's machine and the orchestrator's may disagree on the
        time."""
        atomic_write_json(self.trainer_heartbeat, {**fields, "host": socket.gethostname(), "pid": os.getpid(),
                                                   "time": time.time()}, indent=1)  # fmt: skip

    def read_heartbeat(self) -> dict:
        """The last beat ({} while there is none, or one cannot be read)."""
        try:
            beat = json.loads(self.trainer_heartbeat.read_text())
        except (OSError, ValueError):
            return {}
        return beat if isinstance(beat, dict) else {}

    def append_metrics(self, record: dict) -> None:
        """One whole line per call; a line torn by a kill mid-write is cut before the next (finetune.durable)."""
        append_line(self.train_metrics, json.dumps(record))
