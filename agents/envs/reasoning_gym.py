"""`rg:NAME`: any reasoning-gym data set (procedural, offline) as a one-turn environment.

    --env.id rg:basic_arithmetic --env.options.min_terms 3

The options are the data set's own config fields (each checked against its
type and the data set's `validate()` when the config is checked, so a bad
one is refused before anything starts), plus `size` and `test_size`. The
data set's `seed` is not an option: the train and test splits are two data
sets seeded from the run seed (`episode_seed(run_seed, split, 0)`), and
episode `seed` is entry `seed mod size` of its split's data set. Train
entries whose question is also a test question are skipped, so the splits
never share a question even when a data set's problem space is small.

reset(seed) gives the question and asks for the answer in `\\boxed{}`;
step(text) scores the last `\\boxed{}` (or, without one, the whole text) with
the data set's own `score_answer(answer, entry)`: the reward is that score
(0..1; some data sets give partial credit), success is a score of 1.

Importing reasoning-gym takes a few seconds (sympy, matplotlib): it happens
when an `rg:` id is first resolved, never for other environments.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from agents.envs.base import EnvError, episode_seed, jsonable
from agents.envs.registry import EnvEntry, register_prefix
from agents.rewards import last_boxed

INSTRUCTION = "Put your final answer in \\boxed{}."
_OURS = {"size", "test_size"}  # options that are not passed to the data set's config as they are


def _datasets() -> dict[str, tuple[type, type]]:
    import logging

    logging.getLogger("reasoning_gym").setLevel(logging.WARNING)
    from reasoning_gym.factory import DATASETS

    return DATASETS


@cache
def _options_model(name: str) -> type[BaseModel]:
    """An options model made from data set `name`'s config dataclass: one field per config field."""
    config_cls = _datasets()[name][1]
    hints = typing.get_type_hints(config_cls)
    fields: dict[str, Any] = {
        "size": (int, Field(10_000, ge=1, description="train problems: episode seeds wrap around after this many")),
        "test_size": (int, Field(500, ge=1, description="held-out problems (the test split's data set size)")),
    }
    for f in dataclasses.fields(config_cls):
        if f.name in ("seed", "size"):
            continue
        if f.default is not dataclasses.MISSING:
            default = Field(f.default, description=f"reasoning-gym {name} config field (default {f.default!r})")
        elif f.default_factory is not dataclasses.MISSING:
            default = Field(default_factory=f.default_factory, description=f"reasoning-gym {name} config field")
        else:
            default = Field(..., description=f"reasoning-gym {name} config field (required)")
        fields[f.name] = (hints.get(f.name, Any), default)

    def no_seed(values: Any) -> Any:
        if isinstance(values, dict) and "seed" in values:
            raise ValueError("seed is not an option: the data sets are seeded from the run's seed (and the split)")
        return values

    def check_config(self: BaseModel) -> BaseModel:
        try:
            config = config_cls(**_config_kwargs(self), seed=0, size=1)
            if hasattr(config, "validate"):
                config.validate()
        except Exception as exc:  # the data set's own checks are asserts, TypeErrors, ValueErrors
            raise ValueError(f"reasoning-gym {name} refuses these options: {type(exc).__name__}: {exc}") from None
        return self

    return create_model(
        f"RgOptions_{name}",
        __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=True),
        __validators__={
            "no_seed": model_validator(mode="before")(no_seed),
            "check_config": model_validator(mode="after")(check_config),
        },
        **fields,
    )


def _config_kwargs(options: BaseModel) -> dict[str, Any]:
    """The options set by the user, as validated (not dumped: config fields may hold dataclasses)."""
    return {k: getattr(options, k) for k in options.model_fields_set if k not in _OURS}


class ReasoningGymData:
    """One split's data set, and for the train split the entries it skips because the test split has them."""

    def __init__(
        self, name: str, kwargs: dict[str, Any], split: str, run_seed: int, size: int, test: ReasoningGymData | None
    ):
        import reasoning_gym

        self.name, self.size = name, size
        self.dataset = reasoning_gym.create_dataset(
            name, seed=episode_seed(run_seed, split, 0, salt=f"rg:{name}"), size=size, **kwargs
        )
        self._test_questions: set[str] | None = None
        self._test = test
        self._cache: dict[int, dict[str, Any]] = {}

    def entry(self, index: int) -> dict[str, Any]:
        index %= self.size
        if index not in self._cache:
            self._cache[index] = self.dataset[index]
        return self._cache[index]

    def train_entry(self, seed: int) -> dict[str, Any]:
        """Entry `seed` of the train data set, moved on past questions that the test data set holds."""
        if self._test is None:
            return self.entry(seed)
        if self._test_questions is None:
            self._test_questions = {self._test.entry(i)["question"] for i in range(self._test.size)}
        for step in range(self.size):
            candidate = self.entry(seed + step)
            if candidate["question"] not in self._test_questions:
                return candidate
        raise EnvError(f"rg:{self.name}: every train question is also a test question; widen the data set's "
                       f"options or lower test_size")  # fmt: skip


_DATA: dict[tuple[str, str, str, int], ReasoningGymData] = {}


def _data(name: str, options: BaseModel, split: str, run_seed: int) -> ReasoningGymData:
    """The data set of a split, built once per process (the loop makes an environment per episode)."""
    key = (name, json.dumps(jsonable(options.model_dump(exclude_unset=True)), sort_keys=True), split, run_seed)
    if key not in _DATA:
        if len(_DATA) >= 32:
            _DATA.clear()
        kwargs = _config_kwargs(options)
        if split == "test":
            _DATA[key] = ReasoningGymData(name, kwargs, "test", run_seed, options.test_size, None)
        else:
            test = _data(name, options, "test", run_seed)
            _DATA[key] = ReasoningGymData(name, kwargs, "train", run_seed, options.size, test)
    return _DATA[key]


class ReasoningGymEnv:
    """One entry per episode, scored by the data set's own verifier; one turn."""

    def __init__(self, data: ReasoningGymData, split: str, test_size: int):
        self.data, self.split = data, split
        self.test_size: int | None = test_size
        self.item: dict[str, Any] | None = None

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        seed = 0 if seed is None else int(seed)
        self.item = self.data.entry(seed) if self.split == "test" else self.data.train_entry(seed)
        info = jsonable({"answer": self.item.get("answer"), "metadata": self.item.get("metadata", {})})
        return f"{self.item['question']}\n\n{INSTRUCTION}", info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.item is None:
            raise RuntimeError("step() before reset()")
        boxed = last_boxed(action)
        answer = boxed if boxed is not None else action.strip()
        info: dict[str, Any] = {"format_error": boxed is None, "answer": answer}
        try:
            score = float(self.data.dataset.score_answer(answer, self.item))
        except Exception as exc:  # the data set's verifier choked on the model's text: a wrong answer
            score, info["reason"] = 0.0, f"the verifier raised {type(exc).__name__}: {exc}"
        info["success"] = score >= 1.0
        info.setdefault("reason", "correct" if score >= 1.0 else f"score {score:.3g}")
        if boxed is None:
            info["reason"] = f"no \\boxed{{}} answer (whole text scored: {info['reason']})"
        return "", score, True, False, info


def _resolve(name: str) -> EnvEntry:
    try:
        datasets = _datasets()
    except ImportError as exc:
        raise EnvError(f"rg:{name} needs the reasoning-gym package ({exc}): run `uv sync`") from None
    if name not in datasets:
        close = difflib.get_close_matches(name, datasets, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise EnvError(f"unknown reasoning-gym data set {name!r}: {hint}known: {', '.join(sorted(datasets))}")
    model = _options_model(name)

    def factory(options: BaseModel, split: str, run_seed: int) -> ReasoningGymEnv:
        data = _data(name, options, split, run_seed)
        return ReasoningGymEnv(data, split, test_size=options.test_size)

    doc = (datasets[name][0].__doc__ or "").strip().splitlines()
    return EnvEntry(f"rg:{name}", model, factory, f"reasoning-gym {name}" + (f": {doc[0]}" if doc else ""))


register_prefix("rg:", _resolve)
