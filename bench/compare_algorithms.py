"""Algorithms side by side on the embedded preset, the same wall time each: one table, one plot.

Held-out success at 10, 20 and 30 minutes of GRPO, Dr. GRPO, DAPO, GSPO, RLOO, REINFORCE++, REINFORCE and PPO
(issue 25.5).

    uv run python bench/compare_algorithms.py --out /tmp/algos [--minutes 30] [--recipes grpo,ppo]
        [--eval-every 3] [--eval-tasks N] [--marks 10,20,30] [--options='--train.steps_per_epoch 4']
        [--plot PNG] [--report-only]

Each recipe of RECIPES (`--train.algorithm NAME` for every algorithm of the registry, finetune.algorithms,
with its paper) is one real run of
`orchestrate.rl` (vLLM server, accelerate-launched trainer; this interpreter, so `uv run python` makes it
`uv run -m orchestrate.rl`), one after the other, in OUT/RECIPE, for --minutes of wall time
(`--run.max_minutes`; `--run.iterations` is set out of reach), evaluated every --eval-every iterations on the
preset's held-out tasks (200; --eval-tasks to change), with --options (orchestrate.rl's, one string) added to
every recipe: the same comparison under other settings (--options may not set what a recipe or this script
sets; its marker OUT/RECIPE.done and the table name them). Its output goes to OUT/RECIPE.log. Every recipe's
options are checked by the command line's own parser (`orchestrate.loop.command_line.parse_args`, what `--print-config`
runs) before anything starts, and so is a run directory already in OUT: it must hold this recipe's run.

The runs can be spread over several sessions (`--recipes grpo,ppo`): a run that ended (OUT/RECIPE.done) is
reused, one that was interrupted resumes with the minutes it has left. Then, from every recipe's run found in
OUT, it writes OUT/table.md (printed too) and the plot OUT/algorithms.png (and --plot); `--report-only` does
only that.

Minutes are from the command's start (metrics' elapsed_s: server and trainer start-up included); a resumed
run adds its commands' minutes, each up to its last record (work a kill threw away is not counted, the new
start-up is). "At 10 minutes" is the latest evaluation at or before minute 10; "untrained" is iteration 0's;
"best" the highest up to the last mark.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # provenance.py, also when this file is loaded by its path

from provenance import write_sidecar  # noqa: E402

from contract.durable import atomic_write_text  # noqa: E402
from finetune.algorithms import ALGORITHMS  # noqa: E402
from orchestrate.loop.metrics import read_metrics  # noqa: E402

PRESET = "embedded"
ITERATIONS = 100_000  # out of reach: the time budget ends each run


class Recipe(NamedTuple):
    overrides: tuple[str, ...]  # added to the preset (embedded: lr 1e-5, kl_coef 0, 16 tasks x 4 at T 0.7,
    paper: str  #                  128 new tokens, one optimizer step per batch)
    preset: str = PRESET  # the preset it starts from


def presets_of(study_recipes: dict[str, Recipe]) -> str:
    """What the recipes start from, for a title: `the embedded preset`, or each recipe's own."""
    presets = {r.preset for r in study_recipes.values()}
    return f"the {presets.pop()} preset" if len(presets) == 1 else "each recipe's preset"


# Every registered algorithm (finetune.algorithms: its loss, estimator, aggregation and paper's options), by
# name. The preset has no KL term (kl_coef 0), so none adds one.
RECIPES: dict[str, Recipe] = {name: Recipe(("--train.algorithm", name), a.paper) for name, a in ALGORITHMS.items()}


class Study(NamedTuple):
    """What is compared: named recipes (options added to the preset), the name of the plot and of the title,
    and the script that made the table. bench/bench_lora.py runs its own study through this script's main."""

    recipes: dict[str, Recipe]
    name: str
    made_by: str


STUDY = Study(RECIPES, "algorithms", "bench/compare_algorithms.py")


class Refused(Exception):
    """Bad input: one line, exit 2."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise Refused(message)


def parse_args(argv: list[str] | None = None, study: Study = STUDY) -> argparse.Namespace:
    recipes = study.recipes
    parser = OneLineParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--out", type=Path, required=True, help="run directories (OUT/RECIPE), logs, table, plot")
    parser.add_argument("--minutes", type=float, default=30.0, help="wall minutes per recipe (--run.max_minutes)")
    parser.add_argument("--recipes", default=",".join(recipes), help=f"comma-separated, of: {', '.join(recipes)}")
    parser.add_argument("--eval-every", type=int, default=3, help="evaluate every N iterations")
    parser.add_argument("--eval-tasks", type=int, default=None, help="held-out tasks; default: the preset's (200)")
    parser.add_argument("--marks", default="10,20,30", help="minutes the table reports held-out success at")
    parser.add_argument(
        "--plot", type=Path, default=None, help=f"a copy of the plot (OUT/{study.name}.png is always written)"
    )
    parser.add_argument(
        "--options", default="", metavar="'OPTIONS'",
        help="orchestrate.rl options added to every recipe, one string: --options='--train.steps_per_epoch 4'",
    )  # fmt: skip
    parser.add_argument("--report-only", action="store_true", help="run nothing: table and plot of OUT's runs")
    args = parser.parse_args(argv)
    args.options = common_options(args.options, study)
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in args.recipes if r not in recipes]
    if unknown or not args.recipes:
        raise Refused(f"--recipes: unknown recipe {', '.join(map(repr, unknown))} (known: {', '.join(recipes)})")
    if not 0 < args.minutes < float("inf"):
        raise Refused(f"--minutes: a number of minutes > 0 (got {args.minutes:g})")
    if args.eval_every <= 0:
        raise Refused(f"--eval-every: iterations > 0 (got {args.eval_every})")
    if args.eval_tasks is not None and args.eval_tasks <= 0:
        raise Refused(f"--eval-tasks: tasks > 0 (got {args.eval_tasks})")
    try:
        args.marks = [float(m) for m in args.marks.split(",") if m.strip()]
    except ValueError:
        raise Refused(f"--marks: comma-separated minutes, got {args.marks!r}") from None
    if not args.marks or args.marks != sorted(set(args.marks)) or args.marks[0] <= 0:
        raise Refused(f"--marks: increasing minutes > 0, got {','.join(f'{m:g}' for m in args.marks)}")
    return args


# Options recipe_argv sets; --options may not (each recipe's own are refused too, in common_options).
OWN_OPTIONS = ("--preset", "--run-dir", "--run.iterations", "--run.max_minutes", "--eval.every", "--eval.tasks")


def common_options(text: str, study: Study = STUDY) -> list[str]:
    """--options as argv, or Refused naming an option this script or a recipe sets (checked against
    orchestrate.rl's own parser later, in `resolved`)."""
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise Refused(f"--options: {exc} in {text!r}") from None
    names = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
    taken = {*OWN_OPTIONS, *(o for r in study.recipes.values() for o in r.overrides if o.startswith("--"))}
    clash = [n for n in names if n in taken]
    if clash:
        raise Refused(f"--options: {', '.join(clash)} is set by this script or by a recipe (see RECIPES)")
    if argv and not argv[0].startswith("--"):
        raise Refused(f"--options: starts with {argv[0]!r}, not an --option")
    return argv


# -- recipes and their run directories -----------------------------------------------------------------------


def recipe_argv(name: str, args: argparse.Namespace, run_dir: Path, max_minutes: float,
                study: Study = STUDY) -> list[str]:  # fmt: skip
    """orchestrate.rl's arguments for one recipe's run."""
    argv = ["--preset", study.recipes[name].preset, "--run-dir", str(run_dir), "--run.iterations", str(ITERATIONS),
            "--run.max_minutes", f"{max_minutes:g}", "--eval.every", str(args.eval_every)]  # fmt: skip
    if args.eval_tasks is not None:
        argv += ["--eval.tasks", str(args.eval_tasks)]
    return argv + list(study.recipes[name].overrides) + args.options


def resolved(name: str, argv: list[str]) -> dict:
    """The recipe's config as `orchestrate.rl --print-config` resolves it (its own parser, in this process),
    or Refused with the parser's line."""
    from orchestrate.loop.command_line import parse_args as rl_parse_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            _, config = rl_parse_args(argv)
    except SystemExit:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        line = (lines[-1] if lines else "refused").removeprefix("uv run -m orchestrate.rl: ").removeprefix("error: ")
        raise Refused(f"recipe {name}: orchestrate.rl refuses its options: {line}") from None
    return config.model_dump(mode="json")


def check_run_dir(name: str, run_dir: Path, config: dict) -> None:
    """A run directory already there must hold this recipe's run with these options (those a resume may
    change aside: orchestrate.rl's RESUMABLE, the time budget among them)."""
    from contract.rundir import RunDir, RunDirError
    from orchestrate.loop.resume import config_differences
    from orchestrate.rl import RESUMABLE

    try:
        saved = RunDir(run_dir).saved_config()
    except RunDirError as exc:
        raise Refused(f"recipe {name}: {exc}") from None
    if saved is None:
        return
    changed = [d for d in config_differences(saved, config) if d not in RESUMABLE]
    if changed:
        raise Refused(f"recipe {name}: {run_dir} holds a run with other settings ({', '.join('--' + c for c in changed)}"
                      "): another recipe's, or other --eval-every / --eval-tasks / --options; pass another --out or its options")  # fmt: skip


def done_marker(out: Path, name: str) -> Path:
    return out / f"{name}.done"


def options_of(out: Path, name: str) -> list[str]:
    """The --options a recipe's ended run had (its OUT/RECIPE.done), [] if none or not ended."""
    try:
        return list(json.loads(done_marker(out, name).read_text()).get("options", []))
    except (OSError, ValueError, AttributeError):
        return []


def minutes_left(out: Path, name: str, minutes: float) -> float:
    """Minutes this recipe's run still has: 0 when it ended with at least `minutes` (OUT/RECIPE.done) or used
    them; else `minutes` less those its commands used (a resumed run)."""
    marker, used = done_marker(out, name), timeline(read_metrics(out / name / "metrics.jsonl"))
    if used and marker.is_file() and json.loads(marker.read_text()).get("minutes", 0) >= minutes:
        return 0.0
    left = minutes - (used[-1][0] if used else 0.0)
    return left if left >= 0.01 else 0.0


def launch(argv: list[str], log: Path) -> int:
    """One run of orchestrate.rl, its stdout and stderr appended to `log`; its exit status."""
    with open(log, "a") as f:
        f.write(f"\n$ {sys.executable} -m orchestrate.rl {' '.join(argv)}   # {time.strftime('%Y-%m-%d %H:%M')}\n")
        f.flush()
        return subprocess.run([sys.executable, "-m", "orchestrate.rl", *argv], cwd=ROOT, stdout=f,
                              stderr=subprocess.STDOUT).returncode  # fmt: skip


# -- the table -----------------------------------------------------------------------------------------------


class Eval(NamedTuple):
    minutes: float
    iteration: int
    success: float


def timeline(records: list[dict]) -> list[tuple[float, dict]]:
    """(minutes from the start, record) of every record with a clock. A resumed run's records count from its
    own command's start (wall_time - elapsed_s): each later command adds the previous ones' minutes, each up to
    its last record."""
    out, offset, start, last = [], 0.0, None, 0.0
    for r in records:
        if not isinstance(r.get("elapsed_s"), (int, float)) or not isinstance(r.get("wall_time"), (int, float)):
            continue
        began = r["wall_time"] - r["elapsed_s"]
        if start is not None and abs(began - start) > 1.0:  # another command: the run was resumed
            offset += last
        start, last = began, r["elapsed_s"]
        out.append(((offset + r["elapsed_s"]) / 60, r))
    return out


def evaluations(records: list[dict]) -> list[Eval]:
    return [
        Eval(m, r["iteration"], r["eval_success_rate"])
        for m, r in timeline(records)
        if isinstance(r.get("eval_success_rate"), (int, float))
    ]


def cell(e: Eval | None) -> str:
    return "–" if e is None else f"{100 * e.success:.1f}% (it {e.iteration}, {e.minutes:.1f} min)"


def summary(records: list[dict], marks: list[float]) -> dict:
    """One recipe's row: iteration 0's evaluation, the latest at or before each mark, the best up to the last
    mark (the earliest of equals) and the iterations completed by then."""
    evals = evaluations(records)
    within = [e for e in evals if e.minutes <= marks[-1]]
    best = max(within, key=lambda e: (e.success, -e.minutes), default=None)
    iterations = [r["iteration"] for m, r in timeline(records) if m <= marks[-1]]
    return {
        "untrained": next((e for e in evals if e.iteration == 0), None),
        "at": {m: next((e for e in reversed(evals) if e.minutes <= m), None) for m in marks},
        "best": best,
        "iterations": max(iterations, default=0),
        "evals": evals,
    }


def table(rows: dict[str, dict], marks: list[float]) -> str:
    head = ["recipe", "untrained", *(f"at {m:g} min" for m in marks), f"best ≤ {marks[-1]:g} min",
            f"iterations ≤ {marks[-1]:g} min"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in rows.items():
        cells = [name, cell(s["untrained"]), *(cell(s["at"][m]) for m in marks), cell(s["best"]), str(s["iterations"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def runs(out: Path, marks: list[float], study: Study = STUDY) -> dict[str, dict]:
    """Every recipe's run found in OUT (OUT/RECIPE/metrics.jsonl), summarised at `marks`, in RECIPES' order."""
    rows = {}
    for name in study.recipes:
        records = read_metrics(out / name / "metrics.jsonl")
        if records:
            rows[name] = summary(records, marks)
    return rows


def report(out: Path, marks: list[float], plot_copy: Path | None, study: Study = STUDY) -> str:
    """OUT/table.md and OUT/<study>.png (copied to `plot_copy`) from every recipe's run found in OUT."""
    rows, recipes, png = runs(out, marks, study), study.recipes, out / f"{study.name}.png"
    if not rows:
        raise Refused(f"--out: no recipe's run in {out} (no {out}/RECIPE/metrics.jsonl); run the recipes first")
    ev = _first_config(out, rows).get("eval") or {}
    how = (f" ({ev['tasks'] or 'all'} held-out tasks at T = {ev['temperature']:g}, every {ev['every']} iterations)"
           if {"tasks", "temperature", "every"} <= set(ev) else "")  # fmt: skip
    extra = {name: shlex.join(options_of(out, name)) for name in rows}
    common = next(iter(extra.values())) if len(set(extra.values())) == 1 else ""
    text = "\n".join([
        f"Held-out success of {presets_of(recipes)} under each recipe, the same wall time each{how}"
        f"{f', with `{common}` added to every recipe' if common else ''}; a cell is "
        "the latest evaluation at or before that minute from the command's start (its iteration and minute). "
        f"Made by {study.made_by}.",
        "",
        table(rows, marks),
        "",
        *(f"- {name} ({recipes[name].paper}): `{' '.join(recipes[name].overrides)}`"
          + (f" + `{extra[name]}`" if extra[name] and not common else "") for name in rows),
        "",
    ])  # fmt: skip
    atomic_write_text(out / "table.md", text)
    plot(rows, marks, png, common, study.name, presets_of(recipes))
    write_sidecar(out / "table.md")  # the report's (table and plot); each run's own is RECIPE.provenance.json
    if plot_copy is not None and plot_copy.resolve() != png.resolve():
        plot_copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, plot_copy)
    return text


def _first_config(out: Path, rows: dict) -> dict:
    for name in rows:
        try:
            return json.loads((out / name / "config.json").read_text())
        except (OSError, ValueError):
            continue
    return {}


def plot(rows: dict[str, dict], marks: list[float], path: Path, options: str = "", what: str = "algorithms",
         start: str = f"the {PRESET} preset") -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, s in rows.items():
        ax.plot([e.minutes for e in s["evals"]], [100 * e.success for e in s["evals"]], marker="o", ms=3, label=name)
    for m in marks:
        ax.axvline(m, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("minutes from the command's start")
    ax.set_ylabel("held-out success (%)")
    ax.set_title(f"{start}: {what}, the same wall time each" + (f"\n(all with {options})" if options else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------------------------------


def writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise Refused(f"--out: {out} is not a writable folder ({exc.strerror or exc})") from None


def main(argv: list[str] | None = None, study: Study = STUDY) -> int:
    try:
        args = parse_args(argv, study)
        writable(args.out)
        if args.report_only:
            print(report(args.out, args.marks, args.plot, study))
            return 0
        for name in args.recipes:  # every recipe checked before any starts
            run_dir = args.out / name
            check_run_dir(name, run_dir, resolved(name, recipe_argv(name, args, run_dir, args.minutes, study)))
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    failed = []
    for name in args.recipes:
        run_dir, log = args.out / name, args.out / f"{name}.log"
        left = minutes_left(args.out, name, args.minutes)
        if left > 0:
            print(f"{name}: running {left:.1f} min in {run_dir} (log {log})", flush=True)
            code = launch(recipe_argv(name, args, run_dir, left, study), log)
            if code != 0:
                print(f"{name}: failed (exit {code}); see {log}", flush=True)
                failed.append(name)
                continue
        if left > 0 or not done_marker(args.out, name).is_file():  # (or it used its minutes, then we stopped)
            marker = {"minutes": args.minutes, **({"options": args.options} if args.options else {})}
            atomic_write_text(done_marker(args.out, name), json.dumps(marker) + "\n")
            write_sidecar(done_marker(args.out, name))
        s = summary(read_metrics(run_dir / "metrics.jsonl"), [math.inf])  # the whole run
        evals, used = s["evals"], timeline(read_metrics(run_dir / "metrics.jsonl"))
        print(f"{name}: {'ran' if left > 0 else 'reused'}, {used[-1][0] if used else 0:.1f} min, "
              f"{s['iterations']} iterations; held-out {cell(s['untrained'])} -> {cell(evals[-1] if evals else None)}"
              f", best {cell(s['best'])}", flush=True)  # fmt: skip
    try:
        print(report(args.out, args.marks, args.plot, study))
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if not failed else 1
    if failed:
        print(f"failed: {', '.join(failed)} (run the same command again to resume them)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
