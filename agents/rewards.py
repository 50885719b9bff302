"""Rewards for math answers (+1 correct, 0 wrong, -1 unparsable or truncated) and scores of short
answers to questions (exact match and token F1, HotpotQA's / SQuAD's normalisation).

The answer is the content of the last `\\boxed{...}` in the output. It is
compared to the gold answer with math-verify (the field's answer checker), so
`\\boxed{1,080}`, `\\boxed{72.0}`, `\\boxed{\\$18}` and `\\boxed{50\\%}` are
numerically equal to 1080, 72, 18 and 50. A trailing unit (`18 dollars`) is
dropped when the box starts with a number.
"""

from __future__ import annotations

import logging
import re
import string
import threading
from collections import Counter

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


def last_tagged(text: str, tag: str = "answer") -> str | None:
    """Content of the last <tag>...</tag> (stripped); None if there is none or it is not closed."""
    end = text.rfind(f"</{tag}>")
    start = text.rfind(f"<{tag}>", 0, end) if end >= 0 else -1
    if start < 0:
        return None
    return text[start + len(tag) + 2 : end].strip()


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


# -- short answers to questions -------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """HotpotQA's (and SQuAD's) normalisation: lower case, no punctuation, no articles (a, an, the), single
    spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def token_f1(prediction: str, gold: str) -> float:
    """F1 of the normalised words of `prediction` against those of `gold` (each word counted as often as it
    occurs in both)."""
    predicted, wanted = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not predicted or not wanted:  # e.g. an answer that is only an article: no words to weigh
        return float(predicted == wanted)
    common = sum((Counter(predicted) & Counter(wanted)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(wanted)
    return 2 * precision * recall / (precision + recall)


def qa_scores(prediction: str, answers: list[str]) -> tuple[float, float]:
    """(exact match, token F1) of a prediction: the best of each over the accepted answers."""
    em = max(float(normalize_answer(prediction) == normalize_answer(gold)) for gold in answers)
    return em, max(token_f1(prediction, gold) for gold in answers)
