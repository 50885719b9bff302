"""The run directory: one folder per run, every file in it named here, each written atomically.

The orchestrator's files:

    RUN/config.json               the resolved config
    RUN/state.json                the last completed iteration (resume starts after it) and the evaluated ones
    RUN/phase.json                what the orchestrator is doing now: {"iteration", "phase", "since", "pid"}
    RUN/tapes/iter_000003.jsonl   rollout tapes of iteration 3
    RUN/tapes/eval_000005.jsonl   evaluation tapes after iteration 5 (eval_000000: before training)
    RUN/tapes/forks/ID_at2.jsonl  continuations of tape ID after its first 2 LLM calls (orchestrate.after.fork)
    RUN/metrics.jsonl             one line per iteration
    RUN/plots/curves.png          redrawn every iteration
    RUN/logs/                     vLLM server logs, and launcher.log: the trainer launcher's output (tracebacks)

An iteration is complete when state.json says so; every file of it was written before that. Files of an
unfinished iteration are either complete (and reused on resume) or carry a temporary name.

The files the learner shares with the orchestrator:

    RUN/batches/000003.jsonl      written by the orchestrator (contract.batch.write_batch)
    RUN/checkpoints/000003/       written by the learner after training batch 3: learner.json (whether the
                                  weights changed, read by the orchestrator before it serves them), then
                                  - the policy as a Hugging Face folder (config.json, safetensors, tokenizer)
                                    when vLLM reloads from disk, when due (--save-weights-every), with a full
                                    state and at the last batch;
                                  - adapter/, the LoRA adapter (peft's folder: adapter_config.json written
                                    last) in every checkpoint of a LoRA run, which the servers load by path;
                                  - transfer.json, the manifest of the weights sent in memory
                                    (finetune.publish.collective; format: contract.weight_wire), when a weight-transfer group is joined;
                                  - trainer_state/ (optimizer, RNG, critic) every --save-state-every batches
                                    and at a clean stop: what a resumed learner starts from
    RUN/weight_group.json         the orchestrator's weight-transfer group: the learner joins it
    RUN/weights_ack.json          the orchestrator: whether every server took version N from memory
    RUN/weights_request.json      the orchestrator: write version N's weights to disk (a server must reload)
    RUN/advantages/000003.jsonl   the returns and advantages the learner trained batch 3 with, one line per
                                  sample: {"sample_id", "turns": [{"index", "reward", "return", "advantage"}]}
                                  (written before the checkpoint appears; what tools show, never recomputed)
    RUN/train_metrics.jsonl       one JSON line per optimizer step, appended
    RUN/learner_status.json       where the learner is (status, last batch, checkpoint)
    RUN/trainer.log               the learner's log
    RUN/trainer.stop              created by the orchestrator: exit after the current batch
    RUN/trainer_heartbeat.json    rewritten every few seconds by the learner's rank 0 while it lives (the
                                  orchestrator's only sign of a trainer it did not start: --trainer.launch external)

Everything that appears complete is complete: files are written to a temp
name and renamed, folders are built under checkpoints/.tmp-000003, fsynced,
then renamed. See finetune.train for the learner's side of the protocol, orchestrate.loop.iteration for the
orchestrator's. This module imports nothing of the project's but contract.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from contract.batch import batch_file, list_batches
from contract.durable import append_line, atomic_write_json, atomic_write_text, fsync_dir, fsync_tree, read_jsonl

# What phase.json names, in the order of an iteration (see orchestrate/loop/iteration.py): "starting" before the first
# iteration (servers and trainer starting; iteration 0's evaluation is "eval"), "done" after the last one.
# The file is left as it was when the orchestrator stops or is killed: its "pid" tells whether it still runs.
LOOP_PHASES = ("rollouts", "reference", "samples", "training", "weight_reload", "eval", "metrics_state")

CHECKPOINT_NAME = re.compile(r"^(\d+)$")

# RUN/train_metrics.jsonl holds one record per optimizer step (a batch that takes none: one record with samples
# 0): STEP_RECORD_KEYS say which step it is, BATCH_METRICS are the same on every record of a batch, and every
# other number is a figure of the step (the learner's and whatever the loss reports). The orchestrator folds a
# batch's records into its line of metrics.jsonl: each step figure averaged, as train_NAME; BATCH_METRICS
# copied; seconds summed (train_seconds).
STEP_RECORD_KEYS = ("batch", "epoch", "step_in_batch", "step", "samples", "seconds", "weights_changed", "time")
BATCH_METRICS = ("lag_mean", "lag_max", "lag_token_mean", "stale_dropped", "overlong_masked", "role_dropped")


def optimizer_steps(records: list[dict]) -> int:
    """How many of a batch's train_metrics records are optimizer steps (not the record of a batch that took
    none)."""
    return sum(r.get("samples", 0) > 0 for r in records)


ADVANTAGES_DIR = "advantages"
FORKS_DIR = "forks"  # beside a tape file (RUN/tapes/forks/): the tapes orchestrate.after.fork writes
LEARNER_RECORD = "learner.json"  # in each checkpoint: {batch, samples, steps, weights_changed}
TRANSFER_MANIFEST = "transfer.json"  # in a checkpoint whose weights are sent in memory
TRAINER_STATE_DIR = "trainer_state"  # in a checkpoint a learner can resume from
TRAINER_PROGRESS = "progress.json"  # in TRAINER_STATE_DIR, written last: {batch, samples, optimizer_step}
STATE_ASIDE = ".tmp-state"  # in a checkpoint: its trainer state being written, renamed in as TRAINER_STATE_DIR
WEIGHTS_FILE = "config.json"  # the file of a checkpoint's Hugging Face folder written last: the weights are whole
ADAPTER_DIR = "adapter"  # in each checkpoint of a LoRA run: the adapter (finetune.lora.write_adapter)
ADAPTER_CONFIG = "adapter_config.json"  # peft's; written last (finetune.lora): an adapter folder with it is whole


def role_adapters(adapter: str | os.PathLike) -> dict[str, Path]:
    """The adapters of the roles with one of their own (agent.roles bound to `adapter`) inside an adapter folder,
    in peft's layout for several adapters (ADAPTER/ROLE/, each a whole peft adapter folder): role -> folder. The
    role folders are written before the policy's own ADAPTER_CONFIG, so a whole adapter folder has them all."""
    adapter = Path(adapter)
    if not adapter.is_dir():
        return {}
    return {p.name: p for p in sorted(adapter.iterdir()) if p.is_dir() and (p / ADAPTER_CONFIG).is_file()}


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


def tape_file_config(path: str | os.PathLike) -> Path:
    """RUN/config.json of a tape file RUN/tapes/FILE or RUN/tapes/forks/FILE (replay, fork); the first when
    neither exists (the one a command names as missing)."""
    parents = Path(path).resolve().parents
    for run in parents[1:3]:
        if RunDir(run).config_path.is_file():
            return RunDir(run).config_path
    return RunDir(parents[1]).config_path


class RunState(BaseModel):
    """state.json: the orchestrator's progress."""

    completed_iteration: int = Field(0, ge=0)
    evaluated: list[int] = []


class RunDirError(ValueError):
    """A run directory file that cannot be read as what it should be; one line saying what to do."""


class RunDir:
    """The one owner of a run directory's names, for the orchestrator and the learner alike."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        # the orchestrator's
        self.tapes = self.root / "tapes"
        self.logs = self.root / "logs"
        self.launcher_log = self.logs / "launcher.log"  # the trainer launcher's stdout/stderr (tracebacks)
        self.plots = self.root / "plots"
        self.config_path = self.root / "config.json"
        self.state_path = self.root / "state.json"
        self.metrics_path = self.root / "metrics.jsonl"
        self.phase_path = self.root / "phase.json"
        # shared with the learner
        self.batches = self.root / "batches"
        self.checkpoints = self.root / "checkpoints"
        self.advantages = self.root / ADVANTAGES_DIR
        self.train_metrics = self.root / "train_metrics.jsonl"
        self.learner_status = self.root / "learner_status.json"
        self.trainer_log = self.root / "trainer.log"
        self.trainer_stop = self.root / "trainer.stop"
        self.train_config = self.root / "train_config.json"  # the orchestrator's trainer options (--config)
        self.trainer_heartbeat = self.root / "trainer_heartbeat.json"
        self.weight_group = self.root / "weight_group.json"
        self.weights_ack = self.root / "weights_ack.json"
        self.weights_request = self.root / "weights_request.json"

    # ---- the orchestrator's files ----------------------------------------------------------------------

    def create(self) -> None:
        for folder in (self.tapes, self.batches, self.checkpoints, self.logs, self.plots):
            folder.mkdir(parents=True, exist_ok=True)
        fsync_dir(self.root)  # the new folders survive a power loss with the files about to go in them

    def foreign(self) -> list[str]:
        """What marks a folder that holds no run (no config.json) as someone else's: folders a run directory does
        not name, and a model's weights (a project, a home folder, a model folder are not adopted as a run
        directory). Loose files are not: a log the shell opened there before the run started (`> RUN/train.log`)
        is left beside the run's own files, which have other names."""
        if not self.root.is_dir() or self.config_path.exists():
            return []
        ours = {p.name for p in vars(self).values() if isinstance(p, Path) and p.parent == self.root}
        return sorted(p.name for p in self.root.iterdir() if p.name not in ours and (
            p.is_dir() or p.suffix in (".safetensors", ".bin", ".gguf", ".pt")))  # fmt: skip

    def played_nothing(self) -> bool:
        """A run that stopped before it played or trained anything (its servers or trainer failed to start): no
        tapes, no checkpoint, no metrics line. Its settings may change: nothing was made with them."""
        return not (
            any(self.tapes.glob("*.jsonl"))
            or self.published()
            or (self.metrics_path.is_file() and self.metrics_path.stat().st_size)
        )

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
        # and one whose full state is being written (the learner renames it in when it is whole)
        protect |= {self.checkpoint(i) for i in complete if (self.checkpoint(i) / STATE_ASIDE).exists()}
        for old in complete[:-keep] if keep > 0 else complete:
            if self.checkpoint(old) not in protect:
                shutil.rmtree(self.checkpoint(old), ignore_errors=True)

    # ---- shared with the learner ---------------------------------------------------------------------

    def batch(self, index: int) -> Path:
        return batch_file(self.batches, index)

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
        """Whether checkpoint `index` is published (built aside with its learner.json, renamed whole; runs
        of earlier versions had a model folder in every checkpoint)."""
        folder = self.checkpoint(index)
        return (folder / LEARNER_RECORD).is_file() or (folder / WEIGHTS_FILE).is_file()

    def has_weights(self, index: int) -> bool:
        """Whether checkpoint `index` holds the policy as a whole Hugging Face folder (vLLM can reload it)."""
        return (self.checkpoint(index) / WEIGHTS_FILE).is_file()

    def adapter(self, index: int) -> Path:
        """checkpoints/N/adapter/: version N's LoRA adapter (a LoRA run)."""
        return self.checkpoint(index) / ADAPTER_DIR

    def has_adapter(self, index: int) -> bool:
        return (self.adapter(index) / ADAPTER_CONFIG).is_file()

    def has_trainer_state(self, index: int) -> bool:
        return (self.checkpoint(index) / TRAINER_STATE_DIR / TRAINER_PROGRESS).is_file()

    def transfer_manifest(self, index: int) -> dict | None:
        """checkpoints/N/transfer.json: the weights of version N sent in memory (None: not sent)."""
        try:
            return json.loads((self.checkpoint(index) / TRANSFER_MANIFEST).read_text())
        except (OSError, ValueError):
            return None

    def read_json(self, path: Path) -> dict:
        """A small JSON record of the protocol ({} while there is none, or it cannot be read)."""
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def newest_checkpoint(self) -> int:
        """The number of the newest published checkpoint (0: none yet); the learner publishes in batch order."""
        if not self.checkpoints.is_dir():
            return 0
        found = [int(m.group(1)) for p in self.checkpoints.iterdir() if (m := CHECKPOINT_NAME.match(p.name))]
        return max((i for i in found if self.checkpoint_done(i)), default=0)

    def write_advantages(self, index: int, turns: list[dict]) -> Path:
        path = advantages_file(self.root, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, "".join(json.dumps(t) + "\n" for t in turns))
        return path

    def next_batch(self, after: int | None) -> tuple[int, Path] | None:
        """The lowest-numbered complete batch file above `after` (None: any)."""
        for index, path in list_batches(self.batches).items():
            if after is None or index > after:
                return index, path
        return None

    def published(self) -> list[int]:
        """The numbers of the published checkpoints, oldest first."""
        if not self.checkpoints.is_dir():
            return []
        found = [int(m.group(1)) for p in self.checkpoints.iterdir() if (m := CHECKPOINT_NAME.match(p.name))]
        return sorted(i for i in found if self.checkpoint_done(i))

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        """The newest checkpoint a learner can resume from (it has its trainer state); None: start from the
        initial model. The batches of the checkpoints after it are trained again."""
        with_state = [i for i in self.published() if self.has_trainer_state(i)]
        return (with_state[-1], self.checkpoint(with_state[-1])) if with_state else None

    def drop_checkpoints_after(self, index: int) -> list[int]:
        """Remove the checkpoints newer than `index` (a resumed learner trains their batches again and
        publishes them anew); returns their numbers."""
        dropped = [i for i in self.published() if i > index]
        for i in dropped:
            gone = self.checkpoints / f".gone-{i:06d}"  # renamed first: never seen half-deleted
            shutil.rmtree(gone, ignore_errors=True)
            os.rename(self.checkpoint(i), gone)
            shutil.rmtree(gone, ignore_errors=True)
        if dropped:
            fsync_dir(self.checkpoints)
        return dropped

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
        """Optimizer state is large (2x the weights): keep it only in the newest checkpoint that has one."""
        for p in self.checkpoints.iterdir():
            m = CHECKPOINT_NAME.match(p.name)
            if m and int(m.group(1)) != keep and (p / TRAINER_STATE_DIR).exists():
                shutil.rmtree(p / TRAINER_STATE_DIR, ignore_errors=True)

    def clean_temp(self) -> None:
        """Remove half-built or half-deleted checkpoints and weight folders left by a crash."""
        if self.checkpoints.is_dir():
            for pattern in (".tmp-*", ".gone-*", "*/.tmp-weights", f"*/{STATE_ASIDE}"):
                for p in self.checkpoints.glob(pattern):
                    shutil.rmtree(p, ignore_errors=True)

    def write_state(self, **fields) -> None:
        atomic_write_json(self.learner_status, {**fields, "pid": os.getpid(), "updated": time.time()}, indent=1)

    def write_heartbeat(self, **fields) -> None:
        """One beat: fields such as {trainer_id, beat, status, num_processes}, with the host and pid. The
        reader compares beats, never clocks: the trainer's machine and the orchestrator's may disagree on the
        time."""
        atomic_write_json(self.trainer_heartbeat, {**fields, "host": socket.gethostname(), "pid": os.getpid(),
                                                   "time": time.time()}, indent=1)  # fmt: skip

    def read_heartbeat(self) -> dict:
        """The last beat ({} while there is none, or one cannot be read)."""
        return self.read_json(self.trainer_heartbeat)

    def drop_metrics_after(self, index: int) -> int:
        """Keep train_metrics.jsonl's records of batches up to `index` only (a resumed learner's last
        checkpoint): the records of the batches it trains again go, as do those of a batch killed between its
        records and its checkpoint. Then each batch's records are those of its published checkpoint, once.
        Replaced whole (a reader sees the old file or the new one); returns how many records went."""
        records = read_jsonl(self.train_metrics)
        kept = [r for r in records if int(r.get("batch", 0)) <= index]
        if len(kept) != len(records):  # (a torn tail alone is cut by the next append)
            atomic_write_text(self.train_metrics, "".join(json.dumps(r) + "\n" for r in kept))
        return len(records) - len(kept)

    def append_metrics(self, record: dict) -> None:
        """One whole line per call; a line torn by a kill mid-write is cut before the next (contract.durable)."""
        append_line(self.train_metrics, json.dumps(record))
