"""Import a module on first use.

The option registries (finetune.config) live beside the tensor code of the losses and estimators, and
every command line reads them: `python -m orchestrate.rl --help`, or a bad option refused in one line,
would otherwise wait seconds for torch to load without touching a tensor.

The returned object is a stand-in that imports the real module (an ordinary `importlib.import_module`) on
its first attribute access. It is never placed in sys.modules: the standard library's LazyLoader recipe,
which does that, recurses on Python 3.12.3+ and 3.13 once `torch/__init__.py` deletes attributes of the
half-loaded module (measured with torch 2.11 and 2.13), so a later plain `import torch` must find either
nothing or the real module.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any


class _LazyModule:
    __slots__ = ("_name", "_module")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        state = "loaded" if self._module is not None else "not loaded yet"
        return f"<lazy module {self._name!r} ({state})>"


def lazy_import(name: str) -> Any:
    """A stand-in for module `name` that imports it on first attribute access; a missing module fails now."""
    if importlib.util.find_spec(name) is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    return _LazyModule(name)
