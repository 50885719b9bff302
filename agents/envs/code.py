"""Code tasks: write a Python function; it runs against the problem's unit tests in the sandbox.

    Write a function `reverse_string(s)` that returns the string `s` reversed.
    ... -> ```python
           def reverse_string(s):
               return s[::-1]
           ```

Problems come from a JSON lines file (`problems`; by default the small set
shipped in `agents/envs/data/code_problems.jsonl`), one object per line:
- `prompt` (text, required): the task; it should name the function;
- `tests` (list of text, required): each one test, `assert EXPRESSION == EXPECTED`,
  EXPECTED a Python literal (`assert add(2, 3) == 5`, `assert is_even(3) == False`);
- `entry_point` (text): the function the tests call (named in the instruction);
- `id` (text): the task id on tapes (default: `line N`);
- `solution` (text): a reference program (the shipped set has one per problem,
  and the tests prove each passes).
The file is checked when the options are: a bad line is refused with
`FILE:LINE: FIELD: what is wrong`.

The answer is the last ```python fenced block of the agent's reply (a reply
without one is a format error: reward `reward_format_error`, the episode
ends). Reward `all`: 1 when every test passes, else 0; `fraction`: the share
of tests passed. With `max_attempts > 1` a failing program gets the failing
tests back (each test's expression and what it returned or raised, never the
expected value) and the agent answers again; the episode's last attempt is
scored, earlier ones earn 0.

How a result cannot be faked. The program is untrusted: it runs in the
sandbox, in the same Python process as the harness that calls it, so it can
do anything that process can (print, exit, patch builtins, read the
harness's memory). The verdict is therefore never taken from inside the
sandbox. Each test `assert EXPRESSION == EXPECTED` is split when the file is
loaded: only EXPRESSION goes into the sandbox, EXPECTED stays in this
process. The harness (`HARNESS`, sent as main.py; the program and the
expressions come on stdin, read whole before the program runs) execs the
program under `__name__ == "solution"`, evaluates each expression, and
writes `repr(value)` on one line per test; this process reads the text back
with `ast.literal_eval` (plain literals only: no object with a forged `__eq__`
survives it) and compares it with EXPECTED here (floats to a relative 1e-9).
To pass a test the program must produce its expected value; a program that
prints, forges result lines, exits (`exit()`, `sys.exit`, `os._exit`), kills
the harness, loops forever or redefines builtins only loses the tests whose
values never came back (and a forged line still has to hold the right
value). The harness's lines carry a random per-run nonce (on stdin) so that
the program's ordinary output is never taken for one, the program's own
stdout goes to /dev/null (its prints cannot crowd the result lines out of
the capped output), and each test and the program's top level
run under a timer (`test_timeout_s`); the sandbox's own timeout bounds the
whole run, and tests with no line by then failed.

The sandbox comes from the caller (`--env.sandbox.*`, one per EnvSpec; a
plain `make_env("code")` builds a default one). A sandbox that could not
start raises SandboxInfraError: the episode is an infrastructure failure,
never a wrong answer.

Splits: the problems ordered by a hash of their id (or prompt) give the
first `test_fraction` to the test split, the rest to train, whatever the
file's order or the run seed; train episodes go through the train problems
in a reshuffled order per pass (seeded by the run seed), held-out episode k
is test problem k.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import random
import re
import secrets
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agents.envs.registry import register
from agents.sandbox import Sandbox, SandboxInfraError

BUILTIN_PROBLEMS = Path(__file__).parent / "data" / "code_problems.jsonl"
FIELDS = ("id", "prompt", "tests", "entry_point", "solution")
MAX_VALUE_CHARS = 1000  # the longest result text a test may return (a bigger value fails the test)
MARK = "@@tapeloop-test"
SOLUTION_FILE = "solution.py"  # what a harness leaves in its workspace to be tested (--agent.command)
MAX_SOLUTION_BYTES = 1_000_000

_FENCED_PYTHON = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Runs inside the sandbox as main.py, with the system's Python. What it prints is read back as data, never
# believed: see the module docstring.
HARNESS = r"""
import builtins, json, os, signal, sys


class _Timeout(BaseException):
    pass


def _main():
    job = json.loads(sys.stdin.read())
    sys.stdin.close()
    mark = ("%s " % job["mark"]).encode()
    out = os.dup(1)  # the harness's channel; the program's own stdout goes to /dev/null
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    limit = job["timeout_s"]

    def emit(record):
        os.write(out, mark + json.dumps(record).encode() + b"\n")

    def on_alarm(signum, frame):
        raise _Timeout()

    def timed(fn):
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def describe(exc):
        if isinstance(exc, _Timeout):
            return "timed out after %g s" % limit
        try:
            return timed(lambda: ("%s: %s" % (type(exc).__name__, exc))[:300])
        except BaseException:
            return "an exception that cannot be shown"

    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        timed(lambda: exec(compile(job["program"], "solution.py", "exec"), namespace))
        emit({"program": None})
    except BaseException as exc:  # SystemExit, a syntax error, a timeout: the tests still run
        emit({"program": describe(exc)})
    for i, expression in enumerate(job["tests"]):
        try:
            text = timed(lambda: repr(eval(compile(expression, "<test>", "eval"), namespace)))
            if type(text) is not str or len(text) > job["max_chars"]:
                raise ValueError("the value is too long to compare")
            record = {"test": i, "value": text}
        except BaseException as exc:
            record = {"test": i, "error": describe(exc)}
        emit(record)


_main()
"""


# -- problems ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Test:
    source: str  # the assert statement as written
    expression: str  # what the sandbox evaluates
    expected: Any  # a Python literal: stays in this process


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str
    tests: tuple[Test, ...]
    entry_point: str | None
    solution: str | None
    line: int
    key: str  # what the split hashes: the id if the file gives one, else the prompt


class ProblemsError(ValueError):
    """A problems file that cannot be used; one line `FILE:LINE: FIELD: what is wrong`."""


def parse_test(source: str) -> Test:
    """`assert EXPRESSION == EXPECTED` (either side the literal) -> Test; ValueError says what is wrong."""
    try:
        tree = ast.parse(source.strip())
    except SyntaxError as exc:
        raise ValueError(f"not Python ({exc.msg})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise ValueError("must be one assert statement: assert EXPRESSION == EXPECTED")
    test = tree.body[0].test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        raise ValueError(
            "must compare with one ==: assert EXPRESSION == EXPECTED (the comparison is made outside the sandbox)"
        )
    left, right = test.left, test.comparators[0]
    for expression, literal in ((left, right), (right, left)):
        try:
            expected = ast.literal_eval(literal)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        return Test(source.strip(), ast.unparse(expression), expected)
    raise ValueError("one side of == must be a Python literal (the expected value)")


def _problem(record: Any, line: int, where: str) -> Problem:
    def bad(field: str, message: str) -> ProblemsError:
        return ProblemsError(f"{where}:{line}: {field}: {message}")

    if not isinstance(record, dict):
        raise bad("line", "not a JSON object")
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        raise bad(unknown[0], f"unknown field (known: {', '.join(FIELDS)})")
    prompt = record.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise bad("prompt", "missing or not a non-empty string")
    tests = record.get("tests")
    if not isinstance(tests, list) or not tests:
        raise bad("tests", "missing or not a non-empty list of assert statements")
    parsed = []
    for i, source in enumerate(tests):
        if not isinstance(source, str):
            raise bad(f"tests[{i}]", "not a string")
        try:
            parsed.append(parse_test(source))
        except ValueError as exc:
            raise bad(f"tests[{i}]", str(exc)) from None
    entry_point = record.get("entry_point")
    if entry_point is not None and not (isinstance(entry_point, str) and entry_point.isidentifier()):
        raise bad("entry_point", "not a Python name")
    for field in ("id", "solution"):
        if record.get(field) is not None and not isinstance(record[field], str):
            raise bad(field, "not a string")
    given_id = record.get("id")
    return Problem(
        given_id or f"line {line}",
        prompt.strip(),
        tuple(parsed),
        entry_point,
        record.get("solution"),
        line,
        given_id or prompt.strip(),
    )


@lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int) -> tuple[Problem, ...]:
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ProblemsError(f"{path}: cannot read it ({exc})") from None
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProblemsError(f"{path}:{number}: line: not JSON ({exc.msg})") from None
        problem = _problem(record, number, path)
        if problem.id in seen:
            raise ProblemsError(f"{path}:{number}: id: {problem.id!r} repeats line {seen[problem.id]}")
        seen[problem.id] = number
        problems.append(problem)
    if len(problems) < 2:
        raise ProblemsError(f"{path}: holds {len(problems)} problems; a train and a test split need at least 2")
    return tuple(problems)


def load_problems(path: str | os.PathLike | None = None) -> tuple[Problem, ...]:
    """The problems of a JSON lines file (default: the built-in set), checked; ProblemsError names FILE:LINE."""
    path = Path(path).expanduser() if path is not None else BUILTIN_PROBLEMS
    try:
        stat = path.stat()
    except OSError:
        raise ProblemsError(f"file {path} does not exist") from None
    if not path.is_file():
        raise ProblemsError(f"{path} is not a file; give a JSON lines file")
    return _load(str(path), stat.st_mtime_ns, stat.st_size)


def split_problems(problems: tuple[Problem, ...], test_fraction: float) -> tuple[list[Problem], list[Problem]]:
    """(train, test): the first `test_fraction` of the problems in hash order are held out, at least one each."""
    n_test = min(len(problems) - 1, max(1, round(len(problems) * test_fraction)))
    order = sorted(problems, key=lambda p: hashlib.sha256(p.key.encode()).hexdigest())
    test = {p.id for p in order[:n_test]}
    return [p for p in problems if p.id not in test], [p for p in problems if p.id in test]


# -- scoring ------------------------------------------------------------------------------


def last_python_block(text: str) -> str | None:
    """The code of the last complete ```python fenced block of `text`, or None."""
    blocks = _FENCED_PYTHON.findall(text)
    return blocks[-1] if blocks else None


def equal(got: Any, expected: Any) -> bool:
    """Python's == on literals, with floats compared to a relative 1e-9 (also inside lists, tuples, dicts)."""
    if isinstance(expected, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12)
    if type(expected) in (list, tuple) and type(got) is type(expected):
        return len(got) == len(expected) and all(equal(g, e) for g, e in zip(got, expected))
    if type(expected) is dict and type(got) is dict:
        return got.keys() == expected.keys() and all(equal(got[k], expected[k]) for k in expected)
    try:
        return bool(got == expected)
    except Exception:  # noqa: BLE001 - literals compare without raising; anything else is not equal
        return False


@dataclass
class Outcome:
    """One program against one problem's tests."""

    passed: list[bool]
    failures: list[str]  # per failed test: its expression and what it returned or raised (no expected value)
    program_error: str | None
    exit_code: int | None
    timed_out: bool
    stderr: str

    @property
    def tests_passed(self) -> int:
        return sum(self.passed)

    def error(self, limit: int = 300) -> str:
        """A short excerpt of what went wrong ("" when every test passed)."""
        parts = ([f"program: {self.program_error}"] if self.program_error else []) + self.failures[:2]
        if not parts and not all(self.passed):
            parts = [self.stderr.strip()[-limit:] or "no result (the program ended the harness)"]
        if self.timed_out:
            parts.append("the run timed out")
        return "; ".join(parts)[:limit]


def run_tests(sandbox: Sandbox, program: str, problem: Problem, test_timeout_s: float) -> Outcome:
    """Run `program` against `problem`'s tests in `sandbox`; SandboxInfraError when the sandbox failed."""
    nonce = secrets.token_hex(16)
    mark = f"{MARK} {nonce}"
    job = {
        "mark": mark,
        "program": program,
        "tests": [t.expression for t in problem.tests],
        "timeout_s": test_timeout_s,
        "max_chars": MAX_VALUE_CHARS,
    }
    result = sandbox.run(HARNESS, stdin=json.dumps(job))
    if result.infra_error:
        raise SandboxInfraError(f"code tests: {result.infra_error}")
    records: dict[int, dict] = {}
    program_error = None
    for line in result.stdout.splitlines():
        if not line.startswith(mark + " "):
            continue
        try:
            record = json.loads(line[len(mark) + 1 :])
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        if "program" in record:
            program_error = record["program"] if isinstance(record["program"], str) else None
        elif isinstance(record.get("test"), int):
            records.setdefault(record["test"], record)  # the first line per test counts
    passed, failures = [], []
    for i, test in enumerate(problem.tests):
        record = records.get(i)
        ok, what = False, "no result (the run ended first)"
        if record is not None and isinstance(record.get("value"), str):
            text = record["value"]
            try:  # the length again: a forged line never went through the harness's check
                ok = len(text) <= MAX_VALUE_CHARS and equal(ast.literal_eval(text), test.expected)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                pass
            what = f"returned {text[:80]}"
        elif record is not None:
            what = f"raised {str(record.get('error'))[:120]}"
        passed.append(ok)
        if not ok:
            failures.append(f"{test.expression[:80]} {what}")
    return Outcome(passed, failures, program_error, result.exit_code, result.timed_out, result.stderr)


# -- the environment ----------------------------------------------------------------------


class CodeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    problems: str | None = Field(
        None, description="JSON lines file of problems (prompt, tests, entry_point, id); default: the built-in set"
    )
    reward: Literal["all", "fraction"] = Field(
        "all", description="all: 1 when every test passes, else 0; fraction: the share of tests passed"
    )
    reward_format_error: float = Field(
        0.0, allow_inf_nan=False, description="reward of a reply without a ```python block (the episode ends)"
    )
    test_fraction: float = Field(
        0.25,
        gt=0,
        lt=1,
        description="share of the problems held out as the test "
        "split (by a hash of each problem; at least one each side)",
    )
    test_timeout_s: float = Field(
        2.0,
        gt=0,
        le=600,
        description="seconds the program's top level and each "
        "test may run (the sandbox's timeout_s bounds the whole run)",
    )
    max_attempts: int = Field(
        1,
        ge=1,
        le=20,
        description="programs the agent may submit; with more than one, "
        "a failing program gets the failing tests back and the agent answers again",
    )

    @field_validator("problems")
    @classmethod
    def _readable(cls, value: str | None) -> str | None:
        if value is not None:
            load_problems(value)  # ProblemsError (a ValueError): refused with the option's name
        return value


def pose(prompt: str, entry_point: str | None, max_attempts: int = 1) -> str:
    """The first observation: the problem and how to answer."""
    defines = f" that defines `{entry_point}`" if entry_point else ""
    tries = f" You have {max_attempts} attempts." if max_attempts > 1 else ""
    return (
        f"{prompt}\n\nAnswer with a complete Python program{defines} in a ```python code block; it is run "
        f"against unit tests.{tries}"
    )


class CodeEnv:
    """One problem per episode; up to `max_attempts` programs, each run against the problem's tests."""

    def __init__(self, options: CodeOptions, problem_at, test_size: int | None, sandbox: Sandbox):
        self.options = options
        self._problem_at = problem_at  # seed -> Problem
        self.test_size = test_size
        self.sandbox = sandbox
        self.problem: Problem | None = None
        self.attempt = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.problem = self._problem_at(0 if seed is None else int(seed))
        self.attempt = 0
        p = self.problem
        return pose(p.prompt, p.entry_point, self.options.max_attempts), {"task_id": p.id, "entry_point": p.entry_point}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.problem is None:
            raise RuntimeError("step() before reset()")
        o, p = self.options, self.problem
        self.attempt += 1
        program = last_python_block(action)
        total = len(p.tests)
        if program is None:
            info = {
                "success": False,
                "format_error": True,
                "reason": "no ```python code block",
                "tests_passed": 0,
                "tests_total": total,
                "attempt": self.attempt,
            }
            return "No ```python code block found.", o.reward_format_error, True, False, info
        outcome = run_tests(self.sandbox, program, p, o.test_timeout_s)
        success = outcome.tests_passed == total
        score = float(success) if o.reward == "all" else outcome.tests_passed / total
        info = {
            "success": success,
            "format_error": False,
            "tests_passed": outcome.tests_passed,
            "tests_total": total,
            "tests": outcome.passed,
            "exit_code": outcome.exit_code,
            "timed_out": outcome.timed_out,
            "error": outcome.error(),
            "attempt": self.attempt,
            "reason": f"{outcome.tests_passed}/{total} tests passed",
        }  # fmt: skip (no run time or raw output: the tape holds what replays the same)
        summary = f"{outcome.tests_passed} of {total} tests passed."
        left = o.max_attempts - self.attempt
        if success or left <= 0:
            return summary, score, True, False, info
        failing = "\n".join(f"- {f}" for f in outcome.failures[:3])
        program_error = f"\nThe program itself raised {outcome.program_error}" if outcome.program_error else ""
        feedback = (
            f"{summary}{program_error}\nFailing tests:\n{failing}\nFix the program and answer again with "
            f"the whole program in a ```python code block. {left} attempt{'s' if left > 1 else ''} left."
        )
        return feedback, 0.0, False, False, info

    # -- a harness's workspace (HasWorkspace: --agent.command) ------------------------------------

    def workspace_files(self) -> dict[str, str]:
        """The problem as files: TASK.md (the harness's prompt) and SOLUTION_FILE, which is what is tested."""
        if self.problem is None:
            raise RuntimeError("workspace_files() before reset()")
        p = self.problem
        defines = f" that defines `{p.entry_point}`" if p.entry_point else ""
        task = (f"{p.prompt}\n\nWrite a complete Python program{defines} into the file {SOLUTION_FILE} in the "
                "current directory; it is run against unit tests when you finish.")  # fmt: skip
        return {"TASK.md": task, SOLUTION_FILE: ""}

    def answer_from_workspace(self, folder) -> str:
        """The action that tests the workspace's SOLUTION_FILE (as if the agent had answered it); no file, or
        one over MAX_SOLUTION_BYTES, is an answer without a program (a format error)."""
        path = Path(folder) / SOLUTION_FILE
        if not path.is_file() or path.stat().st_size > MAX_SOLUTION_BYTES:
            return f"(no {SOLUTION_FILE} of at most {MAX_SOLUTION_BYTES} bytes was left in the workspace)"
        return f"```python\n{path.read_text(errors='replace')}\n```"

    async def astep(self, action: str):
        """step() in a worker thread: the tests block, the other episodes' rollouts go on meanwhile."""
        import asyncio

        return await asyncio.to_thread(self.step, action)


@register("code", CodeOptions, "write a Python function; it runs against unit tests in the sandbox (local "
          "JSON lines or the built-in set)", sandbox=True)  # fmt: skip
def make_code(options: CodeOptions, split: str, run_seed: int, *, sandbox: Sandbox) -> CodeEnv:
    train, test = split_problems(load_problems(options.problems), options.test_fraction)
    if split == "test":
        return CodeEnv(options, lambda i: test[i % len(test)], len(test), sandbox)
    orders: dict[int, list[int]] = {}

    def problem_at(position: int) -> Problem:  # a reshuffled pass over the train problems per epoch
        epoch, index = divmod(position, len(train))
        if epoch not in orders:
            order = list(range(len(train)))
            random.Random(f"code-{run_seed}-{epoch}").shuffle(order)
            orders[epoch] = order
        return train[orders[epoch][index]]

    return CodeEnv(options, problem_at, None, sandbox)
