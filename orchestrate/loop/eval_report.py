"""An evaluation shown: a markdown summary (the figures with their intervals, a comparison's paired
differences and flipped tasks, then the tasks failures first) and a plot of pass@k against k. Both read the
figures orchestrate.loop.eval_stats computed; nothing is recomputed here."""

from __future__ import annotations

import os
from pathlib import Path

from orchestrate.loop.metrics import save_figure

ROWS = 50  # tasks listed in a summary; the rest are in eval.json


def over_tasks(f: dict, tasks: int | None) -> str:
    """ " (N tasks)" when a figure is over fewer tasks than the evaluation's `tasks`, else ""."""
    return f" ({f['tasks']} tasks)" if tasks is not None and f.get("tasks", tasks) < tasks else ""


def _cell(f: dict | None, tasks: int | None = None) -> str:
    """A figure with its interval, and over how many tasks when fewer than the evaluation's `tasks`."""
    if not f:
        return "-"
    lo, hi = f["ci95"]
    return f"{f['value']:.3f} [{lo:.3f}, {hi:.3f}]{over_tasks(f, tasks)}"


def _names(summary: dict) -> list[str]:
    ks = summary.get("ks", [])
    return ["mean_reward"] + [f"pass@{k}" for k in ks] + [f"maj@{k}" for k in ks if k > 1]


def markdown(summary: dict, title: str, compare: dict | None = None) -> str:
    lines = [f"# {title}", ""]
    n = summary["samples_per_task"]
    lines += [f"{summary['tasks']} tasks x {n} samples; {summary['errors']} episodes failed (infrastructure, not "
              "scored). Intervals: 95%, over tasks.", ""]  # fmt: skip
    if compare is not None:
        lines += ["| figure | A | B | B - A [95%] |", "|---|---|---|---|"]
        for name in ["mean_reward"] + [f"pass@{k}" for k in compare["ks"]]:
            f = compare.get(name)
            if f:
                lo, hi = f["ci95"]
                lines.append(f"| {name} | {f['a']:.3f} | {f['b']:.3f} | {f['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]"
                             f"{over_tasks(f, compare['tasks'])} |")  # fmt: skip
        flipped = compare["flipped"]
        unpaired = compare.get("tasks_unpaired", 0)
        lines += ["", f"Tasks: {compare['better']} better, {compare['worse']} worse, {compare['same']} the same "
                  "(success rate)" + (f"; {unpaired} left out (every sample failed on a side)" if unpaired else "")
                  + ".", ""]  # fmt: skip
        for side, what in (("b_only", "solved by B only"), ("a_only", "solved by A only")):
            ids = flipped[side]
            shown = ", ".join(ids[:ROWS]) + (f" ... ({len(ids) - ROWS} more)" if len(ids) > ROWS else "")
            lines.append(f"- {what} ({len(ids)}): {shown or 'none'}")
        lines += ["", "## B", ""]
    lines += ["| figure | value [95%] |", "|---|---|"]
    lines += [f"| {name} | {_cell(summary.get(name), summary['tasks'])} |" for name in _names(summary)
              if summary.get(name)]  # fmt: skip
    rows = summary["per_task"]
    ks = [k for k in summary.get("ks", []) if k > 1]
    head = ["task", "n", "successes", "mean reward"] + [f"pass@{k}" for k in ks]
    lines += ["", "## Tasks, failures first", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows[:ROWS]:
        cells = [row["task_id"], str(row["n"]), str(row["successes"]), f"{row['mean_reward']:.3f}"]
        cells += [f"{row[f'pass@{k}']:.3f}" if row.get(f"pass@{k}") is not None else "-" for k in ks]
        lines.append("| " + " | ".join(cells) + " |")
    if len(rows) > ROWS:
        lines.append(f"\n{len(rows) - ROWS} more tasks in eval.json.")
    return "\n".join(lines) + "\n"


def _curve(ax, summary: dict, label: str, **kw) -> None:
    pts = [(k, summary[f"pass@{k}"]) for k in summary.get("ks", []) if summary.get(f"pass@{k}")]
    if pts:
        ks = [k for k, _ in pts]
        values = [f["value"] for _, f in pts]
        errors = [[f["value"] - f["ci95"][0] for _, f in pts], [f["ci95"][1] - f["value"] for _, f in pts]]
        ax.errorbar(ks, values, yerr=errors, marker="o", capsize=3, label=label, **kw)


def plot(summary: dict, path: str | os.PathLike, compare: dict | None = None, labels=("A", "B")) -> Path:
    """pass@k against k with the 95% intervals (a comparison: A's and B's curves), written whole."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    if compare is not None:
        ks = [k for k in compare["ks"] if compare.get(f"pass@{k}")]
        for side, label in zip(("a", "b"), labels):
            ax.plot(ks, [compare[f"pass@{k}"][side] for k in ks], marker="o", label=label)
    else:
        _curve(ax, summary, "pass@k")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (samples)")
    ax.set_ylabel("pass@k")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def _curve_names(points: list[dict]) -> list[str]:
    """The figures every version of a curve has, in the order of an evaluation's."""
    names = [n for n in points[0] if n == "mean_reward" or n.startswith(("pass@", "maj@"))]
    return [n for n in names if all(n in p for p in points)]


def curve_markdown(curve: dict) -> str:
    """orchestrate.eval --versions: a row per version, when it came and its figures with their intervals."""
    points, names = curve["points"], _curve_names(curve["points"])
    lines = [f"# {curve['run']}: each version evaluated", "",
             "Minutes: of the run's commands until the version's checkpoint came (the run's own held-out "
             "evaluations included; training: without them). Intervals: 95%, over tasks.", "",
             "| version | minutes | minutes training | " + " | ".join(names) + " |",
             "|---:|---:|---:|" + "---|" * len(names)]  # fmt: skip
    for p in points:
        when = [f"{p[k]:.1f}" if p.get(k) is not None else "-" for k in ("minutes", "training_minutes")]
        lines.append(f"| {p['version']} | " + " | ".join(when + [_cell(p[n]) for n in names]) + " |")
    return "\n".join(lines) + "\n"


def plot_curve(curve: dict, path: str | os.PathLike) -> Path:
    """Each pass@k (and the mean reward) against the minutes its version came (against the version where the
    run's metrics do not say), with the 95% intervals, written whole."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = curve["points"]
    timed = all(p.get("minutes") is not None for p in points)
    xs = [p["minutes"] if timed else p["version"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in _curve_names(points):
        values = [p[name]["value"] for p in points]
        errors = [[v - p[name]["ci95"][0] for v, p in zip(values, points)],
                  [p[name]["ci95"][1] - v for v, p in zip(values, points)]]  # fmt: skip
        ax.errorbar(xs, values, yerr=errors, marker="o", capsize=3, label=name)
    ax.set_xlabel("minutes of the run (when the version came)" if timed else "version")
    ax.set_ylabel("held-out figure")
    ax.set_title(f"{Path(curve['run']).name}: each version evaluated", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)
