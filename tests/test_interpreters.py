"""The learner starts under every Python the pyproject admits.

On Python 3.12.3+ and 3.13, the standard library's LazyLoader recurses when a package's submodules delete
attributes of the half-loaded parent, as torch's do (found on a GPU machine: the learner did not start under
3.12.3). finetune/lazy.py must not rely on it. The project's environment has one interpreter; the others
installed on the machine get the same scenario with a package that does what torch does, so the check needs
no torch for them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCENARIO = """
import sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {pkgs!r})
from finetune.lazy import lazy_import
parent = lazy_import("torchlike")
assert "torchlike" not in sys.modules, "nothing loads before first use"
assert parent.x == 1
import torchlike  # a plain import afterwards gets the same, fully loaded module
assert torchlike.sub.y == 1 and not hasattr(torchlike, "helper")
print("ok")
"""


def admitted_minors() -> list[int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    low = int(re.search(r">=\s*3\.(\d+)", spec).group(1))
    high = int(re.search(r"<\s*3\.(\d+)", spec).group(1))
    return list(range(low, high))


def find_interpreter(minor: int) -> str | None:
    """One of pyenv's (these machines keep 3.12 and 3.13 there), else one on PATH; nothing is downloaded."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [str(p) for p in sorted(pyenv.glob(f"3.{minor}.*/bin/python"), reverse=True)]
    candidates += [p for p in [shutil.which(f"python3.{minor}")] if p]
    for python in candidates:  # a pyenv shim on PATH may name a version that is not installed
        if subprocess.run([python, "-c", "pass"], capture_output=True, timeout=60).returncode == 0:
            return python
    return None


@pytest.fixture
def torchlike(tmp_path: Path) -> Path:
    pkg = tmp_path / "torchlike"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("x = 1\ndef helper(): return 2\nfrom torchlike import sub\n")
    (pkg / "sub.py").write_text("import torchlike\ny = torchlike.x\ndel torchlike.helper\n")
    return tmp_path


@pytest.mark.parametrize("minor", admitted_minors())
def test_lazy_import_under_each_admitted_python(minor: int, torchlike: Path) -> None:
    python = sys.executable if sys.version_info[:2] == (3, minor) else find_interpreter(minor)
    if python is None:
        pytest.skip(f"no Python 3.{minor} installed on this machine")
    code = SCENARIO.format(root=str(ROOT), pkgs=str(torchlike))
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_learner_modules_import_torch_for_real() -> None:
    """In the project's interpreter: the lazy stand-ins hand over the real torch, and transformers imports after."""
    code = (
        "import finetune.losses as L, finetune.estimators as E, sys\n"
        "t = L.torch.zeros(2)\n"
        "import transformers, torch\n"
        "assert E.torch.ones(1).item() == 1.0 and sys.modules['torch'] is torch\n"
        "print(type(t).__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "Tensor", out.stderr[-2000:]
