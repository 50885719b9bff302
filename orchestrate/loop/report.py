"""What the loop reports of each iteration: where its time went, its metrics line, the plot, the console
line and the optional loggers (TensorBoard, Weights & Biases).

`Timer` adds up the seconds of an iteration's phases (orchestrate.loop.metrics.PHASES); `busy_fractions` says
how the trainer and the policy servers spent its wall time; `Reporter` writes the record to
RUN/metrics.jsonl, redraws RUN/plots/curves.png, prints one line and hands the record to the loggers.
"""

from __future__ import annotations

import time

from contract.rundir import RunDir
from orchestrate.loop.config import RLConfig
from orchestrate.loop.metrics import PHASES, append_metrics, plot_metrics, read_metrics

# The console line: (record key, label, format), in the order shown (README.md's example is checked against it).
CONSOLE = (
    ("reward_mean", "reward", "{:+.3f}"), ("success_rate", "success", "{:.3f}"), ("turns_mean", "turns", "{:.1f}"),
    ("parse_failure_rate", "unparsed", "{:.2f}"), ("completion_tokens_mean", "len", "{:.0f}"),
    ("kl_ref", "kl", "{:.4f}"), ("train_loss", "loss", "{:+.4f}"), ("eval_success_rate", "EVAL", "{:.3f}"),
)  # fmt: skip


class Timer:
    """Seconds per phase of one iteration."""

    def __init__(self):
        self.start = time.perf_counter()
        self.spent = {phase: 0.0 for phase in PHASES}

    def add(self, phase: str, seconds: float) -> None:
        self.spent[phase] += seconds

    def record(self) -> dict[str, float]:
        wall = time.perf_counter() - self.start
        out = {f"time_{k}": round(v, 3) for k, v in self.spent.items()}
        out["time_other"] = round(max(0.0, wall - sum(self.spent.values())), 3)
        out["time_total"] = round(wall, 3)
        return out


def busy_fractions(record: dict) -> dict[str, float]:
    """How an iteration's wall time was spent by the trainer (training, else waiting for a batch) and by the
    policy servers (generating train and evaluation episodes, else idle). With async_level 0 the two busy
    fractions add up to at most 1; overlap lifts both."""
    wall = record.get("time_total") or 0.0
    if wall <= 0:
        return {}
    training = min(wall, record.get("train_seconds", 0.0))
    generating = min(wall, record.get("time_generate", 0.0) + record.get("time_eval", 0.0))
    return {
        "trainer_busy_frac": round(training / wall, 4),
        "generator_busy_frac": round(generating / wall, 4),
        "trainer_wait_s": round(wall - training, 3),
        "generator_idle_s": round(wall - generating, 3),
    }


def console_line(record: dict, iterations: int) -> str:
    """The one line printed per iteration (and for the evaluation before training, iteration 0)."""
    parts = [f"iter {record['iteration']}/{iterations}"]
    for key, label, fmt in CONSOLE:
        if record.get(key) is not None:
            parts.append(f"{label} {fmt.format(record[key])}")
    if record.get("trainer_busy_frac") is not None:
        parts.append(f"busy: trainer {record['trainer_busy_frac']:.0%} gen {record['generator_busy_frac']:.0%}")
    times = " ".join(f"{p} {record[f'time_{p}']:.1f}s" for p in (*PHASES, "other") if record.get(f"time_{p}"))
    return "  ".join(parts) + (f"  | {times}" if times else "")


class Reporter:
    """The records of one command's run: metrics line and plot, console line, loggers. `open` starts the
    loggers, `close` ends them (the loop registers it on its ExitStack)."""

    def __init__(self, config: RLConfig, run: RunDir, elapsed_s):
        self.config, self.run, self.elapsed_s = config, run, elapsed_s  # elapsed_s(now): seconds since the start
        self.loggers: list = []
        self._tensorboard = None

    def open(self) -> None:
        """Start the loggers the config asks for (run.tensorboard, run.wandb)."""
        c, run = self.config.run, self.run
        if c.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = writer = SummaryWriter(str(run.root / "tensorboard"))
            self.loggers.append(lambda r: [writer.add_scalar(k, v, r["iteration"]) for k, v in r.items()
                                           if isinstance(v, (int, float))])  # fmt: skip
        if c.wandb:
            import wandb

            wandb.init(project="tapeloop", name=run.root.name, config=self.config.model_dump(), resume="allow")
            self.loggers.append(lambda r: wandb.log(r, step=r["iteration"]))

    def write(self, record: dict) -> None:
        """Append the record (with wall_time and elapsed_s) to metrics.jsonl and redraw the plot."""
        now = time.time()  # when it was done: unix time, and seconds since this command started
        record.update(wall_time=round(now, 3), elapsed_s=round(self.elapsed_s(now), 3))
        append_metrics(self.run.metrics_path, record)
        if record["iteration"]:
            plot_metrics(read_metrics(self.run.metrics_path), self.run.plots / "curves.png")

    def show(self, record: dict) -> None:
        """Print the record's line and give it to the loggers (once its iteration is complete)."""
        print(console_line(record, self.config.run.iterations), flush=True)
        for logger in self.loggers:
            logger(record)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self.config.run.wandb and self.loggers:
            import wandb

            wandb.finish()
