"""Rewards for math answers: +1 correct, 0 wrong, -1 unparsable or truncated.

The answer is the content of the last `\\boxed{...}` in the output. It is
compared to the gold answer with math-verify (the field's answer checker), so
`\\boxed{1,080}`, `\\boxed{72.0}`, `\\boxed{\\$18}` and `\\boxed{50\\%}` are
numerically equal to 1080, 72, 18 and 50. A trailing unit (`18 dollars`) is
dropped when the box starts with a number.
"""

from __future__ import annotations

import logging
import re
import threading

from pydantic import BaseModel

CORRECT, WRONG, INVALID = 1.0, 0.0, -1.0

logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call without timeouts


class Reward(BaseModel):
    value: float
    reason: str  # "correct" | "wrong: ..." | "truncated" | "no \\boxed{} answer"


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0 or text[start:i].strip() not in ("\\boxed", "\\fbox"):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # unclosed: the output was probably cut


_NUMBER_WITH_UNIT = re.compile(r"^\s*\\?\$?\s*(-?[\d,]*\.?\d+)\s*[A-Za-z][A-Za-z .]*$")


def answers_match(answer: str, gold: str) -> bool:
    from math_verify import parse, verify

    # math-verify's timeouts use signals, which only work on the main thread.
    on_main = threading.current_thread() is threading.main_thread()
    parse_kw = {} if on_main else {"parsing_timeout": None}
    verify_kw = {} if on_main else {"timeout_seconds": None}
    gold_parsed = parse(f"${gold}$", **parse_kw)
    candidates = [answer]
    unit = _NUMBER_WITH_UNIT.match(answer)
    if unit:
        candidates.append(unit.group(1))
    for candidate in candidates:
        parsed = parse(f"\\boxed{{{candidate}}}", **parse_kw)
        if parsed and verify(gold_parsed, parsed, **verify_kw):
            return True
    return False


def math_reward(output: str, gold: str, finish_reason: str | None = None) -> Reward:
    """Score one completion against the gold answer."""
    if finish_reason == "length":
        return Reward(value=INVALID, reason="truncated")
    answer = last_boxed(output)
    if answer is None or not answer:
        return Reward(value=INVALID, reason="no \\boxed{} answer")
    if answers_match(answer, gold):
        return Reward(value=CORRECT, reason="correct")
    return Reward(value=WRONG, reason=f"wrong: {answer!r} != {gold!r}")
