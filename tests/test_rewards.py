import threading

import pytest

from agents.rewards import CORRECT, INVALID, WRONG, last_boxed, math_reward


@pytest.mark.parametrize(
    "output, gold, expected",
    [
        ("7 + 5 = 12, so the answer is \\boxed{12}.", "12", CORRECT),  # right
        ("The answer is \\boxed{13}.", "12", WRONG),  # wrong
        ("The answer is 12.", "12", INVALID),  # missing box
        ("First \\boxed{12}, no wait: \\boxed{13}", "13", CORRECT),  # several boxes: the last counts
        ("First \\boxed{13}, no wait: \\boxed{12}", "13", WRONG),
        ("\\boxed{1,080}", "1080", CORRECT),  # thousands commas
        ("\\boxed{1080}", "1,080", CORRECT),
        ("\\boxed{72.0}", "72", CORRECT),  # decimals
        ("\\boxed{0.5}", "0.5", CORRECT),
        ("\\boxed{0.25}", "0.5", WRONG),
        ("\\boxed{-5}", "-5", CORRECT),  # negative numbers
        ("\\boxed{5}", "-5", WRONG),
        ("\\boxed{$18}", "18", CORRECT),  # units
        ("\\boxed{\\$18}", "18", CORRECT),
        ("\\boxed{18 dollars}", "18", CORRECT),
        ("\\boxed{18\\text{ apples}}", "18", CORRECT),
        ("\\boxed{50\\%}", "50", CORRECT),
        ("\\boxed{}", "3", INVALID),  # an empty box is no answer
        ("\\boxed{\\frac{1}{2}}", "0.5", CORRECT),  # nested braces
    ],
)
def test_math_reward(output, gold, expected):
    reward = math_reward(output, gold, finish_reason="stop")
    assert reward.value == expected, reward.reason


def test_truncated_output_is_invalid_even_if_boxed():
    assert math_reward("\\boxed{12} and then", "12", finish_reason="length").value == INVALID
    assert math_reward("\\boxed{12} and then", "12", finish_reason="length").reason == "truncated"


def test_reason_is_written():
    assert "13" in math_reward("\\boxed{13}", "12").reason
    assert math_reward("\\boxed{12}", "12").reason == "correct"


def test_last_boxed():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{2}{3}} c") == "\\frac{2}{3}"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{12") is None  # cut before closing


def test_works_off_the_main_thread():
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", math_reward("\\boxed{1,080}", "1080")))
    thread.start()
    thread.join()
    assert out["r"].value == CORRECT
