"""Import a module on first use (the standard library's importlib.util.LazyLoader recipe).

The option registries (finetune.config) live beside the tensor code of the losses and estimators, and
every command line reads them: `python -m orchestrate.rl --help`, or a bad option refused in one line,
would otherwise wait seconds for torch to load without touching a tensor. A module imported here is
registered in sys.modules as itself, so a later plain `import torch` anywhere gets the same module, loaded
on its first attribute access.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lazy_import(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module
