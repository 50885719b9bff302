"""Task sources: GSM8K, and procedural arithmetic for the embedded default.

A task is a question with a gold answer. A source gives a train stream and a
held-out test set that never overlap.

- GSM8K comes through `datasets`: the hub id `openai/gsm8k` by default, or a
  local .jsonl / .json / .parquet file with `question` and `answer` fields
  (the gold answer is the number after `####`, commas removed).
- Arithmetic is generated offline from a seed, reproducibly. Each problem is
  assigned to train or test by a hash of its text, so the two never overlap
  whatever the seed or the number drawn.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field


class Task(BaseModel):
    id: str
    question: str
    answer: str = Field(description="gold answer, as text")
    data: dict[str, Any] = Field(default_factory=dict)


class TaskSourceError(ValueError):
    pass


# -- GSM8K -------------------------------------------------------------------


def gsm8k_gold(answer: str) -> str:
    if "####" not in answer:
        raise TaskSourceError(f"GSM8K answer without '####': {answer[-80:]!r}")
    return answer.split("####")[-1].strip().replace(",", "")


def load_gsm8k(source: str, split: str) -> list[Task]:
    """GSM8K `split` from a hub id or a local file."""
    import datasets

    path = Path(source).expanduser()
    if path.suffix in (".jsonl", ".json", ".parquet"):
        if not path.is_file():
            raise TaskSourceError(f"GSM8K file {path} does not exist")
        kind = "parquet" if path.suffix == ".parquet" else "json"
        rows = datasets.load_dataset(kind, data_files=str(path), split="train")
    else:
        try:
            rows = datasets.load_dataset(source, "main", split=split)
        except Exception as exc:
            raise TaskSourceError(
                f"could not load {source!r} split {split!r} from the Hugging Face hub ({type(exc).__name__}). "
                "Without hub access, pass a local .jsonl/.parquet file with 'question' and 'answer' fields."
            ) from exc
    missing = {"question", "answer"} - set(rows.column_names)
    if missing:
        raise TaskSourceError(f"{source}: missing fields {sorted(missing)} (has {rows.column_names})")
    return [
        Task(id=f"gsm8k-{split}-{i}", question=row["question"], answer=gsm8k_gold(row["answer"]))
        for i, row in enumerate(rows)
    ]


# -- procedural arithmetic -----------------------------------------------------


class ArithmeticConfig(BaseModel):
    digits: int = Field(2, ge=1, le=9, description="digits per operand")
    operands: int = Field(2, ge=2, le=6, description="numbers per problem")
    operations: list[Literal["+", "-", "*"]] = Field(
        default_factory=lambda: ["+"], min_length=1, description='operators to draw from, e.g. ["+", "*"]'
    )
    test_fraction: float = Field(0.1, gt=0, lt=1, description="share of all problems reserved for the test set")


class Arithmetic:
    """Seeded arithmetic problems; `train(i)` and `test_set(n)` never share a problem."""

    def __init__(self, config: ArithmeticConfig | None = None, seed: int = 0):
        self.config = config or ArithmeticConfig()
        self.seed = seed

    def _is_test(self, question: str) -> bool:
        digest = hashlib.sha256(question.encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.config.test_fraction

    def _draw(self, rng: random.Random) -> Task:
        c = self.config
        low, high = 10 ** (c.digits - 1) if c.digits > 1 else 0, 10**c.digits - 1
        numbers = [rng.randint(low, high) for _ in range(c.operands)]
        ops = [rng.choice(c.operations) for _ in range(c.operands - 1)]
        expression = str(numbers[0]) + "".join(f" {op} {n}" for op, n in zip(ops, numbers[1:]))
        value = eval(expression, {"__builtins__": {}})  # our own digits and + - * only
        question = f"What is {expression}?"
        return Task(id="", question=question, answer=str(value), data={"expression": expression})

    def _stream(self, split: str, start: int):
        rng = random.Random(f"{self.seed}-{split}")
        index, seen, fruitless = 0, set(), 0
        while True:
            task = self._draw(rng)
            fruitless += 1
            if split == "test" and fruitless > 20_000:  # every held-out problem of these options was drawn
                raise TaskSourceError(
                    f"these arithmetic options have only {len(seen)} distinct held-out "
                    f"problems; evaluate on at most that many (--eval.tasks {len(seen)})"
                )
            if split == "test" and task.question in seen:
                continue  # a test set of distinct problems; train may repeat
            if self._is_test(task.question) == (split == "test"):
                seen.add(task.question)
                fruitless = 0
                if index >= start:
                    yield task.model_copy(update={"id": f"arith-{split}-{self.seed}-{index}"})
                index += 1

    def train(self, start: int, count: int) -> list[Task]:
        """Train tasks number start .. start+count-1 of this seed's stream."""
        stream = self._stream("train", start)
        return [next(stream) for _ in range(count)]

    def test_set(self, count: int | None) -> list[Task]:
        """The first `count` distinct held-out problems (None: 500)."""
        stream = self._stream("test", 0)
        return [next(stream) for _ in range(500 if count is None else count)]
