"""The finetune process, seen from the orchestrator.

Launched once per run with `accelerate launch -m finetune.train`, it stays
alive across iterations (model and optimizer in memory), trains each batch
file the orchestrator writes and answers with a checkpoint folder. The two
talk only through files in the run directory (see contract/rundir.py).
If the trainer dies, the run stops with the tail of its log and the command
that resumes.

With --trainer.launch external the orchestrator starts no trainer: it prints
the command to run on each trainer machine (accelerate's multi-node launch)
and knows the trainer only through RUN/trainer_heartbeat.json, which the
trainer's rank 0 rewrites every few seconds (HeartbeatWatch). Batches,
checkpoints, the stop file and resuming are the same files either way; see
docs/multi-node.md.
"""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from contract.durable import atomic_write_text, read_jsonl
from contract.rundir import BATCH_METRICS, STEP_RECORD_KEYS, RunDir, optimizer_steps
from finetune.config import TrainConfig
from orchestrate.loop.config import TrainerSection
from orchestrate.loop.progress import progress_bar
from orchestrate.serving.processes import parse_cpus, spawn, stop
from orchestrate.serving.vllm_server import cuda_available, free_port, log_tail

WRITING = ("saving", "stopping")  # the trainer's statuses (learner_status.json) while it writes a full state
FINAL_STATE_S = 300.0  # the longest a stop waits for it: 15 GB at 1B, minutes on a slow disk

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE_CONFIGS = ROOT / "finetune" / "accelerate"
MULTI_CPU = "multi_cpu.yaml"  # several learner processes without a GPU


def _number(value) -> bool:
    """A figure to average: an int or a float, not a flag (bool is an int in Python)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TrainerError(RuntimeError):
    pass


class HeartbeatWatch:
    """A trainer this process did not start, seen through RUN/trainer_heartbeat.json: there once a beat
    appears that was not there at the start (an earlier trainer's last beat does not count), gone when its
    beats stop changing. Only this machine's clock is used: the trainer's machine may disagree on the time."""

    def __init__(self, run: RunDir):
        self.run = run
        self.last = self._key(run.read_heartbeat())
        self.changed_at: float | None = None  # time.monotonic() of the newest beat seen (None: none yet)
        self.beat: dict = {}

    @staticmethod
    def _key(beat: dict) -> tuple:
        return beat.get("trainer_id"), beat.get("beat")

    def poll(self) -> dict:
        """The newest beat ({} before the first one)."""
        beat = self.run.read_heartbeat()
        if beat and self._key(beat) != self.last:
            self.last, self.changed_at, self.beat = self._key(beat), time.monotonic(), beat
        return self.beat

    @property
    def connected(self) -> bool:
        return self.changed_at is not None

    def silent_for(self) -> float:
        """Seconds since the newest beat was seen."""
        return time.monotonic() - self.changed_at if self.changed_at is not None else math.inf


class TrainerProcess:
    def __init__(self, run_dir: RunDir, model_dir: Path, train: TrainConfig, launch: TrainerSection | None = None):
        self.run = run_dir
        self.model_dir = model_dir
        self.train = train  # the learner's config, written whole for it
        self.launch = launch or TrainerSection()  # how it is launched and waited for
        self.external = self.launch.launch == "external"  # started by the user, on other machines
        self.log_path = run_dir.launcher_log  # the launcher's stdout/stderr, tracebacks included
        self.config_path = run_dir.train_config
        self.process: subprocess.Popen | None = None
        self.started = False
        self.heartbeat: HeartbeatWatch | None = None  # launch external: the trainer's beats
        self._told: set[str] = set()  # the one-time messages of an external trainer already printed

    def _accelerate_config(self) -> str:
        if self.launch.accelerate_config:
            return self.launch.accelerate_config
        if self.external:  # trainer machines are GPU machines; another config with --trainer.accelerate_config
            return str(ACCELERATE_CONFIGS / "multi_gpu_ddp.yaml")
        cuda = cuda_available()
        if self.launch.num_processes > 1:  # a config of one process would start one (distributed_type NO)
            return str(ACCELERATE_CONFIGS / ("multi_gpu_ddp.yaml" if cuda else MULTI_CPU))
        return str(ACCELERATE_CONFIGS / ("one_gpu.yaml" if cuda else "cpu.yaml"))

    def gpus(self) -> list[str] | None:
        """The learner's GPUs (--trainer.gpus) as CUDA_VISIBLE_DEVICES names them (physical, whatever our own
        CUDA_VISIBLE_DEVICES renumbers); None: not given."""
        if not self.launch.gpus:
            return None
        from orchestrate.loop.config_checks import gpu_slices

        return gpu_slices(self.launch.gpus, 1, len(parse_cpus(self.launch.gpus)))[0]

    def _train_args(self) -> list[str]:
        """finetune.train's arguments; absolute paths (an external trainer starts elsewhere)."""
        return [
            "-m", "finetune.train",
            "--model", str(Path(self.model_dir).absolute()),
            "--run-dir", str(self.run.root.absolute()),
            "--config", str(self.config_path.absolute()),
        ]  # fmt: skip

    def command(self) -> list[str]:
        # several processes on this machine meet on a port: a free one, so that two runs (or a run and a
        # test) on one machine do not both take accelerate's default 29500
        port = ["--main_process_port", str(free_port())] if self.launch.num_processes > 1 else []
        # accelerate's launcher sets CUDA_VISIBLE_DEVICES to its gpu_ids (a config's, else all): naming them here is
        # what puts the learner on its GPUs
        gpus = self.gpus()
        gpu_ids = ["--gpu_ids", ",".join(gpus)] if gpus else []
        return [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", self._accelerate_config(),
            "--num_processes", str(self.launch.num_processes), *port, *gpu_ids,
            *self._train_args(),
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip

    def external_commands(self) -> list[str]:
        """launch external: the shell command for each trainer machine, by machine rank. The same
        interpreter and checkout as this process: on a shared file system they have the same path there."""
        c = self.launch
        out = []
        for rank in range(c.num_machines):
            machines = ["--num_machines", str(c.num_machines)]
            if c.num_machines > 1:
                machines += ["--machine_rank", str(rank), "--main_process_ip", str(c.main_process_ip),
                             "--main_process_port", str(c.main_process_port)]  # fmt: skip
            launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                      str(Path(self._accelerate_config()).absolute()), *machines,
                      "--num_processes", str(c.num_processes), *self._train_args()]  # fmt: skip
            out.append(f"cd {shlex.quote(str(ROOT))} && {shlex.join(launch)}")
        return out

    def start(self) -> None:
        atomic_write_text(self.config_path, self.train.model_dump_json(indent=2) + "\n")
        self.run.trainer_stop.unlink(missing_ok=True)
        self.started = True
        if self.external:
            self.heartbeat = HeartbeatWatch(self.run)
            self._tell_commands()
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== starting: {shlex.join(self.command())}\n".encode())
        cpus = parse_cpus(self.launch.cpus) if self.launch.cpus else None
        self.process = spawn(self.command(), self.log_path, env=self.environment(), cpus=cpus)

    def environment(self) -> dict[str, str]:
        """The launcher's environment: ours, with its cores' thread count and its GPUs."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.launch.cpus:  # torch's threads, one per core it may use
            env["OMP_NUM_THREADS"] = str(len(parse_cpus(self.launch.cpus)))
        if gpus := self.gpus():  # the same as --gpu_ids, for anything that reads it before accelerate does
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        if (
            Path(self._accelerate_config()).name == MULTI_CPU
        ):  # its processes on CPU with gloo (use_cpu alone is not read)
            env["ACCELERATE_USE_CPU"] = "true"
        return env

    def _tell_commands(self) -> None:
        c = self.launch
        where = "its machine" if c.num_machines == 1 else f"each of its {c.num_machines} machines"
        lines = [f"--trainer.launch external: this run starts no trainer. Start it yourself, on {where} (the "
                 "run directory and this checkout at the same path there, on a shared file system):"]  # fmt: skip
        for rank, command in enumerate(self.external_commands()):
            lines.append(f"  machine {rank}: {command}")
        lines.append(f"The run goes on once the trainer's heartbeat ({self.run.trainer_heartbeat}) beats; it "
                     f"waits up to --trainer.timeout_s {c.timeout_s:.0f} s.")  # fmt: skip
        print("\n".join(lines), flush=True)

    def _restart_hint(self) -> str:
        return "\n".join(["Fix the cause, then start the trainer again on each machine:", *self.external_commands()])

    def _check_external(self, iteration: int, deadline: float, bar, desc: str) -> None:
        """launch external: raise if the trainer never beat within timeout_s, stopped beating for
        heartbeat_timeout_s, or says it stopped, before checkpoint `iteration` was published."""
        c, watch = self.launch, self.heartbeat
        beat = watch.poll()
        if not watch.connected:
            bar.set_description_str(f"{desc}: waiting for the trainer's heartbeat")
            if "waiting" not in self._told:
                self._told.add("waiting")
                print(f"waiting for the trainer's heartbeat ({self.run.trainer_heartbeat}); start it with the "
                      "command(s) above", flush=True)  # fmt: skip
            if time.monotonic() > deadline:
                raise TrainerError(
                    f"no heartbeat from the trainer in {c.timeout_s:.0f} s (raise --trainer.timeout_s): "
                    f"{self.run.trainer_heartbeat} did not change. Is the trainer started, with this run "
                    f"directory, on a file system this machine shares? Start it on each machine with:\n"
                    + "\n".join(self.external_commands())
                )
            return
        if "connected" not in self._told:
            self._told.add("connected")
            print(f"trainer connected: {beat.get('num_processes', '?')} processes, rank 0 on "
                  f"{beat.get('host', '?')} (pid {beat.get('pid', '?')})", flush=True)  # fmt: skip
        if self.run.checkpoint_done(iteration):
            return
        tail = f"{self.run.trainer_log} ends with:\n{log_tail(self.run.trainer_log)}"
        if beat.get("status") in ("stopped", "failed"):
            raise TrainerError(f"the trainer {beat['status']} before checkpoint {iteration} (its last heartbeat "
                               f"says so; see learner_status.json). {tail}\n{self._restart_hint()}")  # fmt: skip
        if watch.silent_for() > c.heartbeat_timeout_s:
            raise TrainerError(
                f"the trainer's heartbeat ({self.run.trainer_heartbeat}) has not changed for "
                f"{watch.silent_for():.0f} s (--trainer.heartbeat_timeout_s {c.heartbeat_timeout_s:g}): the trainer "
                f"died, hangs outside Python, or lost the shared file system. {tail}\n{self._restart_hint()}"
            )

    def wait_until_loaded(self) -> None:
        """Block until the learner has loaded its model (and, resuming, dropped the checkpoints it trains
        again): its state file says it waits or trains."""
        deadline = time.monotonic() + self.launch.timeout_s
        while self.status().get("status") not in ("waiting", "training", "stopped"):
            if self.status().get("status") == "failed":
                raise TrainerError(f"the trainer failed while loading: {self.status().get('error')}")
            self.check_alive()
            if time.monotonic() > deadline:
                raise TrainerError(f"the trainer did not load within {self.launch.timeout_s:.0f} s")
            time.sleep(0.2)

    def check_alive(self) -> None:
        """Raise (with the log's tail) when a trainer this process started has exited."""
        if not self.external and (self.process is None or self.process.poll() is not None):
            raise self._died()

    def _died(self) -> TrainerError:
        code = self.process.returncode if self.process else None
        return TrainerError(
            f"the trainer exited with code {code}. {self.log_path} ends with:\n{log_tail(self.log_path)}\n"
            f"Fix the cause, then resume with: uv run -m orchestrate.rl --run-dir {self.run.root}"
        )

    def status(self) -> dict:
        """The trainer's learner_status.json ({} while there is none or it cannot be read)."""
        return self.run.read_json(self.run.learner_status)

    def newest_checkpoint(self) -> int:
        """The newest checkpoint the trainer has published (0: none yet)."""
        return self.run.newest_checkpoint()

    def wait_for_checkpoint(self, iteration: int, progress: bool = False, desc: str | None = None) -> Path:
        """Block until checkpoints/<iteration> is published; raise if the trainer dies or times out. The one
        wait for a checkpoint (the RL loop and offline training both use it).

        With `progress`, a bar follows the trainer: its status while it starts, then the completion tokens
        of the batch trained.
        """
        desc = desc or f"iteration {iteration} train"
        deadline = time.monotonic() + self.launch.timeout_s
        bar_options = dict(total=None, unit="tok", disable=not progress, leave=False, dynamic_ncols=True)
        with progress_bar(desc=desc, **bar_options) as bar:
            while not self.run.checkpoint_done(iteration):
                self._follow(iteration, bar, desc)
                if self.external:
                    self._check_external(iteration, deadline, bar, desc)
                elif self.process is None or self.process.poll() is not None:
                    if self.run.checkpoint_done(iteration):
                        break
                    raise self._died()
                if time.monotonic() > deadline:
                    log = self.run.trainer_log if self.external else self.log_path
                    raise TrainerError(
                        f"no checkpoint for iteration {iteration} after {self.launch.timeout_s:.0f} s "
                        f"(raise --trainer.timeout_s); {log} ends with:\n{log_tail(log)}"
                    )
                time.sleep(0.2)
        return self.run.checkpoint(iteration)

    def _follow(self, iteration: int, bar, desc: str) -> None:
        """The bar shows the trainer's status, and its progress through this batch once it trains it."""
        state = self.status()
        done = state.get("progress") if state.get("batch_in_progress") == iteration else None
        if done:
            bar.total, bar.n = done["total"], done["done"]
            bar.set_description_str(desc, refresh=False)
            bar.refresh()
        elif state.get("status"):
            bar.set_description_str(f"{desc}: {state['status']}")

    def weights_changed(self, iteration: int) -> bool:
        """What the learner recorded in checkpoint `iteration`: whether that batch changed the weights (True
        when it did not say: the reload is then checked)."""
        return bool(self.run.learner_record(iteration).get("weights_changed", True))

    def _steps(self, iteration: int) -> list[dict]:
        """The learner's per-step records of batch `iteration` (whole lines only)."""
        return [r for r in read_jsonl(self.run.train_metrics) if r.get("batch") == iteration]

    def iteration_metrics(self, iteration: int) -> dict[str, float]:
        """One batch's step records folded (contract.rundir): every figure of its steps averaged over the steps
        that have it, as train_NAME, whoever reports it (the learner or its loss); the batch's own figures
        copied; the steps counted and their seconds summed."""
        steps = self._steps(iteration)
        if not steps:
            return {}
        out = {
            "train_steps": optimizer_steps(steps),
            "train_seconds": sum(s.get("seconds", 0.0) for s in steps),
        }
        for key in BATCH_METRICS:  # the same on every step of a batch
            if _number(steps[0].get(key)):
                out[key] = steps[0][key]
        not_figures = (*STEP_RECORD_KEYS, *BATCH_METRICS)
        for key in dict.fromkeys(k for s in steps for k, v in s.items() if _number(v) and k not in not_figures):
            values = [s[key] for s in steps if _number(s.get(key))]
            out[f"train_{key}"] = sum(values) / len(values)
        return out

    def stop(self, timeout: float = 5) -> None:
        """Ask the trainer to exit (it does between batches); past `timeout` (mid-batch), stop it: it resumes.
        A trainer that is writing a full state (status saving, or stopping: its clean stop writes the last
        version's model folder and full state, about 15 GB at 1B) is given up to FINAL_STATE_S more to finish
        it. An external trainer is only asked (it exits after its current batch)."""
        if self.external and self.started:
            self.run.trainer_stop.touch()
            return
        if self.process is None:
            return
        self.run.trainer_stop.touch()  # the trainer exits between batches when it sees this
        start = time.monotonic()
        while self.process.poll() is None:
            waited = time.monotonic() - start
            if waited > timeout + FINAL_STATE_S or (waited > timeout and self.status().get("status") not in WRITING):
                break
            time.sleep(0.2)
        stop(self.process)
