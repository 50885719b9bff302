"""Question answering: `--env.id qa`, one question per episode from a local file, answered in `\\boxed{}`.

The questions are JSON lines: `{"question": ..., "answer": "Paris"}` (or a
list of accepted answers, `"answer": ["NYC", "New York City"]`), with an
optional `"id"`. The answer is the last `\\boxed{}` of the agent's output,
scored against each accepted answer after HotpotQA's normalisation (lower
case, no punctuation, no articles, single spaces): exact match and token F1,
the best over the accepted answers (`agents.rewards.qa_scores`). The reward
is the exact match (0 or 1) or the F1 (`reward`), `reward_format_error`
without a `\\boxed{}`; success is an exact match. One answer ends the episode.

Pair it with the search tool (`--env.tools search --env.search.corpus
passages.jsonl`) to let the agent look things up before it answers; the
environment itself knows nothing of the corpus.

Train and test are kept apart by a hash of the question text: a question is
held out when its hash falls in the first `test_fraction` of the range, so
the same question is never on both sides (duplicates included) and adding
questions does not move the others. Test episode k is held-out question k
(in file order; `test_size` of them); train episodes take a reshuffled pass
over the train questions per epoch, seeded by the run seed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agents.envs.base import EnvError, shuffled_passes
from agents.envs.registry import register
from agents.rewards import last_boxed, qa_scores


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    answers: tuple[str, ...]


class QAOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    questions: str = Field(description="JSON lines, one question per line: 'question', 'answer' (a string or a "
                           "list of accepted strings), optional 'id'")  # fmt: skip
    reward: Literal["em", "f1"] = Field("em", description="em: 1 for an exact match (after normalisation), else 0; "
                                        "f1: the token F1 with the best accepted answer")  # fmt: skip
    reward_format_error: float = Field(-0.1, allow_inf_nan=False, description="reward of an output with no \\boxed{}")
    test_fraction: float = Field(0.1, gt=0, lt=1, description="share of the questions held out for evaluation "
                                 "(chosen by a hash of the question text)")  # fmt: skip

    @field_validator("questions")
    @classmethod
    def _file_exists(cls, value: str) -> str:
        if not Path(value).expanduser().is_file():
            raise ValueError(f"file {value} does not exist; give a JSON lines file of questions")
        return value


def read_questions(path: str | Path) -> tuple[Question, ...]:
    """Every question of the file, in order; EnvError naming the file (and line) for one that cannot be used."""
    path = Path(path).expanduser()
    try:
        stat = path.stat()
    except OSError as exc:
        raise EnvError(f"{path}: {exc.strerror or exc}") from None
    return _read_questions(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=8)
def _read_questions(path: str, size: int, mtime_ns: int) -> tuple[Question, ...]:
    questions = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path} line {number}"
                try:
                    row = json.loads(line)
                except ValueError:
                    raise EnvError(f"{where}: not JSON; one question per line, "
                                   '{"question": ..., "answer": ...}') from None  # fmt: skip
                if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not row["question"].strip():
                    raise EnvError(f"{where}: a question needs a 'question' string")
                answer = row.get("answer")
                answers = [answer] if isinstance(answer, str) else answer
                if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip()
                                                                           for a in answers):  # fmt: skip
                    raise EnvError(f"{where}: 'answer' must be a string or a list of strings, not {answer!r}")
                questions.append(Question(str(row.get("id", number)), row["question"].strip(), tuple(answers)))
    except (OSError, UnicodeDecodeError) as exc:
        raise EnvError(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not questions:
        raise EnvError(f"{path} holds no questions")
    return tuple(questions)


def is_held_out(question: str, test_fraction: float) -> bool:
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:8], "big") < test_fraction * 2**64


class QAEnv:
    """One question per episode; the boxed answer is scored and the episode ends."""

    def __init__(self, options: QAOptions, questions: tuple[Question, ...], question_at, test_size: int | None):
        self.options = options
        self.questions = questions
        self._question_at = question_at  # episode seed -> Question
        self.test_size = test_size
        self.question: Question | None = None

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.question = self._question_at(0 if seed is None else int(seed))
        q = self.question
        observation = f"{q.question}\nGive the answer as a short phrase in \\boxed{{}}."
        return observation, {"task_id": q.id, "answers": list(q.answers)}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.question is None:
            raise RuntimeError("step() before reset()")
        answer = last_boxed(action)
        if not answer:
            info = {"success": False, "format_error": True, "em": 0.0, "f1": 0.0, "reason": "no \\boxed{} answer"}
            return "", self.options.reward_format_error, True, False, info
        em, f1 = qa_scores(answer, list(self.question.answers))
        reason = "correct" if em else f"wrong: {answer!r} (f1 {f1:.2f}; accepted: {list(self.question.answers)!r})"
        info = {"success": em == 1.0, "format_error": False, "em": em, "f1": f1, "answer": answer, "reason": reason}
        return "", em if self.options.reward == "em" else f1, True, False, info


@register("qa", QAOptions, "question answering from a local JSON lines file, answered in \\boxed{} (exact match or "
          "F1); with --env.tools search, over a local corpus")  # fmt: skip
def make_qa(options: QAOptions, split: str, run_seed: int) -> QAEnv:
    everything = read_questions(options.questions)
    mine = tuple(q for q in everything if is_held_out(q.question, options.test_fraction) == (split == "test"))
    if not mine:
        side = "held-out" if split == "test" else "train"
        raise EnvError(f"options.test_fraction: no {side} question among the {len(everything)} of "
                       f"{options.questions}; change test_fraction or add questions")  # fmt: skip
    if split == "test":
        return QAEnv(options, mine, lambda i: mine[i % len(mine)], test_size=len(mine))
    index_at = shuffled_passes(len(mine), run_seed)
    return QAEnv(options, mine, lambda position: mine[index_at(position)], test_size=None)
