"""Countdown: make a target number from a few given numbers with + - * / and parentheses.

    Using the numbers [3, 7, 4], each exactly once, with + - * / and
    parentheses, make 25. Put the expression in \\boxed{}.

The answer is the last `\\boxed{}` of the output, checked by `verify_expression`:
a strict verifier that parses the expression with `ast.parse` and walks the
tree itself (never `eval`), computing exactly with fractions. The target is
made by combining the drawn numbers at random (integer intermediates only), so
every problem is solvable; the problem is a function of (run seed, split,
episode seed). Train and test problems are kept apart by a hash of the
problem: a tenth of all (numbers, target) pairs belongs to the test split.

With `answer="tags"` the framing of the single-file GRPO countdown work: reasoning in
<think> </think> tags, then the expression in <answer> </answer> tags; the last
<answer> is judged. Its format reward is the gap between `reward_wrong` (a
readable, wrong expression) and `reward_format_error` (none readable).

With `max_turns > 1` a wrong answer gets feedback ("Your expression equals
17, not 25. Try again.") and the episode goes on until it is solved or the
turns run out.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from collections import Counter
from fractions import Fraction
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agents.envs.base import episode_seed
from agents.envs.registry import register
from agents.rewards import last_boxed, last_tagged

MAX_ANSWER_CHARS = 200

# Accepted spellings of the operators, turned into Python's before parsing.
_SPELLINGS = [
    ("\\times", "*"), ("\\cdot", "*"), ("×", "*"), ("·", "*"), ("⋅", "*"), ("∗", "*"),
    ("\\div", "/"), ("÷", "/"), ("−", "-"), ("–", "-"),
    ("\\left(", "("), ("\\right)", ")"), ("\\left", ""), ("\\right", ""),
]  # fmt: skip
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/()\s]*")
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class Judgement(NamedTuple):
    ok: bool
    value: Fraction | None  # what the expression equals, when it could be computed
    reason: str
    format_error: bool  # not an allowed expression at all (as opposed to a wrong one)


class _Refused(Exception):
    """The text is not an allowed expression (a format error)."""


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of an allowed expression tree; the integer constants it uses go to `used`."""
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        return left / right  # ZeroDivisionError: the caller calls it a wrong answer
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        raise _Refused("unary signs are not allowed: the numbers are positive, use subtraction")
    if isinstance(node, ast.BinOp):
        raise _Refused(f"operator {type(node.op).__name__} is not allowed: only + - * /")
    if isinstance(node, ast.Constant):
        raise _Refused(f"{node.value!r} is not one of the given whole numbers")
    raise _Refused(f"{type(node).__name__} is not allowed: only numbers, + - * / and parentheses")


def judge_expression(text: str | None, numbers: list[int], target: int) -> Judgement:
    """`verify_expression` with one more field: whether the failure is a format error."""
    if text is None or not text.strip():
        return Judgement(False, None, "empty answer", True)
    if len(text) > MAX_ANSWER_CHARS:
        return Judgement(False, None, f"answer longer than {MAX_ANSWER_CHARS} characters", True)
    expression = text
    for spelling, op in _SPELLINGS:
        expression = expression.replace(spelling, op)
    expression = expression.strip().rstrip(".").strip()
    if expression.count("=") > 1:
        return Judgement(False, None, "more than one '='", True)
    if "=" in expression:
        expression, right = (part.strip() for part in expression.split("="))
        if right != str(target):
            return Judgement(False, None, f"the right side of '=' must be the target {target}, not {right!r}", True)
    if not _ALLOWED_CHARS.fullmatch(expression):
        bad = next(c for c in expression if not _ALLOWED_CHARS.fullmatch(c))
        return Judgement(False, None, f"character {bad!r} is not allowed: only digits, + - * / and parentheses", True)
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return Judgement(False, None, "not an arithmetic expression (check the parentheses)", True)
    used: list[int] = []
    try:
        value = _evaluate(tree.body, used)
    except _Refused as exc:
        return Judgement(False, None, str(exc), True)
    except ZeroDivisionError:
        return Judgement(False, None, "divides by zero", False)
    except RecursionError:
        return Judgement(False, None, "expression nested too deeply", True)
    missing, extra = Counter(numbers) - Counter(used), Counter(used) - Counter(numbers)
    if extra or missing:
        problems = []
        for n in sorted(extra):
            given = Counter(numbers)[n]
            problems.append(f"uses {n} {_times(used.count(n))} but it is given {_times(given)}" if given
                            else f"uses {n}, which is not given")  # fmt: skip
        problems += [f"does not use {n}" + (f" {_times(k)}" if k > 1 else "") for n, k in sorted(missing.items())]
        return Judgement(False, value, "; ".join(problems), False)
    if value != target:
        return Judgement(False, value, f"equals {_show(value)}, not {target}", False)
    return Judgement(True, value, "correct", False)


def verify_expression(text: str | None, numbers: list[int], target: int) -> tuple[bool, Fraction | None, str]:
    """Is `text` an expression that uses each of `numbers` exactly once and equals `target`?

    Returns (ok, value, reason); never raises and never evaluates code. Allowed:
    whole-number literals, binary + - * /, parentheses; division is exact (3/2
    stays 3/2, so (8/3)*3 is 8), and division by zero is a wrong answer.
    Refused: unary minus and plus (the numbers are positive: write `7 - 3`, not
    `-3 + 7`), `**`, `//`, `%`, decimals, names, calls, attributes, any other
    character, and texts longer than MAX_ANSWER_CHARS (before parsing).
    Accepted spellings: `\\times`, `\\cdot`, `×`, `·` for `*`; `\\div`, `÷` for `/`;
    `−` for `-`; `\\left(`/`\\right)`; a trailing period; and `EXPR = TARGET`
    (the right side must be the target itself: the left side is judged).
    """
    ok, value, reason, _ = judge_expression(text, numbers, target)
    return ok, value, reason


def _times(k: int) -> str:
    return {1: "once", 2: "twice"}.get(k, f"{k} times")


def _show(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


# -- problems ---------------------------------------------------------------------


class Problem(NamedTuple):
    numbers: list[int]
    target: int
    solution: str  # one expression that reaches the target


def _combine(rng: random.Random, numbers: list[int], max_target: int) -> tuple[int, str] | None:
    """A random expression using every number once, integer and positive at every step; None if it went astray."""
    items: list[tuple[int, str]] = [(n, str(n)) for n in numbers]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (a, ea), (b, eb) = items[i], items[j]
        ops = ["+", "-", "*", "/"]
        rng.shuffle(ops)
        for op in ops:
            if op == "+":
                value = a + b
            elif op == "*":
                value = a * b
            elif op == "-":
                (a, ea), (b, eb) = max((a, ea), (b, eb)), min((a, ea), (b, eb))
                value = a - b
            else:
                if b == 0 or a % b:
                    continue
                value = a // b
            if value > 0:
                break
        else:
            return None
        items = [x for k, x in enumerate(items) if k not in (i, j)] + [(value, f"{_paren(ea)} {op} {_paren(eb)}")]
    target, expression = items[0]
    return (target, expression) if 0 < target <= max_target else None


def _paren(expression: str) -> str:
    return expression if expression.isdigit() else f"({expression})"


def _is_test_problem(numbers: list[int], target: int) -> bool:
    key = f"{sorted(numbers)}|{target}".encode()
    return hashlib.sha256(key).digest()[0] % 10 == 0  # a tenth of the problems are held out


def make_problem(options: CountdownOptions, split: str, run_seed: int, seed: int) -> Problem:
    """Problem number `seed` of `split`: numbers drawn in [low, high], a target reachable from them."""
    rng = random.Random(episode_seed(run_seed, split, seed, salt="countdown"))
    fallback: Problem | None = None
    for _ in range(1000):
        numbers = [rng.randint(options.low, options.high) for _ in range(options.numbers)]
        made = None
        for _ in range(20):
            made = _combine(rng, numbers, options.max_target)
            if made is not None:
                break
        if made is None:
            continue
        problem = Problem(numbers, made[0], made[1])
        if _is_test_problem(numbers, made[0]) == (split == "test"):
            return problem
        fallback = fallback or problem
    # Tiny problem spaces may have no problem on one side of the hash: give a problem all the same.
    if fallback is not None:
        return fallback
    numbers = [rng.randint(options.low, options.high) for _ in range(options.numbers)]
    return Problem(numbers, sum(numbers), " + ".join(map(str, numbers)))  # max_target >= numbers * high


class CountdownOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    numbers: int = Field(3, ge=2, le=6, description="how many numbers are given (each must be used exactly once)")
    low: int = Field(1, ge=1, description="smallest number drawn")
    high: int = Field(20, ge=1, le=1000, description="largest number drawn")
    max_target: int = Field(1000, ge=1, description="largest target; targets are whole numbers in 1..max_target")
    max_turns: int = Field(
        1,
        ge=1,
        le=100,
        description="answers allowed; with more than one, a wrong answer gets feedback and the episode goes on",
    )
    answer: Literal["boxed", "tags"] = Field(
        "boxed",
        description="boxed: the expression in \\boxed{}; tags: reasoning in <think> </think>, then the "
        "expression in <answer> </answer> (the single-file GRPO framing)",
    )
    reward_correct: float = Field(1.0, allow_inf_nan=False, description="reward of a correct expression")
    reward_wrong: float = Field(
        0.0,
        allow_inf_nan=False,
        description="reward of a wrong expression (wrong value, wrong numbers, division by zero)",
    )
    reward_format_error: float = Field(
        -0.1,
        allow_inf_nan=False,
        description="reward of an answer with no \\boxed{} or one that is not an allowed expression",
    )

    @model_validator(mode="after")
    def _consistent(self) -> CountdownOptions:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")
        if self.max_target < self.numbers * self.high:
            raise ValueError(
                f"max_target ({self.max_target}) must be at least numbers * high "
                f"({self.numbers * self.high}) so that the sum of the numbers is always allowed"
            )
        return self


class CountdownEnv:
    """One problem per episode; up to `max_turns` answers."""

    def __init__(self, options: CountdownOptions, split: str, run_seed: int):
        self.options, self.split, self.run_seed = options, split, run_seed
        self.test_size: int | None = None  # procedural: as many held-out problems as asked for
        self.problem: Problem | None = None
        self.turn = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.problem = make_problem(self.options, self.split, self.run_seed, 0 if seed is None else int(seed))
        self.turn = 0
        p, turns = self.problem, self.options.max_turns
        tries = f" You have {turns} tries." if turns > 1 else ""
        if self.options.answer == "tags":
            how = (
                "Show your reasoning in <think> </think> tags, then the expression in <answer> </answer> tags, "
                "for example <answer> (1 + 2) / 3 </answer>."
            )
        else:
            how = "Put the expression in \\boxed{}."
        observation = (
            f"Using the numbers {p.numbers}, each exactly once, with + - * / and parentheses, make {p.target}. "
            f"{how}{tries}"
        )
        return observation, {"numbers": p.numbers, "target": p.target, "solution": p.solution}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.problem is None:
            raise RuntimeError("step() before reset()")
        o, p = self.options, self.problem
        self.turn += 1
        if o.answer == "tags":
            answer, missing = last_tagged(action, "answer"), "no <answer> </answer> tags"
        else:
            answer, missing = last_boxed(action), "no \\boxed{} answer"
        if answer is None:
            judgement = Judgement(False, None, missing, True)
        else:
            judgement = judge_expression(answer, p.numbers, p.target)
        info = {
            "success": judgement.ok,
            "format_error": judgement.format_error,
            "reason": judgement.reason,
            "value": None if judgement.value is None else _show(judgement.value),
            "turn": self.turn,
        }
        if judgement.ok:
            return "Correct!", o.reward_correct, True, False, info
        reward = o.reward_format_error if judgement.format_error else o.reward_wrong
        left = o.max_turns - self.turn
        if judgement.format_error:
            feedback = f"I could not read an expression: {judgement.reason}."
        else:  # "equals 17, not 25", "uses 3 twice but it is given once", "divides by zero"
            feedback = f"Your expression {judgement.reason}."
        if left <= 0:
            return f"{feedback} No tries left.", reward, True, False, info
        return f"{feedback} Try again.", reward, False, False, info


@register("countdown", CountdownOptions, "make a target from given numbers with + - * / (verified exactly); "
          "one or more turns")  # fmt: skip
def make_countdown(options: CountdownOptions, split: str, run_seed: int) -> CountdownEnv:
    return CountdownEnv(options, split, run_seed)
