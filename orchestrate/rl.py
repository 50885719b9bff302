"""The RL loop: `uv run -m orchestrate.rl [--preset NAME] [--SECTION.OPTION VALUE ...]`.

Creates (or resumes) a run directory and runs the loop of orchestrate/loop.py
on it. `--help` lists every option.
"""

from __future__ import annotations

import sys
from pathlib import Path

from orchestrate.config import parse_args
from orchestrate.run_dir import RunDir, config_differences

# Options that may change when a run is resumed.
RESUMABLE = {"run.iterations", "run.wandb", "run.tensorboard", "train.timeout_s", "server.startup_timeout_s"}


def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    if args.print_config:
        print(config.model_dump_json(indent=2))
        return 0
    for flag, module in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        if getattr(config.run, flag):
            import importlib.util

            if importlib.util.find_spec(module) is None:
                print(f"error: --run.{flag}: the '{module}' package is not installed "
                      f"(run with `uv run --with {module} -m orchestrate.rl ...`)", file=sys.stderr)  # fmt: skip
                return 2

    run_dir = RunDir(args.run_dir or Path("runs") / args.preset)
    saved = run_dir.saved_config()
    current = config.model_dump(mode="json")
    if saved is not None:
        changed = [name for name in config_differences(saved, current) if name not in RESUMABLE]
        if changed:
            print(f"error: {run_dir.root} was started with other settings ({', '.join('--' + c for c in changed)}); "
                  "resume it with the same options, or pass a new --run-dir", file=sys.stderr)  # fmt: skip
            return 2
        print(f"Resuming {run_dir.root} after iteration {run_dir.load_state().completed_iteration}.")
    run_dir.create()
    run_dir.save_config(current)

    from orchestrate.loop import Loop
    from orchestrate.trainer import TrainerError
    from orchestrate.vllm_server import ServerError

    try:
        return Loop(config, run_dir)()
    except (TrainerError, ServerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nInterrupted. Resume with: uv run -m orchestrate.rl --run-dir {run_dir.root}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
