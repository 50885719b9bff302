"""The environment protocol: GEM's (axon-rl/gem `gem/core.py`), so a GEM environment plugs in unchanged.

    observation, info = env.reset(seed)
    observation, reward, terminated, truncated, info = env.step(action_text)

An environment is seeded and deterministic given its seed and the actions it
is sent: a tape records the environment id, its options, the split, the run
seed and the episode seed, so replaying the recorded actions against a fresh
environment gives the same observations and rewards back.

Seeds. The loop asks for episode `seed = k` of a split ("train" or "test"):
train episodes are numbered 0, 1, 2, ... over the run, the held-out set is
episodes 0 .. n-1 of the test split. An environment is built knowing its
split and the run's seed (`make(options, split, run_seed)`), and keeps its
train and test episodes apart however it can (a data set's own splits, a
hash of the problem, disjoint seed ranges); `episode_seed` mixes the three
into one integer for environments that take a plain random seed.

What the loop reads from `info` (all optional):
- `success` (bool, on the last step): the episode solved its task. Without
  it, success is "the last reward was positive".
- `format_error` (bool): the action could not be parsed (no `\\boxed{}`, ...).
- anything else JSON-serialisable is kept on the tape as it is.

An environment may also say how many distinct held-out episodes it has
(`test_size`, None: as many as asked for). Exceptions raised by an
environment are infrastructure failures: the episode is flagged on its tape
and left out of training and of group statistics, never scored as wrong.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Env(Protocol):
    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]: ...


class EnvError(ValueError):
    """A bad environment id or options; the message is one line naming what is wrong."""


def episode_seed(run_seed: int, split: str, seed: int, salt: str = "") -> int:
    """One 31-bit seed from (run seed, split, episode number): stable across runs and Python versions."""
    digest = hashlib.sha256(f"{salt}|{run_seed}|{split}|{seed}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def shuffled_passes(size: int, run_seed: int) -> Callable[[int], int]:
    """Train episode number -> item index for a data set of `size` items: one pass over all of them per
    epoch, in a fresh order per epoch seeded by the run seed."""
    orders: dict[int, list[int]] = {}

    def index_at(position: int) -> int:
        epoch, index = divmod(position, size)
        if epoch not in orders:
            order = list(range(size))
            random.Random(f"{run_seed}-{epoch}").shuffle(order)
            orders[epoch] = order
        return orders[epoch][index]

    return index_at


def jsonable(value: Any) -> Any:
    """`value` with everything that is not JSON turned into text (infos reach the tape)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    try:  # numpy scalars
        return value.item()
    except Exception:
        return repr(value)
