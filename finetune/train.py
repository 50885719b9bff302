"""The learner process: waits for batches, trains on each, writes a checkpoint per batch.

    uv run accelerate launch --config_file finetune/accelerate/cpu.yaml -m finetune.train \\
        --model MODEL_DIR --run-dir RUN [--parent-pid PID] [--config finetune.json] [--lr 1e-6 ...]

Of the rest of tapeloop it imports only contract (the run folder's names, the
batch format, durable writes, the command-line generator); it talks to the
orchestrator through files in the run folder only:

1. The orchestrator writes RUN/batches/NNNNNN.jsonl (contract.batch.write_batch:
   one sample per line, temp file + rename, so a visible file is complete).
2. The learner polls for the lowest-numbered batch above the last one it
   trained, trains on it (epochs x steps_per_epoch optimizer steps), then
   writes RUN/checkpoints/NNNNNN/ with learner.json and, as due (see
   contract.rundir): a Hugging Face folder (config.json, model.safetensors,
   generation_config.json, tokenizer files) that vLLM and transformers load;
   transfer.json when the weights go to the servers in memory
   (finetune.publish.collective, in contract.weight_wire's format: the learner then broadcasts them and waits for
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
   RUN/train_metrics.jsonl (one JSON object per optimizer step: which step it
   is, contract.rundir.STEP_RECORD_KEYS; the batch's own figures,
   BATCH_METRICS; and the step's figures, the learner's and every term its
   loss reports, each of which the orchestrator averages into metrics.jsonl
   as train_NAME), and
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
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from finetune.command_line import parse_args
from finetune.config import TrainConfig
from finetune.liveness import start_heartbeat, start_parent_watch
from finetune.state_writes import StateWrites

log = logging.getLogger("finetune")


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


# How the step line shows the terms a loss commonly reports (finetune.losses.policy_outputs's), in this order:
# (label, format, the names it shows). A term it does not know follows them as `name value`.
KNOWN_TERMS = (
    ("pg", "{pg_loss:.4f}", ("pg_loss",)),
    ("kl", "{kl:.4f}", ("kl",)),
    ("entropy", "{entropy:.3f}", ()),  # the learner's own: on every line
    ("clip", "{clip_frac:.3f}", ("clip_frac",)),
    ("ratio", "{ratio_mean:.4f} [{ratio_min:.4f}, {ratio_max:.4f}]", ("ratio_mean", "ratio_min", "ratio_max")),
)


def _step_line(m: dict, terms: list[str]) -> str:
    """The learner's line for one optimizer step: its loss, then the `terms` the loss reported (the known ones
    in KNOWN_TERMS's order and format, then the others), then the step's gradient norm, rate and speed."""
    shown, known = [f"loss {m['loss']:.4f}"], set()
    for label, fmt, names in KNOWN_TERMS:
        if all(name in terms for name in names):
            shown.append(f"{label} {fmt.format(**m)}")
            known.update(names)
    shown += [f"{name} {m[name]:.4g}" for name in terms if name not in known]
    return (
        f"batch {m['batch']} step {m['step']} (epoch {m['epoch']}): {' '.join(shown)} grad_norm {m['grad_norm']:.3f} "
        f"lr {m['lr']:.3g} {m['tokens_per_s']:.0f} tok/s ({m['micro_batches']} micro-batches, {m['seconds']:.1f} s)"
    )


class _Session:
    """One learner process: its run folder, its accelerator, the state file it keeps, its learner."""

    def __init__(self, args: argparse.Namespace, config: TrainConfig):
        from accelerate import Accelerator

        from contract.rundir import RunDir
        from finetune.models import mixed_precision_for

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
        if acc.device.type == "cuda":  # which physical GPUs, whatever CUDA_VISIBLE_DEVICES renumbered
            from accelerate.utils import gather_object

            uuids = gather_object([str(torch.cuda.get_device_properties(acc.device).uuid)])
            log.info("learner GPUs by process: %s (CUDA_VISIBLE_DEVICES=%s)", ", ".join(f"GPU-{u}" for u in uuids),
                     os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))  # fmt: skip
        if self.main_process:
            self.run.clean_temp()
        resume = self.run.latest_checkpoint()
        # Built from the initial model (checkpoints are written with an untied head for vLLM; the trainer
        # keeps the model's own architecture), weights from trainer_state/ when resuming.
        self.learner = Learner(self.args.model, self.config, acc)
        self.state_writes = StateWrites(self.run, self.learner, self.set_state)
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
            samples,
            index,
            on_step=lambda m: log.info(_step_line(m, self.learner.loss_terms)),
            on_progress=self._progress_writer(),
        )
        self._release_gpu_memory()  # before the checkpoint appears: the orchestrator then wakes the servers
        final = self._publish(index, samples, metrics)
        self._release_gpu_memory()
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

    def _release_gpu_memory(self) -> None:
        """Colocated (vLLM servers sleep on this GPU while the learner trains): what torch's allocator caches goes
        back to the GPU, so the woken servers find it; the model and optimizer stay."""
        if not self.config.colocated or self.accelerator.device.type != "cuda":
            return
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()

    def _save_full_state(self, index: int, progress: dict, why: str) -> None:
        """trainer_state/ of published checkpoint `index` (finetune.state_writes)."""
        self.state_writes.save(index, progress, why)

    def land_state(self, block: bool = False) -> None:
        """The full state being written, renamed into its checkpoint once whole (finetune.state_writes)."""
        self.state_writes.land(block)

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
        adapter is there already). Its status says so meanwhile (the orchestrator waits for it)."""
        self.set_state(status="stopping")
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
