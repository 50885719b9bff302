"""The RL loop: `uv run -m orchestrate.rl [--preset NAME] [--SECTION.OPTION VALUE ...]`.

Skeleton: the options and their validation are final; the loop itself
(rollouts -> rewards -> reference pass -> finetune -> weight reload ->
evaluation) lands with the loop issue.
"""

from __future__ import annotations

import sys

from orchestrate.config import parse_args


def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    if args.print_config:
        print(config.model_dump_json(indent=2))
        return 0
    print("The RL loop is not implemented yet; `--print-config` shows the resolved config.", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
