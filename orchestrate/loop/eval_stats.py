"""The figures of an evaluation, as pure functions of per-task results: pass@k, maj@k, mean reward, their 95%
intervals, and the paired comparison of two policies on the same tasks.

- pass@k is the unbiased estimator of Chen et al. (2021): from n samples of a task with c successes, the
  chance that k drawn without replacement hold at least one success, 1 - C(n - c, k) / C(n, k).
- maj@k is the expected success of a majority vote over k samples drawn without replacement: the answer
  given most often wins; a tie between answers is settled by a fair draw among them (so a tie between a
  right and a wrong answer counts 1/2); a sample with no answer ("": truncated, unparsable) casts no vote,
  and k of them alone lose. Exact over every k-subset when there are at most MAJ_EXACT of
  them, else the mean of MAJ_DRAWS seeded draws.
- Intervals: each figure is a mean over tasks of a per-task value (over the tasks that have one: a task
  with fewer than k samples that ran has no pass@k and is counted out of pass@k alone); its 95% interval is the mean plus or
  minus 1.96 standard errors of those values (sample standard deviation / sqrt(tasks)), as lm-eval-harness
  and verifiers report: the tasks are the sample; a rate's interval is cut to [0, 1] (a difference of rates
  to [-1, 1]). One task: no spread to measure, the interval is the value.
- A comparison pairs the two policies' per-task values (same tasks, same seeds): the interval of B - A is
  from the per-task differences, narrower than two separate intervals when tasks differ in difficulty.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from itertools import combinations

Z95 = 1.96
MAJ_EXACT = 5000  # k-subsets enumerated for maj@k; beyond, a seeded sample of MAJ_DRAWS of them
MAJ_DRAWS = 2000
NO_ANSWER = ""  # a sample's answer when the environment reports answers but parsed none from it


@dataclass
class TaskResult:
    """One task's samples that ran (failed episodes are counted in `errors`, never scored)."""

    task_id: str
    rewards: list[float]
    successes: list[bool]
    answers: list[str | None] = field(default_factory=list)  # None: not comparable (no maj@k)
    errors: int = 0

    @property
    def n(self) -> int:
        return len(self.rewards)


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k), as a product (no big binomials): the chance that k of the n samples drawn
    without replacement hold a success."""
    if not 0 < k <= n:
        raise ValueError(f"pass@{k} from {n} samples: k must be 1 to n")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _vote(answers: tuple, right: dict) -> float:
    """A majority vote's success: the most frequent answers share the win; no answer ("") is no vote."""
    counts = Counter(a for a in answers if a != NO_ANSWER)
    if not counts:
        return 0.0
    top = max(counts.values())
    winners = [a for a, c in counts.items() if c == top]
    return sum(right[a] for a in winners) / len(winners)


def maj_at_k(answers: list[str | None], successes: list[bool], k: int) -> float | None:
    """Expected success of a majority vote over k of the samples; None when an answer is not comparable.
    An answer counts as right when the sample that gave it succeeded (one answer, one verdict)."""
    if not 0 < k <= len(answers):
        raise ValueError(f"maj@{k} from {len(answers)} samples: k must be 1 to n")
    if any(a is None for a in answers):
        return None
    right: dict = {}
    for a, s in zip(answers, successes):
        right[a] = right.get(a, False) or bool(s)
    if math.comb(len(answers), k) <= MAJ_EXACT:
        subsets = list(combinations(answers, k))
    else:
        rng = random.Random(0)
        subsets = [tuple(rng.sample(answers, k)) for _ in range(MAJ_DRAWS)]
    return sum(_vote(s, right) for s in subsets) / len(subsets)


def ks_for(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def interval(values: list[float], bounds: tuple[float, float] | None = None) -> dict:
    """{value, se, ci95}: the mean of per-task values and its 95% interval (mean +- 1.96 se), cut to `bounds`
    (a rate's [0, 1]: the normal approximation reaches past them with few tasks)."""
    t = len(values)
    mean = sum(values) / t
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (t - 1) / t) if t > 1 else 0.0
    lo, hi = mean - Z95 * se, mean + Z95 * se
    if bounds is not None:
        lo, hi = max(bounds[0], lo), min(bounds[1], hi)
    return {"value": mean, "se": se, "ci95": [lo, hi]}


def per_task(r: TaskResult, ks: list[int]) -> dict:
    """A task's own figures: its samples, successes, mean reward, pass@k (and maj@k) for the k it has."""
    row = {"task_id": r.task_id, "n": r.n, "successes": sum(r.successes), "errors": r.errors,
           "mean_reward": sum(r.rewards) / r.n if r.n else None}  # fmt: skip
    for k in ks:
        row[f"pass@{k}"] = pass_at_k(r.n, sum(r.successes), k) if 0 < k <= r.n else None
        if k > 1:
            row[f"maj@{k}"] = maj_at_k(r.answers, r.successes, k) if r.answers and 0 < k <= r.n else None
    return row


def _figure(rows: list[dict], name: str) -> dict | None:
    """A figure over the tasks that have it, with how many those are (None: no task has it)."""
    values = [row[name] for row in rows if row[name] is not None]
    if not values:
        return None
    return {**interval(values, None if name == "mean_reward" else (0.0, 1.0)), "tasks": len(values)}


def summarize(tasks: list[TaskResult], ks: list[int]) -> dict:
    """Mean reward, pass@k and maj@k over the tasks with a sample that ran, with their 95% intervals; the
    per-task rows, failures first (fewest successes, then lowest mean reward, then task id)."""
    scored = [r for r in tasks if r.n]
    rows = [per_task(r, ks) for r in scored]
    counts = [r.n for r in scored]
    out: dict = {
        "tasks": len(scored),
        "tasks_without_samples": len(tasks) - len(scored),
        "samples_per_task": (min(counts), max(counts)) if counts and min(counts) != max(counts)
        else (counts[0] if counts else 0),
        "errors": sum(r.errors for r in tasks),
        "ks": ks,
        "mean_reward": _figure(rows, "mean_reward"),
    }  # fmt: skip
    for k in ks:
        out[f"pass@{k}"] = _figure(rows, f"pass@{k}")
    for k in ks:
        if k > 1:
            out[f"maj@{k}"] = _figure(rows, f"maj@{k}")
    out["per_task"] = sorted(rows, key=lambda r: (r["successes"] / max(1, r["n"]), r["mean_reward"] or 0.0,
                                                  r["task_id"]))  # fmt: skip
    return out


def compare(a: list[TaskResult], b: list[TaskResult], ks: list[int]) -> dict:
    """B against A on the same tasks: per figure {a, b, diff (B - A), se, ci95} from the paired per-task
    differences; the tasks solved (any success) by one only; how many tasks' success rate rose, fell, held.
    Tasks whose samples all failed on either side are left out (counted: tasks_unpaired); a figure pairs the
    tasks that have it on both sides. ValueError when the two were not played on the same tasks."""
    played_a, played_b = {r.task_id for r in a}, {r.task_id for r in b}
    if played_a != played_b:
        raise ValueError(f"the two evaluations hold different tasks: {len(played_a - played_b)} only in A, "
                         f"{len(played_b - played_a)} only in B")  # fmt: skip
    by_a, by_b = {r.task_id: r for r in a if r.n}, {r.task_id: r for r in b if r.n}
    ids = sorted(set(by_a) & set(by_b))
    rows_a = {i: per_task(by_a[i], ks) for i in ids}
    rows_b = {i: per_task(by_b[i], ks) for i in ids}
    out: dict = {"tasks": len(ids), "tasks_unpaired": len(played_a) - len(ids), "ks": ks}
    for name in ["mean_reward"] + [f"pass@{k}" for k in ks]:
        both = [i for i in ids if rows_a[i][name] is not None and rows_b[i][name] is not None]
        if not both:
            out[name] = None
            continue
        diffs = interval([rows_b[i][name] - rows_a[i][name] for i in both], None if name == "mean_reward" else (-1, 1))
        out[name] = {"a": sum(rows_a[i][name] for i in both) / len(both),
                     "b": sum(rows_b[i][name] for i in both) / len(both),
                     "diff": diffs["value"], "se": diffs["se"], "ci95": diffs["ci95"], "tasks": len(both)}  # fmt: skip
    rate = {i: (sum(by_a[i].successes) / by_a[i].n, sum(by_b[i].successes) / by_b[i].n) for i in ids}
    out["flipped"] = {"b_only": [i for i in ids if rate[i][0] == 0 < rate[i][1]],
                      "a_only": [i for i in ids if rate[i][1] == 0 < rate[i][0]]}  # fmt: skip
    out["better"] = sum(rb > ra for ra, rb in rate.values())
    out["worse"] = sum(rb < ra for ra, rb in rate.values())
    out["same"] = len(ids) - out["better"] - out["worse"]
    return out
