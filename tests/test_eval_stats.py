"""The figures of an evaluation against numbers worked out by hand (orchestrate/loop/eval_stats.py)."""

from __future__ import annotations

import math
from itertools import combinations

import pytest

from orchestrate.loop.eval_report import markdown, plot
from orchestrate.loop.eval_stats import TaskResult, compare, interval, ks_for, maj_at_k, pass_at_k, summarize


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(8, 0, 4) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # fewer failures than k: a success is always drawn
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_pass_at_k_is_the_frequency_over_every_k_subset():
    outcomes = [True, False, False, True, False, False, False]
    for k in range(1, 8):
        subsets = list(combinations(outcomes, k))
        assert pass_at_k(7, 2, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_maj_at_k_by_hand_with_a_tie():
    answers, right = ["7", "7", "8"], [True, True, False]
    assert maj_at_k(answers, right, 1) == pytest.approx(2 / 3)
    # pairs: (7,7) right; (7,8) twice: a tie, half right each -> (1 + 0.5 + 0.5) / 3
    assert maj_at_k(answers, right, 2) == pytest.approx(2 / 3)
    assert maj_at_k(answers, right, 3) == 1.0
    assert maj_at_k(["1", "2", "2", "2"], [True, False, False, False], 3) == 0.0  # "2" wins every triple
    assert maj_at_k(["1", None], [True, False], 1) is None


def test_a_sample_without_an_answer_casts_no_vote():
    answers, right = ["", "", "7"], [False, False, True]
    assert maj_at_k(answers, right, 1) == pytest.approx(1 / 3)
    # pairs: ("", "") no vote: 0; ("", "7") twice: "7" alone votes, right -> (0 + 1 + 1) / 3
    assert maj_at_k(answers, right, 2) == pytest.approx(2 / 3)
    assert maj_at_k(answers, right, 3) == 1.0  # two blanks do not outvote one answer


def test_a_figure_is_over_the_tasks_that_have_it():
    """One task lost a sample to the infrastructure: pass@4 is over the other task alone (and says so), the
    figures with k up to its 3 samples over both."""
    full = TaskResult("t0", [1.0, 0.0, 0.0, 0.0], [True, False, False, False], ["5", "6", "6", "4"])
    short = TaskResult("t1", [0.0, 0.0, 1.0], [False, False, True], ["1", "2", "3"], errors=1)
    s = summarize([full, short], [1, 2, 4])
    assert s["pass@4"]["value"] == 1.0 and s["pass@4"]["tasks"] == 1
    assert s["pass@2"]["value"] == pytest.approx((0.5 + 2 / 3) / 2) and s["pass@2"]["tasks"] == 2
    assert s["maj@4"]["tasks"] == 1 and s["mean_reward"]["tasks"] == 2
    assert "(1 tasks)" in markdown(s, "short")
    c = compare([full, short], [full, short], [1, 4])
    assert c["pass@4"]["tasks"] == 1 and c["pass@1"]["tasks"] == 2


def test_ks():
    assert ks_for(1) == [1] and ks_for(8) == [1, 2, 4, 8] and ks_for(6) == [1, 2, 4, 6]


def three_tasks():
    return [
        TaskResult("t0", [1.0, 0.0, 0.0, 0.0], [True, False, False, False], ["5", "6", "6", "4"]),
        TaskResult("t1", [1.0, 1.0, 1.0, 1.0], [True] * 4, ["3"] * 4),
        TaskResult("t2", [0.0, 0.0, 0.0, 0.0], [False] * 4, ["1", "2", "1", "9"], errors=1),
    ]


def test_summary_of_three_tasks_by_hand():
    s = summarize(three_tasks(), [1, 2, 4])
    # pass@1 per task: 0.25, 1, 0 -> mean 0.41667; sample sd sqrt(((-.16667)^2 + .58333^2 + .41667^2) / 2)
    mean = (0.25 + 1 + 0) / 3
    sd = math.sqrt(((0.25 - mean) ** 2 + (1 - mean) ** 2 + mean**2) / 2)
    assert s["pass@1"]["value"] == pytest.approx(mean)
    assert s["pass@1"]["se"] == pytest.approx(sd / math.sqrt(3))
    lo, hi = mean - 1.96 * sd / math.sqrt(3), mean + 1.96 * sd / math.sqrt(3)  # -0.172, 1.006: cut to [0, 1]
    assert s["pass@1"]["ci95"] == [0.0, 1.0] and s["mean_reward"]["ci95"] == pytest.approx([lo, hi])
    assert s["pass@2"]["value"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert s["pass@4"]["value"] == pytest.approx(2 / 3)
    assert s["mean_reward"]["value"] == pytest.approx(mean)
    assert s["maj@4"]["value"] == pytest.approx((0 + 1 + 0) / 3)  # t0's vote is "6" (wrong)
    assert s["errors"] == 1 and s["tasks"] == 3 and s["samples_per_task"] == 4
    assert [r["task_id"] for r in s["per_task"]] == ["t2", "t0", "t1"]  # failures first


def test_one_task_has_no_spread():
    assert interval([0.5]) == {"value": 0.5, "se": 0.0, "ci95": [0.5, 0.5]}


def test_paired_comparison_is_tighter_than_two_intervals_and_names_flips():
    # B is A plus 0.25 on every task; the tasks differ a lot in difficulty: the paired interval is a point
    a = [TaskResult(f"t{i}", [float(x) for x in s], list(map(bool, s))) for i, s in
         enumerate([[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]])]  # fmt: skip
    b = [TaskResult(f"t{i}", [float(x) for x in s], list(map(bool, s))) for i, s in
         enumerate([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])]  # fmt: skip
    c = compare(a, b, [1, 2])
    assert c["pass@1"]["diff"] == pytest.approx(0.25) and c["pass@1"]["se"] == pytest.approx(0.0)
    unpaired = math.hypot(summarize(a, [1])["pass@1"]["se"], summarize(b, [1])["pass@1"]["se"])
    assert unpaired > 0.1
    assert c["flipped"] == {"b_only": ["t2"], "a_only": []}
    assert (c["better"], c["worse"], c["same"]) == (4, 0, 0)
    with pytest.raises(ValueError, match="different tasks"):
        compare(a, b[:3], [1])
    lost = b[:3] + [TaskResult("t3", [], [], errors=4)]  # every sample of t3 failed on B's side
    c = compare(a, lost, [1])
    assert c["tasks"] == 3 and c["tasks_unpaired"] == 1 and c["pass@1"]["diff"] == pytest.approx(0.25)
    assert "1 left out" in markdown(summarize(lost, [1]), "lost", compare=c)


def test_the_summary_and_plot_are_written(tmp_path):
    s = summarize(three_tasks(), [1, 2, 4])
    text = markdown(s, "three tasks")
    assert "pass@4" in text and "0.667" in text and text.index("| t2 ") < text.index("| t1 ")
    c = compare(three_tasks(), three_tasks(), [1, 2, 4])
    assert "B - A" in markdown(s, "same", compare=c)
    assert plot(s, tmp_path / "p.png").stat().st_size > 1000
    assert plot(s, tmp_path / "c.png", compare=c).stat().st_size > 1000


def test_task_results_from_tapes_a_truncated_sample_votes_for_no_answer_and_failures_are_apart():
    from orchestrate.loop.evaluation import task_results
    from tapes.tape import EnvObservation, Tape, TapeMetadata

    def tape(answer, success, reward, error=None):
        steps = [EnvObservation(text="q", turn=0)]
        if answer is not None:
            steps.append(EnvObservation(text="", turn=1, reward=reward, info={"answer": answer, "success": success}))
        return Tape(metadata=TapeMetadata(task_id="t", reward=reward, success=success, error=error), steps=steps)

    (r,) = task_results([tape("7", True, 1.0), tape(None, False, -1.0), tape("8", False, 0.0), tape("7", None, 0, "x")])
    assert r.answers == ["7", "", "8"] and r.successes == [True, False, False] and r.errors == 1
    assert r.rewards == [1.0, -1.0, 0.0]
    (plain,) = task_results([tape(None, True, 1.0)])  # an environment that reports no answers: no votes
    assert plain.answers == [None]
    # answers compare across the evaluation: a task none of whose samples parsed an answer still has maj@k (0)
    other = tape(None, False, 0.0)
    other.metadata.task_id = "u"
    r, u = task_results([tape("7", True, 1.0), other, other.model_copy(deep=True)])
    assert u.answers == ["", ""] and maj_at_k(u.answers, u.successes, 2) == 0.0


def test_a_rates_interval_stays_within_0_and_1():
    tasks = [TaskResult(f"t{i}", [float(s)], [bool(s)]) for i, s in enumerate([1, 0, 0, 0])]
    s = summarize(tasks, [1])
    assert s["pass@1"]["ci95"][0] == 0.0 and s["pass@1"]["ci95"][1] < 1  # 0.25 - 1.96 x 0.25 < 0: cut
    assert s["mean_reward"]["ci95"][0] < 0  # a reward is not a rate
