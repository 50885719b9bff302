"""No product class over 300 lines: a class that long holds more than one job (Servers held the pool and the
weight swaps, VLLMServer the process and the requests); split it along a seam, as those were split."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agents", "orchestrate", "finetune", "contract", "tapes")
LIMIT = 300


def long_classes(source: str, limit: int = LIMIT) -> list[tuple[str, int]]:
    """(name, lines) of each class in `source`, nested ones too, longer than `limit` lines (its decorators in)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if (lines := node.end_lineno - start + 1) > limit:
                found.append((node.name, lines))
    return found


def test_the_checker_measures_a_class_from_its_decorators_to_its_last_line():
    body = "\n".join(f"    x{i} = {i}" for i in range(299))
    assert long_classes(f"class Short:\n{body}\n") == []  # 300 lines
    assert long_classes(f"@dataclass\nclass Long:\n{body}\n") == [("Long", 301)]
    nested = "def f():\n    class Inner:\n" + "".join(f"        x{i} = {i}\n" for i in range(300))
    assert long_classes(nested) == [("Inner", 301)]  # inside a function too


def test_no_class_is_longer_than_300_lines():
    wrong = [
        f"{path.relative_to(ROOT)}: {name} ({lines} lines)"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for name, lines in long_classes(path.read_text(encoding="utf-8"))
    ]
    assert not wrong, f"classes over {LIMIT} lines (split each along a seam): " + "; ".join(wrong)
