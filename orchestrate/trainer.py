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

from tqdm.auto import tqdm

from finetune.config import TrainConfig
from orchestrate.config import TrainerSection
from orchestrate.processes import spawn, stop
from orchestrate.run_dir import RunDir
from orchestrate.vllm_server import cuda_available, log_tail
from tapes.store import atomic_write_text

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
    # PPO's critic (absent otherwise)
    "value_loss",
    "vf_clip_frac",
    "value_mean",
    "returns_mean",
    "explained_variance",
)


class TrainerError(RuntimeError):
    pass


class TrainerProcess:
    def __init__(self, run_dir: RunDir, model_dir: Path, train: TrainConfig, launch: TrainerSection | None = None):
        self.run = run_dir
        self.model_dir = model_dir
        self.train = train  # the learner's config, written whole for it
        self.launch = launch or TrainerSection()  # how it is launched and waited for
        self.log_path = run_dir.logs / "trainer.log"  # the launcher's stdout/stderr, tracebacks included
        self.config_path = run_dir.root / "train_config.json"
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
        (self.run.root / "trainer.stop").unlink(missing_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== starting: {shlex.join(self.command())}\n".encode())
        self.process = spawn(self.command(), self.log_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def _died(self) -> TrainerError:
        code = self.process.returncode if self.process else None
        return TrainerError(
            f"the trainer exited with code {code}. {self.log_path} ends with:\n{log_tail(self.log_path)}\n"
            f"Fix the cause, then resume with: uv run -m orchestrate.rl --run-dir {self.run.root}"
        )

    def status(self) -> dict:
        """The trainer's trainer_state.json ({} while there is none or it is being replaced)."""
        try:
            return json.loads((self.run.root / "trainer_state.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def newest_checkpoint(self) -> int:
        """The number of the newest checkpoint the trainer has published (0: none yet). Checkpoints appear
        whole (built aside, then renamed) and in batch order."""
        folders = [p for p in self.run.checkpoints.iterdir() if p.name.isdigit() and (p / "config.json").is_file()]
        return max((int(p.name) for p in folders), default=0)

    def wait_for_checkpoint(self, iteration: int, progress: bool = False, desc: str | None = None) -> Path:
        """Block until checkpoints/<iteration> is complete; raise if the trainer dies or times out.

        With `progress`, a bar follows the trainer through the batch (completion tokens trained).
        """
        folder = self.run.checkpoint(iteration)
        deadline = time.monotonic() + self.launch.timeout_s
        with tqdm(
            desc=desc or f"iteration {iteration} train",
            total=None,
            unit="tok",
            disable=not progress,
            leave=False,
            dynamic_ncols=True,
        ) as bar:
            self._wait(iteration, folder, deadline, bar)
        return folder

    def _wait(self, iteration: int, folder: Path, deadline: float, bar) -> None:
        while not (folder / "config.json").is_file():
            state = self.status()
            done = state.get("progress") if state.get("batch_in_progress") == iteration else None
            if done:
                bar.total = done["total"]
                bar.n = done["done"]
                bar.refresh()
            if self.process is None or self.process.poll() is not None:
                if (folder / "config.json").is_file():
                    break
                raise self._died()
            if time.monotonic() > deadline:
                raise TrainerError(
                    f"no checkpoint for iteration {iteration} after {self.launch.timeout_s:.0f} s "
                    f"(raise --trainer.timeout_s); {self.log_path} ends with:\n{log_tail(self.log_path)}"
                )
            time.sleep(0.2)

    def iteration_metrics(self, iteration: int) -> dict[str, float]:
        """Means of the trainer's per-step metrics for one batch, prefixed 'train_'."""
        path = self.run.train_metrics_path
        if not path.exists():
            return {}
        steps = []
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("batch") == iteration:
                steps.append(record)
        if not steps:
            return {}
        out = {"train_steps": len(steps), "train_seconds": sum(s.get("seconds", 0.0) for s in steps)}
        for key in TRAIN_KEYS:
            values = [s[key] for s in steps if isinstance(s.get(key), (int, float))]
            if values:
                out[f"train_{key}"] = sum(values) / len(values)
        return out

    def stop(self, timeout: float = 5) -> None:
        """Ask the trainer to exit (it does between batches); past `timeout` (mid-batch), stop it: it resumes."""
        if self.process is None:
            return
        (self.run.root / "trainer.stop").touch()  # the trainer exits between batches when it sees this
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        stop(self.process)
