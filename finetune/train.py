"""The learner process: waits for batches, trains on each, writes a checkpoint per batch.

    uv run accelerate launch --config_file finetune/accelerate/cpu.yaml -m finetune.train \\
        --model MODEL_DIR --run-dir RUN [--parent-pid PID] [--config finetune.json] [--lr 1e-6 ...]

It imports nothing from the rest of tapeloop; it talks to the orchestrator
through files in the run folder only:

1. The orchestrator writes RUN/batches/NNNNNN.jsonl (contract.batch.write_batch:
   one sample per line, temp file + rename, so a visible file is complete).
2. The learner polls for the lowest-numbered batch above the last one it
   trained, trains on it (epochs x steps_per_epoch optimizer steps), then
   writes RUN/checkpoints/NNNNNN/ with learner.json and, as due (see
   contract.rundir): a Hugging Face folder (config.json, model.safetensors,
   generation_config.json, tokenizer files) that vLLM and transformers load;
   transfer.json when the weights go to the servers in memory
   (finetune.weight_transfer: the learner then broadcasts them and waits for
   the orchestrator's ack). The folder is built as checkpoints/.tmp-NNNNNN,
   fsynced and renamed: it appears complete or not at all. Every
   --save-state-every batches and at a clean stop, once the version has gone
   out (published, sent), trainer_state/ (weights, optimizer state,
   progress.json) is written aside (NNNNNN/.tmp-state, status saving),
   fsynced and renamed into the checkpoint: the servers never wait for it.
   With --async-state (auto: on with CUDA) the learner only takes a copy in
   host memory and trains on while a thread writes it (state_writing: N in
   the state file); it is renamed in between batches once it is whole.
   Only the newest full state is kept.
3. Before the checkpoint appears, the batch's per-step metrics are appended to
   RUN/train_metrics.jsonl (one JSON object per optimizer step: batch, epoch,
   step, step_in_batch, samples, seconds and the figures of
   contract.rundir.STEP_METRICS and BATCH_METRICS, with more the learner
   reports: ratio_min, the advantages' statistics, tokens), and
   RUN/learner_status.json is replaced (atomically) with
   {status, last_batch, checkpoint, optimizer_step, batch_in_progress,
   state_writing, pid, updated}; status is loading | waiting | training | saving | stopped | failed
   (with `error`).
4. The learner keeps model and optimizer in memory between batches. After a
   crash or kill, started again with the same arguments, it resumes from the
   newest checkpoint with a full state, removes the checkpoints published
   after it and trains their batches again, in order, then goes on with the
   next batch; a batch interrupted before its checkpoint is trained again
   from the start. The step records of the batches trained again are dropped
   from train_metrics.jsonl first: each published batch has its records once.
5. It exits cleanly (status stopped) when RUN/trainer.stop exists (checked
   between batches), after --max-batches batches, or with --once when no
   batch is left. It exits at once (code 3) when its parent process changes
   or the --parent-pid process dies, so it never outlives the orchestrator.
   SIGTERM / SIGKILL are safe at any time: nothing visible is half-written.
6. The main process rewrites RUN/trainer_heartbeat.json every
   --heartbeat-seconds (a counter and a status, contract.rundir), and once
   more as it exits (status stopped or failed): how an orchestrator that did
   not start the trainer (--trainer.launch external, on other machines)
   knows it is there and alive.

Under `accelerate launch` with several processes (one machine or many),
every process reads each batch file itself (the run folder is shared) and
trains its share of every step; only the main process (global rank 0)
writes checkpoints' weights, the state file, metrics, advantages and the
heartbeat. Each process adds its own random-number state to a
checkpoint's trainer_state/ (accelerate's save_state), which is why the
folder is only published after every process has written.

Run `python -m finetune.train --help` for every option.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from contract.cli import (
    OptionError,
    StrictParser,
    add_options,
    check_finite,
    dashed,
    error_line,
    given,
    nest,
    refuse_repeated,
)
from contract.rundir import STATE_ASIDE, TRAINER_STATE_DIR
from finetune.config import LoraOptions, TrainConfig
from finetune.losses import LOSSES

log = logging.getLogger("finetune")


# ---- command line ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = StrictParser(
        prog="finetune.train",
        description="GRPO / REINFORCE / PPO learner: trains on RUN/batches/*.jsonl as they appear and writes "
        "RUN/checkpoints/*/ (see the module docstring for the file protocol). Launch it with "
        "`accelerate launch -m finetune.train ...`.",
    )
    run = parser.add_argument_group("process")
    run.add_argument(
        "--model",
        required=True,
        help="Hugging Face model folder to start from (config.json, "
        "safetensors, tokenizer). When the run folder has a checkpoint, training resumes from its "
        "weights and optimizer state; the architecture still comes from this folder.",
    )
    run.add_argument(
        "--run-dir",
        required=True,
        help="Run folder: batches/ in, checkpoints/, train_metrics.jsonl, learner_status.json, trainer.log out.",
    )
    run.add_argument(
        "--config",
        help="JSON file of training options (the names below with underscores); command-line options override it.",
    )
    run.add_argument(
        "--parent-pid",
        type=int,
        help="Exit as soon as this process is gone (the orchestrator's "
        "pid: under `accelerate launch` the direct parent is the launcher).",
    )
    run.add_argument(
        "--once",
        action="store_true",
        help="Train every batch already there, then exit (offline training from saved samples).",
    )
    run.add_argument(
        "--max-batches", type=int, default=0, help="Exit after training this many batches (0: no limit). [default: 0]"
    )
    run.add_argument(
        "--poll-seconds", type=float, default=0.5, help="Seconds between looks for the next batch. [default: 0.5]"
    )
    run.add_argument(
        "--heartbeat-seconds",
        type=float,
        default=5.0,
        help="Seconds between beats of RUN/trainer_heartbeat.json (written by the main process; an orchestrator "
        "that did not start this trainer watches it). [default: 5]",
    )
    run.add_argument(
        "--print-config",
        action="store_true",
        help="Print the resolved training options as JSON and exit (checks them without loading a model).",
    )
    add_options(
        parser.add_argument_group("training (finetune.config.TrainConfig)"), TrainConfig, dash=True, nested=False
    )
    add_options(
        parser.add_argument_group("LoRA adapters (finetune.config.LoraOptions)"), LoraOptions, "lora.", dash=True
    )
    for loss, spec in LOSSES.items():
        group = parser.add_argument_group(f"options of --loss {loss} (finetune.losses)")
        add_options(group, spec.config, f"{loss}.", dash=True)
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, TrainConfig]:
    """Options and the validated TrainConfig; a bad value exits with one line naming it."""
    parser = build_parser()
    try:
        refuse_repeated(sys.argv[1:] if argv is None else argv)
    except OptionError as exc:
        parser.error(str(exc))
    args = parser.parse_args(argv)
    values: dict = {}
    if args.config:
        try:
            values = json.loads(Path(args.config).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            parser.error(f"--config {args.config}: {exc}")
        if not isinstance(values, dict):
            parser.error(f"--config {args.config}: expected a JSON object of training options")
    try:
        nest(given(args), values)
        config = TrainConfig.model_validate(values)
        check_finite(config.model_dump(), spell=dashed)
    except ValidationError as exc:
        parser.error(error_line(exc, spell=dashed))
    except OptionError as exc:
        parser.error(str(exc))
    if not (args.heartbeat_seconds > 0 and math.isfinite(args.heartbeat_seconds)):
        parser.error(f"--heartbeat-seconds: {args.heartbeat_seconds} is not a positive number of seconds")
    if not args.print_config and not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: not a Hugging Face model folder (no config.json)")
    return args, config


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


# ---- the loop -------------------------------------------------------------------------------


def _setup_logging(path: Path | None, rank: int) -> None:
    """The main process logs to stderr and the log file; the others only their warnings and errors."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if path is not None:
        handlers.append(logging.FileHandler(path, encoding="utf-8"))
    fmt = logging.Formatter(
        f"%(asctime)s %(levelname)s {f'[rank {rank}] ' if rank else ''}%(message)s", "%Y-%m-%d %H:%M:%S"
    )
    for h in handlers:
        h.setFormatter(fmt)
        log.addHandler(h)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


def _step_line(m: dict) -> str:
    return (
        f"batch {m['batch']} step {m['step']} (epoch {m['epoch']}): loss {m['loss']:.4f} pg {m['pg_loss']:.4f} "
        f"kl {m['kl']:.4f} entropy {m['entropy']:.3f} clip {m['clip_frac']:.3f} ratio {m['ratio_mean']:.4f} "
        f"[{m['ratio_min']:.4f}, {m['ratio_max']:.4f}] grad_norm {m['grad_norm']:.3f} lr {m['lr']:.3g} "
        f"{m['tokens_per_s']:.0f} tok/s ({m['micro_batches']} micro-batches, {m['seconds']:.1f} s)"
    )


@dataclass
class _StateWrite:
    """A full trainer state on its way into checkpoint `index` (finetune.train._Session.land_state)."""

    index: int
    aside: Path
    why: str
    started: float
    taken_s: float = 0.0
    thread: threading.Thread | None = None  # the background write (None: written already)
    errors: list[str] = field(default_factory=list)


class _Session:
    """One learner process: its run folder, its accelerator, the state file it keeps, its learner."""

    def __init__(self, args: argparse.Namespace, config: TrainConfig):
        from accelerate import Accelerator

        from contract.rundir import RunDir
        from finetune.learner import mixed_precision_for

        self.args, self.config = args, config
        self.run = RunDir(args.run_dir)
        self.accelerator = Accelerator(mixed_precision=mixed_precision_for(config))
        self.main_process = self.accelerator.is_main_process
        if self.main_process:
            self.run.root.mkdir(parents=True, exist_ok=True)
            self.run.batches.mkdir(exist_ok=True)
            self.run.checkpoints.mkdir(exist_ok=True)
        self.accelerator.wait_for_everyone()
        _setup_logging(self.run.trainer_log if self.main_process else None, self.accelerator.process_index)
        self.state = {"status": "loading", "last_batch": None, "checkpoint": None, "optimizer_step": 0,
                      "batch_in_progress": None, "state_writing": None}  # fmt: skip
        self.last: int | None = None  # the newest batch trained
        from finetune.publish import publisher_for

        # this learner's end of the weight path (finetune.publish), switched when the orchestrator announces another
        self.publisher = publisher_for(self.run, None, config.lora.rank)
        self.in_flight: _StateWrite | None = None  # a full trainer state being written (land_state)

    def set_state(self, **fields) -> None:
        self.state.update(fields)
        if self.main_process:
            self.run.write_state(**self.state)

    def load(self) -> None:
        """The learner: from the newest checkpoint's trainer state when there is one, else the model."""
        import torch

        from finetune.learner import Learner

        acc = self.accelerator
        log.info("learner starting: %s processes (%s), device %s, mixed precision %s, %d threads, config %s",
                 acc.num_processes, acc.distributed_type.value, acc.device, acc.mixed_precision,
                 torch.get_num_threads(), self.config.model_dump_json())  # fmt: skip
        if self.main_process:
            self.run.clean_temp()
        resume = self.run.latest_checkpoint()
        # Built from the initial model (checkpoints are written with an untied head for vLLM; the trainer
        # keeps the model's own architecture), weights from trainer_state/ when resuming.
        self.learner = Learner(self.args.model, self.config, acc)
        if resume is not None:
            self.last, folder = resume
            progress = self.learner.load_trainer_state(folder)
            log.info("resumed from %s (batch %d, optimizer step %d)", folder, self.last, progress["optimizer_step"])
            self.set_state(last_batch=self.last, checkpoint=str(folder.relative_to(self.run.root)),
                           optimizer_step=self.learner.step)  # fmt: skip
        else:
            log.info("loaded %s", self.args.model)
        log.info("full trainer state every %d batches, %s (%s)", self.config.save_state_every,
                 "written in the background" if self.learner.writes_state_in_background else "written before the next "
                 "batch", self.learner.background_state_why)  # fmt: skip
        # Checkpoints published after the last full state: their batches are trained again, in order.
        if self.main_process and (again := self.run.drop_checkpoints_after(self.last or 0)):
            log.info("batches %s were trained after the last full state: training them again", again)
        if self.main_process and (dropped := self.run.drop_metrics_after(self.last or 0)):
            log.info("%d step records of batches after %d dropped from %s (trained again)", dropped,
                     self.last or 0, self.run.train_metrics.name)  # fmt: skip
        self.accelerator.wait_for_everyone()

    def next_decision(self) -> tuple | None:
        """("train", index, path), ("stop", reason) or None (nothing yet): the main process decides, every
        process gets the same answer."""
        from accelerate.utils import broadcast_object_list

        decision = None
        if self.main_process:
            if self.run.trainer_stop.exists():
                decision = ("stop", f"{self.run.trainer_stop.name} found")
            elif (found := self.run.next_batch(self.last)) is not None:
                decision = ("train", found[0], str(found[1]))
            elif self.args.once:
                decision = ("stop", "no batch left (--once)")
        return broadcast_object_list([decision])[0]

    def train(self, index: int, path: str) -> None:
        """Train batch `index`, then publish its checkpoint (with the learner's record and advantages)."""
        from contract.batch import read_batch

        samples = read_batch(path)
        log.info("batch %d: %d samples from %s", index, len(samples), path)
        self.set_state(status="training", batch_in_progress=index, progress=None)
        start = time.perf_counter()
        metrics = self.learner.train_batch(
            samples, index, on_step=lambda m: log.info(_step_line(m)), on_progress=self._progress_writer()
        )
        final = self._publish(index, samples, metrics)
        if self.main_process:
            log.info("batch %d done in %.1f s: %s", index, time.perf_counter() - start, final)
        self.accelerator.wait_for_everyone()
        self.last = index
        done = dict(last_batch=index, checkpoint=str(self.run.checkpoint(index).relative_to(self.run.root)),
                    optimizer_step=self.learner.step, batch_in_progress=None)  # fmt: skip
        self.land_state()  # an earlier full state written in the background, when it is done
        if index % self.config.save_state_every == 0:
            # after the version went out (published, sent): the servers do not wait for the full state
            self.set_state(status="saving", **done)
            self._save_full_state(index, {"batch": index, "samples": len(samples)}, "every "
                                  f"{self.config.save_state_every} batches")  # fmt: skip
        self.set_state(status="waiting", **done)

    def _save_full_state(self, index: int, progress: dict, why: str) -> None:
        """trainer_state/ of published checkpoint `index`: written aside (every process adds its part),
        synced, renamed in whole, then the older full states removed (land_state). With
        TrainConfig.async_state the learner takes a copy in host memory and goes on training while a thread
        writes it; otherwise it writes it now. A kill before the rename leaves the previous full state to
        resume from (and the aside folder, removed at the next start)."""
        from accelerate.utils import broadcast_object_list

        self.land_state(block=True)  # one at a time (the host copy's buffers are reused)
        folder = self.run.checkpoint(index)
        aside = folder / STATE_ASIDE if self.main_process else None
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        aside = Path(broadcast_object_list([str(aside) if aside else None])[0])
        start = time.perf_counter()
        if not self.learner.writes_state_in_background:
            self.learner.save_trainer_state(aside, progress)
            self.in_flight = _StateWrite(index, aside, why, start)
            self.land_state(block=True)
            return
        write = self.learner.stage_trainer_state(aside, progress)
        pending = self.in_flight = _StateWrite(index, aside, why, start, taken_s=time.perf_counter() - start)

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 - reported by land_state, in the main thread
                pending.errors.append(f"{type(exc).__name__}: {exc}")

        pending.thread = threading.Thread(target=run, name=f"trainer-state-{index}", daemon=True)
        pending.thread.start()
        self.set_state(state_writing=index)
        log.info("full trainer state of version %d taken in %.1f s, written in the background (%s)", index,
                 pending.taken_s, why)  # fmt: skip

    def land_state(self, block: bool = False) -> None:
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
        if self.main_process:
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
        self.accelerator.wait_for_everyone()  # every process sees the state in place (finish() looks for it)

    def _progress_writer(self):
        """on_progress for the learner: the orchestrator's bar reads it from the state file (twice a second)."""
        last_write = [0.0]

        def progress(done: int, total: int) -> None:
            if self.main_process and (done == total or time.monotonic() - last_write[0] > 0.5):
                last_write[0] = time.monotonic()
                self.set_state(progress={"done": done, "total": total, "unit": "tok"})

        return progress

    def _publish(self, index: int, samples: list, metrics: list[dict]) -> Path | None:
        """Checkpoint `index` built aside (every process saves its part), the learner's record, the
        advantages and the step metrics written, then the checkpoint renamed into place. The weights go to
        the servers by the mechanism the orchestrator announced (finetune.publish: a model folder, an
        adapter, or in memory), written into the checkpoint before it is in place and delivered after."""
        from accelerate.utils import broadcast_object_list

        from contract.durable import atomic_write_json
        from contract.rundir import LEARNER_RECORD, optimizer_steps
        from finetune.publish import announced, publisher_for

        cfg = self.config
        tmp = self.run.temp_checkpoint(index) if self.main_process else None
        name = announced(self.run) if self.main_process else None
        self.accelerator.wait_for_everyone()
        tmp, name = broadcast_object_list([str(tmp) if tmp else None, name])
        tmp = Path(tmp)
        self.publisher = publisher_for(self.run, name, cfg.lora.rank, self.publisher)  # the same in every process
        full_state = index % cfg.save_state_every == 0
        weights = self.publisher.gather(self.learner)  # every process
        if not self.main_process:
            return None
        due = bool(cfg.save_weights_every and index % cfg.save_weights_every == 0)
        self.publisher.write(self.learner, tmp, index, weights, keep_folder=full_state or due)
        # published with the checkpoint: whether this batch moved the weights (the loop reads it to reload)
        record = {"batch": index, "samples": len(samples), "steps": optimizer_steps(metrics),
                  "weights_changed": any(m.get("weights_changed", True) for m in metrics)}  # fmt: skip
        atomic_write_json(tmp / LEARNER_RECORD, record)
        self.run.write_advantages(index, self.learner.turn_records)  # before the checkpoint: it marks the batch done
        for m in metrics:  # before the checkpoint too: a published batch has its records (a resume drops orphans)
            self.run.append_metrics({**m, "time": time.time()})
        final = self.run.publish_checkpoint(tmp, index)
        self.publisher.deliver(self.learner, index, weights)
        return final

    def answer_requests(self) -> None:
        """Between batches: set up what the orchestrator announced (a new group generation: finetune.publish);
        write the current version's weights to disk when the orchestrator asks for them (a server that must
        reload). The main process decides, every process takes part in gathering the weights."""
        from accelerate.utils import broadcast_object_list

        from finetune.publish import announced, publisher_for

        write = False
        if self.main_process:
            self.publisher = publisher_for(self.run, announced(self.run), self.config.lora.rank, self.publisher)
            self.publisher.between_batches()
            write = self.publisher.asked_for(self.last)
        if broadcast_object_list([write])[0]:
            weights = self.learner.policy_weights()
            if self.main_process:
                log.info("writing the weights of version %d to disk (asked for by the orchestrator)", self.last)
                self.learner.save_weights(self.run.checkpoint(self.last), weights)

    def finish(self) -> None:
        """A clean stop: the last version trained gets its full state and its model folder (with LoRA, its
        adapter is there already)."""
        self.land_state(block=True)
        if self.last is None:
            return
        folder = self.run.checkpoint(self.last)
        if self.publisher.writes_final_folder:  # a LoRA run's checkpoints hold their adapter already
            weights = self.learner.policy_weights()
            if self.main_process and not self.run.has_weights(self.last):
                self.learner.save_weights(folder, weights)
            del weights
        from accelerate.utils import broadcast_object_list

        missing = self.main_process and not self.run.has_trainer_state(self.last)
        if broadcast_object_list([missing])[0]:  # the main process decides: every process takes part
            self._save_full_state(self.last, {"batch": self.last, "samples": None}, "clean stop")
            self.land_state(block=True)  # written in the background or not: whole before the learner exits


def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    if args.print_config:
        print(config.model_dump_json(indent=2))
        return 0
    stop_watch = start_parent_watch(args.parent_pid)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    session = _Session(args, config)
    stop_beat = (
        start_heartbeat(session.run, args.heartbeat_seconds, num_processes=session.accelerator.num_processes)
        if session.main_process
        else lambda status: None
    )
    outcome = "failed"
    try:
        session.set_state()
        session.load()
        session.set_state(status="waiting")
        trained = 0
        while True:
            decision = session.next_decision()
            if decision is None:
                session.land_state()
                session.answer_requests()
                time.sleep(args.poll_seconds)
                continue
            if decision[0] == "stop":
                log.info("stopping: %s", decision[1])
                session.finish()
                session.set_state(status="stopped", reason=decision[1])
                break
            session.train(decision[1], decision[2])
            trained += 1
            if args.max_batches and trained >= args.max_batches:
                log.info("stopping: trained %d batches (--max-batches)", trained)
                session.finish()
                session.set_state(status="stopped", reason="--max-batches reached")
                break
        session.accelerator.wait_for_everyone()
        outcome = "stopped"
        return 0
    except Exception as exc:
        log.error("failed: %s\n%s", exc, traceback.format_exc())
        session.set_state(status="failed", error=f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        stop_beat(outcome)
        stop_watch()
        session.accelerator.end_training()


if __name__ == "__main__":
    sys.exit(main())
