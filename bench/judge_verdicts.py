"""What the judge of `--preset solver_judge` said, against whether the solver was right: one row per tape file.

    uv run python bench/judge_verdicts.py RUN/tapes/eval_000000.jsonl RUN/tapes/eval_000005.jsonl ...

Reads each tape's solver call (its turn's reward: the environment's score of the answer) and judge call (its
verdict, read as agents/programs/solver_judge.py reads it) and prints how often the judge said yes to a right
answer and no to a wrong one, and its balanced accuracy (the mean of the two: 50% for a judge that says the same
to everything, whatever the solver's base rate). A judge's success rate alone cannot tell a judge that judges from
one that learned the base rate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agents.agent import turn_rewards  # noqa: E402
from agents.programs.solver_judge import JUDGE, SOLVER, VERDICT  # noqa: E402
from tapes.store import read_tapes  # noqa: E402


def verdicts(path: Path) -> dict[str, int]:
    """Counts of (yes|no|unread) x (right|wrong) over the file's episodes (a counterfactual fork is not one)."""
    counts: dict[str, int] = {}
    for tape in read_tapes(path):
        if tape.metadata.error or tape.metadata.counterfactual:
            continue
        rewards = turn_rewards(tape)
        solver = next((c for c in tape.llm_calls if c.role == SOLVER), None)
        judge = next((c for c in tape.llm_calls if c.role == JUDGE), None)
        if solver is None or judge is None:
            continue
        right = rewards[solver.turn - 1] > 0
        found = VERDICT.findall(judge.output_text)
        said = found[-1].lower() if found else "unread"
        key = f"{said}|{'right' if right else 'wrong'}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="tape files of a solver_judge run (eval_*.jsonl)")
    args = parser.parse_args()
    for path in args.files:
        if not path.is_file():
            print(f"{path}: no such tape file", file=sys.stderr)
            return 2
    print("| tapes | episodes | solver right | judge yes on right | judge no on wrong | unread | balanced accuracy |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for path in args.files:
        c = verdicts(path)
        right = sum(v for k, v in c.items() if k.endswith("|right"))
        wrong = sum(v for k, v in c.items() if k.endswith("|wrong"))
        yes_right = c.get("yes|right", 0) / right if right else 0.0
        no_wrong = c.get("no|wrong", 0) / wrong if wrong else 0.0
        unread = sum(v for k, v in c.items() if k.startswith("unread"))
        print(
            f"| {path.parent.parent.name}/{path.name} | {right + wrong} | {right} | {yes_right:.0%} | {no_wrong:.0%} "
            f"| {unread} | {(yes_right + no_wrong) / 2:.0%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
