"""Math problems as one-turn environments: `math:arithmetic` (procedural) and `math:gsm8k`.

reset(seed) poses problem number `seed` of the split; step(answer_text) scores
the last `\\boxed{}` of the text against the gold answer with math-verify
(+1 correct, 0 wrong, -1 no box) and ends the episode. The problems and the
train / test separation are those of `agents.tasks` (a hash of the problem
text for arithmetic, the data set's own splits for GSM8K).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agents.envs.base import shuffled_passes
from agents.envs.registry import register
from agents.rewards import last_boxed, math_reward
from agents.tasks import Arithmetic, ArithmeticConfig, Task, load_gsm8k


class MathEnv:
    """One problem per episode; the answer is scored and the episode ends."""

    def __init__(self, problem_at, test_size: int | None = None):
        self._problem_at = problem_at  # seed -> Task
        self.test_size = test_size
        self.task: Task | None = None

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.task = self._problem_at(0 if seed is None else int(seed))
        return self.task.question, {"task_id": self.task.id, "answer": self.task.answer}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.task is None:
            raise RuntimeError("step() before reset()")
        reward = math_reward(action, self.task.answer)
        info = {
            "success": reward.value > 0,
            "format_error": reward.reason.startswith("no "),
            "reason": reward.reason,
            "answer": (last_boxed(action) or "").strip(),
        }  # what it answered: majority votes compare these
        return "", reward.value, True, False, info


class _Stream:
    """Problems of a split by number, drawn once and kept (a run asks for each several times)."""

    def __init__(self, draw):
        self._draw = draw  # (start, count) -> list[Task]
        self._items: list[Task] = []

    def __call__(self, index: int) -> Task:
        if index >= len(self._items):
            want = max(index + 1, 2 * len(self._items), 64)
            self._items += self._draw(len(self._items), want - len(self._items))
        return self._items[index]


class ArithmeticOptions(ArithmeticConfig):
    model_config = ConfigDict(extra="forbid")


@lru_cache(maxsize=16)
def _arithmetic_stream(options_json: str, split: str, run_seed: int) -> _Stream:
    source = Arithmetic(ArithmeticConfig.model_validate_json(options_json), seed=run_seed)
    if split == "train":
        return _Stream(source.train)
    return _Stream(lambda start, count: source.test_set(start + count)[start:])


@register("math:arithmetic", ArithmeticOptions, "procedural arithmetic (digits, operands, operations); one turn")
def make_arithmetic(options: ArithmeticOptions, split: str, run_seed: int) -> MathEnv:
    return MathEnv(_arithmetic_stream(options.model_dump_json(), split, run_seed), test_size=500)


class Gsm8kOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    train: str = Field("openai/gsm8k", description="train split: hub id or a local .jsonl/.json/.parquet file")
    test: str = Field("openai/gsm8k", description="test split: hub id or a local .jsonl/.json/.parquet file")

    @field_validator("train", "test")
    @classmethod
    def _local_file_exists(cls, value: str) -> str:
        from pathlib import Path

        if value.endswith((".jsonl", ".json", ".parquet")) and not Path(value).expanduser().is_file():
            raise ValueError(f"file {value} does not exist")
        return value


@lru_cache(maxsize=4)
def _gsm8k(source: str, split: str) -> tuple[Task, ...]:
    return tuple(load_gsm8k(source, split))


@register("math:gsm8k", Gsm8kOptions, "GSM8K grade-school math (hub or local file); one turn")
def make_gsm8k(options: Gsm8kOptions, split: str, run_seed: int) -> MathEnv:
    if split == "test":
        tasks = _gsm8k(options.test, "test")
        return MathEnv(lambda i: tasks[i % len(tasks)], test_size=len(tasks))
    train = _gsm8k(options.train, "train")
    index_at = shuffled_passes(len(train), run_seed)  # a reshuffled pass over the train split per epoch
    return MathEnv(lambda position: train[index_at(position)])
