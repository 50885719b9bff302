"""The finetune process, seen from the orchestrator.

Launched once per run with `accelerate launch -m finetune.train`, it stays
alive across iterations (model and optimizer in memory), trains each batch
file the orchestrator writes and answers with a checkpoint folder. The two
talk only through files in the run directory (see finetune/rundir.py).
If the trainer dies, the run stops with the tail of its log and the command
that resumes.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from finetune.config import TrainConfig
from finetune.durable import atomic_write_text, read_jsonl
from orchestrate.config import TrainerSection
from orchestrate.processes import parse_cpus, spawn, stop
from orchestrate.progress import progress_bar
from orchestrate.run_dir import RunDir
from orchestrate.vllm_server import cuda_available, log_tail

ACCELERATE_CONFIGS = Path(__file__).resolve().parent.parent / "finetune" / "accelerate"


# Per-step trainer metrics averaged into the iteration's line of metrics.jsonl.
TRAIN_KEYS = (
    "loss",
    "pg_loss",
    "kl",
    "entropy",
    "clip_frac",
    "ratio_mean",
    "ratio_max",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "padding_frac",
    # training-inference mismatch, measured in a batch's first step
    "mismatch_abs_logp",
    "tis_ratio_mean",
    "tis_ratio_max",
    # PPO's critic (absent otherwise)
    "value_loss",
    "vf_clip_frac",
    "value_mean",
    "returns_mean",
    "explained_variance",
)


# Per-batch figures of the samples' staleness (the learner's lag = its version - the generating one), and the
# samples left out by overlong filtering.
BATCH_KEYS = ("lag_mean", "lag_max", "stale_dropped", "overlong_masked")


class TrainerError(RuntimeError):
    pass


class TrainerProcess:
    def __init__(self, run_dir: RunDir, model_dir: Path, train: TrainConfig, launch: TrainerSection | None = None):
        self.run = run_dir
        self.model_dir = model_dir
        self.train = train  # the learner's config, written whole for it
        self.launch = launch or TrainerSection()  # how it is launched and waited for
        self.log_path = run_dir.launcher_log  # the launcher's stdout/stderr, tracebacks included
        self.config_path = run_dir.train_config
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        c = self.launch
        accelerate_config = c.accelerate_config or str(
            ACCELERATE_CONFIGS / ("one_gpu.yaml" if cuda_available() else "cpu.yaml")
        )
        return [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", accelerate_config,
            "--num_processes", str(c.num_processes),
            "-m", "finetune.train",
            "--model", str(self.model_dir),
            "--run-dir", str(self.run.root),
            "--config", str(self.config_path),
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip

    def start(self) -> None:
        atomic_write_text(self.config_path, self.train.model_dump_json(indent=2) + "\n")
        self.run.trainer_stop.unlink(missing_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== starting: {shlex.join(self.command())}\n".encode())
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cpus = parse_cpus(self.launch.cpus) if self.launch.cpus else None
        if cpus:  # torch's threads, one per core it may use
            env["OMP_NUM_THREADS"] = str(len(cpus))
        if self.launch.gpus:  # indices of our visible GPUs, as the child must name them
            from orchestrate.config_checks import gpu_slices

            devices = self.launch.gpus
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_slices(devices, 1, len(parse_cpus(devices)))[0])
        self.process = spawn(self.command(), self.log_path, env=env, cpus=cpus)

    def _died(self) -> TrainerError:
        code = self.process.returncode if self.process else None
        return TrainerError(
            f"the trainer exited with code {code}. {self.log_path} ends with:\n{log_tail(self.log_path)}\n"
            f"Fix the cause, then resume with: uv run -m orchestrate.rl --run-dir {self.run.root}"
        )

    def status(self) -> dict:
        """The trainer's trainer_state.json ({} while there is none or it is being replaced)."""
        try:
            return json.loads(self.run.trainer_state.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

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
                if self.process is None or self.process.poll() is not None:
                    if self.run.checkpoint_done(iteration):
                        break
                    raise self._died()
                if time.monotonic() > deadline:
                    raise TrainerError(
                        f"no checkpoint for iteration {iteration} after {self.launch.timeout_s:.0f} s "
                        f"(raise --trainer.timeout_s); {self.log_path} ends with:\n{log_tail(self.log_path)}"
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
        """Means of the trainer's per-step metrics for one batch, prefixed 'train_'."""
        steps = self._steps(iteration)
        if not steps:
            return {}
        out = {
            "train_steps": len([s for s in steps if "loss" in s]),
            "train_seconds": sum(s.get("seconds", 0.0) for s in steps),
        }
        for key in BATCH_KEYS:  # the same on every step of a batch
            if isinstance(steps[0].get(key), (int, float)):
                out[key] = steps[0][key]
        for key in TRAIN_KEYS:
            values = [s[key] for s in steps if isinstance(s.get(key), (int, float))]
            if values:
                out[f"train_{key}"] = sum(values) / len(values)
        return out

    def stop(self, timeout: float = 5) -> None:
        """Ask the trainer to exit (it does between batches); past `timeout` (mid-batch), stop it: it resumes."""
        if self.process is None:
            return
        self.run.trainer_stop.touch()  # the trainer exits between batches when it sees this
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        stop(self.process)
