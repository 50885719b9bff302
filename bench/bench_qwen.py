"""Qwen2.5-Coder-0.5B-Instruct (`uv sync --extra qwen`) on the multi-turn presets, the same wall time each: one
table, one plot (issue 77, item 4).

    uv run python bench/bench_qwen.py --out /tmp/qwen [--minutes 60] [--recipes game,countdown,python_tool,program_tool]
        [--eval-every 3] [--eval-tasks N] [--marks 20,40,60] [--report-only]

Each recipe is one real run of its preset (vLLM server, accelerate-launched trainer) with the 0.5B as the policy,
trained as LoRA adapters (rank 16, alpha 32, lr 1e-4: full fine-tuning of the 0.5B does not fit 24 GiB beside
its server, and the memory plan refuses it), one after the other, for --minutes from the command's start,
through bench/compare_algorithms.py's machinery: run directories OUT/RECIPE (a later command goes on where a
run stopped), held-out success at the --marks, OUT/table.md and OUT/qwen.png. The presets' own settings stand
otherwise (their tasks, turns, rewards, sampling and evaluation). The 135M's plateaus these are measured
against: the game 45-50%, countdown 66% (docs/results.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import compare_algorithms as ca  # noqa: E402

QWEN = ("--model.policy", "qwen-coder-0.5b", "--train.lora.rank", "16", "--train.lora.alpha", "32",
        "--train.lr", "1e-4")  # fmt: skip
WHY = "Qwen2.5-Coder-0.5B-Instruct, LoRA rank 16 (alpha 32, lr 1e-4)"
PRESETS = ("game", "countdown", "python_tool", "program_tool")
STUDY = ca.Study({p: ca.Recipe(QWEN, WHY, preset=p) for p in PRESETS}, "qwen", "bench/bench_qwen.py")


if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--marks" or a.startswith("--marks=") for a in argv):
        argv += ["--marks", "20,40,60"]
    raise SystemExit(ca.main(argv, STUDY))
