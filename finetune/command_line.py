"""The learner's command line: the process's options (`python -m finetune.train --help`) and the training
options generated from TrainConfig, its LoRA options and each registered loss's options (contract.cli), read
strictly: a bad value exits with one line naming it."""

from __future__ import annotations

import argparse
import json
import math
import sys
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
from finetune.config import LoraOptions, TrainConfig
from finetune.losses import LOSSES


def build_parser() -> argparse.ArgumentParser:
    parser = StrictParser(
        prog="finetune.train",
        description="GRPO / REINFORCE / PPO learner: trains on RUN/batches/*.jsonl as they appear and writes "
        "RUN/checkpoints/*/ (see the module docstring for the file protocol). Launch it with "
        "`accelerate launch -m finetune.train ...`.",
    )
    _process_options(parser.add_argument_group("process"))
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


def _process_options(run) -> None:
    """The options of the process itself (not of training)."""
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
