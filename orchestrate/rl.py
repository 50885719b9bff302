"""The RL loop: `uv run -m orchestrate.rl`.

Skeleton: the loop (rollouts -> rewards -> reference pass -> finetune ->
weight reload -> evaluation) lands with the loop issue. Today this command
checks the set-up: it resolves the embedded model and says what is missing.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="uv run -m orchestrate.rl",
        description="Train an LLM agent with RL on tapes: vLLM rollouts, rewards, reference log-probs, "
        "GRPO/REINFORCE in a separate finetune process.",
    )
    parser.add_argument("--preset", default="embedded", help="config preset: 'embedded' (CPU default) or 'gsm8k'")
    parser.add_argument("--run-dir", default=None, help="run directory (created, or resumed if it exists)")
    parser.add_argument("--iterations", type=int, default=None, help="number of RL iterations")
    return parser


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)
    print("The RL loop is not implemented yet; `--help` lists the options it will take.", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
