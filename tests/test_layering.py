r"""The layering rules (README.md, "Layout"), checked on the source: every module's imports, parsed (ast).

    tapes  <-  agents  <-  orchestrate  --(subprocess, files)-->  finetune
                                 \                                /
                                  '-------->  contract  <--------'

tapes is the bottom layer and imports nothing of ours; agents builds on tapes only; contract (what the two
processes share: the run directory's names, the batch format, durable writes, the command-line generator,
KL) imports nothing of ours; finetune uses contract only (it runs as its own process); orchestrate may use
all of them; nothing imports orchestrate (tests and bench may). Imports inside functions and under `if TYPE_CHECKING` count too: a
lazy import is still an edge.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tapes", "contract", "agents", "orchestrate", "finetune")

# What each package may import of ours (itself always).
ALLOWED = {
    "tapes": set(),
    "contract": set(),
    "agents": {"tapes"},
    "finetune": {"contract"},
    "orchestrate": {"tapes", "contract", "agents", "finetune"},
}


def imported_packages(source: str, own: str) -> set[tuple[int, str]]:
    """(line, top-level package) for each of our packages that `source` imports: `import x`, `from x import`,
    and importlib.import_module("x...") with a literal (or f-string) name; relative imports are `own`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [own] if node.level else [node.module or ""]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                arg = arg.values[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names = [arg.value]
        for name in names:
            top = name.split(".")[0]
            if top in PACKAGES:
                found.add((node.lineno, top))
    return found


def test_the_checker_sees_every_kind_of_import():
    source = (
        "import tapes.tape\n"
        "from contract.kl import k3\n"
        "def f():\n"
        "    from orchestrate import loop\n"
        "    import importlib\n"
        "    importlib.import_module(f'agents.envs.{name}')\n"
        "from . import sibling\n"
        "import torch, json\n"
    )
    assert imported_packages(source, own="tapes") == {
        (1, "tapes"), (2, "contract"), (4, "orchestrate"), (6, "agents"), (7, "tapes")}  # fmt: skip


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_flow_one_way(package):
    """A package imports only what its layer may: a back-edge names the file and line to move."""
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules under {package}/"
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {top}"
        for path in files
        for line, top in sorted(imported_packages(path.read_text(encoding="utf-8"), own=package))
        if top != package and top not in ALLOWED[package]
    ]
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package]) or 'nothing of ours'}: " + "; ".join(wrong)


def test_every_package_is_covered():
    """A new top-level package needs its rule here before it can be imported from."""
    ours = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert ours == set(PACKAGES), f"packages without a layering rule: {sorted(ours - set(PACKAGES))}"


def test_reading_the_options_loads_no_torch():
    """Every command line reads the option registries (losses, estimators); `--help` and a bad option refused
    in one line must not wait seconds for torch (finetune/lazy.py)."""
    code = "import sys, orchestrate.config, finetune.config; print('torch._C' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
