"""`gem:ID`: any GEM environment (axon-rl/gem, the optional `gem` extra) behind our protocol.

    uv sync --extra gem
    --env.id gem:game:GuessTheNumber-v0-easy

GEM's protocol is ours, so the adapter is thin: `gem.make(ID, **options)`,
`reset(seed=episode_seed(run_seed, split, seed, salt=ID))`, `step` passed
through with the info made JSON-safe. What it adds:

- success: GEM's own `success` / `correct` flag when its info has one;
  otherwise the last reward is positive and the episode was not truncated.
  GEM's games end a game that ran out of turns with terminated=True,
  truncated=True and, in GuessTheNumber, a reward of up to 0.9 for a close
  last guess: "last reward > 0" alone would count such a lost game as won.
- determinism under interleaving: GEM environments draw from Python's and
  NumPy's global random generators (reset(seed) reseeds them). The loop
  plays many episodes at once in one process, so each environment here gets
  its own generator states, swapped in around its own calls and out after,
  and the process's global generators are left as they were.
- importing gem calls `logging.basicConfig(level=INFO)`; the root logger is
  put back as it was.

Its games and reasoning-gym environments run offline; its math, QA and code
environments load their data from a hub when built.
"""

from __future__ import annotations

import difflib
import logging
import random
import threading
from typing import Any

from pydantic import BaseModel

from agents.envs.base import EnvError, episode_seed, jsonable
from agents.envs.registry import EnvEntry, FreeOptions, register_prefix

_RNG_LOCK = threading.Lock()  # the global generators are one per process


def _import_gem():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import gem
        from gem.envs.registration import ENV_REGISTRY
    finally:
        root.handlers[:] = handlers  # gem's __init__ calls logging.basicConfig(level=INFO)
        root.setLevel(level)
    return gem, ENV_REGISTRY


class _OwnRandom:
    """Python's and NumPy's global random states for one environment, swapped in while it runs."""

    def __init__(self, seed: int):
        import numpy as np

        with _RNG_LOCK:
            saved = random.getstate(), np.random.get_state()
            random.seed(seed)
            np.random.seed(seed)
            self.state = random.getstate(), np.random.get_state()
            random.setstate(saved[0])
            np.random.set_state(saved[1])

    def __enter__(self) -> _OwnRandom:
        import numpy as np

        _RNG_LOCK.acquire()
        self._saved = random.getstate(), np.random.get_state()
        random.setstate(self.state[0])
        np.random.set_state(self.state[1])
        return self

    def __exit__(self, *exc) -> None:
        import numpy as np

        self.state = random.getstate(), np.random.get_state()
        random.setstate(self._saved[0])
        np.random.set_state(self._saved[1])
        _RNG_LOCK.release()


class GemEnv:
    """A GEM environment with seeds from the run, JSON-safe infos and a `success` flag."""

    def __init__(self, gem_id: str, kwargs: dict[str, Any], split: str, run_seed: int):
        gem, _ = _import_gem()
        self.gem_id, self.split, self.run_seed = gem_id, split, run_seed
        self.test_size: int | None = None
        self._random = _OwnRandom(episode_seed(run_seed, split, -1, salt=gem_id))
        with self._random:  # GEM environments often reset() once, unseeded, when built
            self.env = gem.make(gem_id, **kwargs)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        seed = episode_seed(self.run_seed, self.split, 0 if seed is None else int(seed), salt=self.gem_id)
        self._random = _OwnRandom(seed)
        with self._random:
            observation, info = self.env.reset(seed=seed)
        return _text(observation), {**jsonable(dict(info or {})), "gem_seed": seed}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        with self._random:
            observation, reward, terminated, truncated, info = self.env.step(action)
        reward, terminated, truncated = float(reward), bool(terminated), bool(truncated)
        info = jsonable(dict(info or {}))
        own = next((info[k] for k in ("success", "correct") if isinstance(info.get(k), bool)), None)
        info["success"] = own if own is not None else (reward > 0 and not truncated)
        return _text(observation), reward, terminated, truncated, info


def _text(observation: Any) -> str:
    return observation if isinstance(observation, str) else str(jsonable(observation))


def _resolve(gem_id: str) -> EnvEntry:
    try:
        _, registry = _import_gem()
    except ImportError as exc:
        raise EnvError(f"gem:{gem_id} needs the gem extra: uv sync --extra gem ({exc})") from None
    if gem_id not in registry:
        close = difflib.get_close_matches(gem_id, registry, n=3, cutoff=0.5)
        games = sorted(k for k in registry if k.startswith("game:"))
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise EnvError(f"unknown GEM environment {gem_id!r}: {hint}{len(registry)} are registered, "
                       f"games: {', '.join(games)}")  # fmt: skip

    def factory(options: BaseModel, split: str, run_seed: int) -> GemEnv:
        return GemEnv(gem_id, options.model_dump(), split, run_seed)

    return EnvEntry(f"gem:{gem_id}", FreeOptions, factory, f"GEM environment {gem_id} (options: gem.make kwargs)")


register_prefix("gem:", _resolve)
