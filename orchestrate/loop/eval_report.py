"""An evaluation shown: a markdown summary (the figures with their intervals, a comparison's paired
differences and flipped tasks, then the tasks failures first), a plot of pass@k against k, and the headline
line orchestrate.eval prints; a learning curve over a run's versions (`write_curve`: curve.json, curve.md,
curve.png) and a paired comparison of two targets (`write_comparison`: compare.json, compare.md,
compare.png). All read the figures orchestrate.loop.eval_stats computed; nothing is recomputed here."""

from __future__ import annotations

import os
import re
from pathlib import Path

from contract.durable import atomic_write_json, atomic_write_text
from contract.rundir import RunDir
from orchestrate.loop.eval_settings import Settings, read_json, spans, version_target
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


def figure_names(ks: list[int]) -> list[str]:
    """An evaluation's figures, in the order they are shown: the mean reward, pass@k, maj@k (k > 1)."""
    return ["mean_reward"] + [f"pass@{k}" for k in ks] + [f"maj@{k}" for k in ks if k > 1]


def headline(record: dict, ks: list[int]) -> str:
    """The line orchestrate.eval prints for one evaluation: each figure with its interval."""
    return "  ".join(f"{n} {_cell(record[n], record['tasks'])}" for n in figure_names(ks) if record.get(n))


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
    lines += [f"| {name} | {_cell(summary.get(name), summary['tasks'])} |" for name in figure_names(summary.get("ks", []))
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


# -- a learning curve over a run's versions (--versions) and a comparison of two targets (--compare) --------


def curve_settings(record: dict) -> dict:
    """An evaluation's settings less what names its version: what every point of one curve shares."""
    return {k: v for k, v in record["settings"].items() if k not in ("target", "model", "version")}


def earlier_versions(out: Path, settings: dict, chosen: set[int], run: RunDir, names: list[str]) -> dict[int, dict]:
    """The records of `run`'s versions evaluated into OUT/vN before, with the same settings and every figure of
    `names`, that this call did not choose (a checkpoint deleted since, or a list that left them out): a
    curve's folder keeps its points. A folder whose record is of another version or run is no point."""
    found = {}
    for folder in out.glob("v*"):
        match = re.fullmatch(r"v(0|[1-9][0-9]*)", folder.name)
        if match is None or not folder.is_dir() or int(match[1]) in chosen:
            continue
        version, record = int(match[1]), read_json(folder / "eval.json")
        saved = record.get("settings") or {}
        if (saved.get("version") == version and saved.get("target") == version_target(run, version)
                and curve_settings(record) == settings and all(n in record for n in names)):  # fmt: skip
            found[version] = record
    return found


def write_curve(s: Settings, records: list[dict]) -> dict:
    """--versions: each version's figures against when its checkpoint came in the run (the run's metrics'
    clock, with and without its own evaluations): OUT/curve.json, curve.md and curve.png. The versions
    evaluated into OUT before with the same settings stay on the curve (earlier_versions)."""
    from orchestrate.loop.metrics import read_metrics, version_clock

    run = s.targets[0].run
    clock = version_clock(read_metrics(run.metrics_path))
    names = figure_names(s.ks)
    settings = curve_settings(records[0])
    by_version = {t.policy.version: r for t, r in zip(s.targets, records)}
    kept = earlier_versions(s.out, settings, set(by_version), run, names)
    by_version.update(kept)
    points = []
    for version, record in sorted(by_version.items()):
        seconds, training = clock.get(version, (None, None))
        points.append({"version": version,
                       "minutes": None if seconds is None else round(seconds / 60, 3),
                       "training_minutes": None if training is None else round(training / 60, 3),
                       **{n: record[n] for n in names if record.get(n)}})  # fmt: skip
    if kept:
        print(f"the curve keeps versions {spans(sorted(kept))} evaluated into {s.out} before (their weights are "
              "no longer asked for or on disk)", flush=True)  # fmt: skip
    curve = {"run": str(run.root), "settings": settings, "points": points}
    atomic_write_json(s.out / "curve.json", curve)
    atomic_write_text(s.out / "curve.md", curve_markdown(curve))
    plot_curve(curve, s.out / "curve.png")
    first = f"pass@{s.ks[0]}"
    best = max(points, key=lambda p: (p[first]["value"] if first in p else -1, -p["version"]))
    if first in best:
        print(f"curve of {len(points)} versions: best {first} {best[first]['value']:.3f} at version {best['version']} "
              f"({s.out / 'curve.md'})", flush=True)  # fmt: skip
    return curve


def write_comparison(s: Settings, folders: list[Path]) -> dict:
    """--compare A B: the paired difference B - A of each figure over the tasks both played, with its 95%
    interval, and the tasks that flipped: OUT/compare.json, compare.md and compare.png."""
    from orchestrate.loop.eval_stats import compare, summarize
    from orchestrate.loop.evaluation import finished, tape_file, task_results

    results = []
    for target, folder in zip(s.targets, folders):
        done = finished(tape_file(folder, target.policy.version), s.n)
        results.append(task_results([t for seed in s.seeds for t in done.get(seed, [])], s.role))
    paired = compare(results[0], results[1], s.ks)
    summary_b = summarize(results[1], s.ks)
    a, b = s.targets
    record = {"a": s.record(a), "b": s.record(b), **paired}
    atomic_write_json(s.out / "compare.json", record)
    title = f"{b.text} against {a.text}"
    atomic_write_text(s.out / "compare.md", markdown(summary_b, title, compare=paired))
    plot(summary_b, s.out / "compare.png", compare=paired)
    for name in ["mean_reward"] + [f"pass@{k}" for k in s.ks]:
        f = paired.get(name)
        if f:
            lo, hi = f["ci95"]
            print(f"{name}: {f['a']:.3f} -> {f['b']:.3f}  B - A {f['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]")
    flipped = paired.get("flipped", {})
    print(f"flipped: {len(flipped.get('b_only', []))} tasks solved by B only, {len(flipped.get('a_only', []))} by A "
          f"only ({s.out / 'compare.md'})")  # fmt: skip
    return record
