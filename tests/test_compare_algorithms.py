"""bench/compare_algorithms.py without vLLM: the table from hand-made metrics.jsonl files (the latest evaluation
at or before each minute, a resumed run's minutes added up, marks with none shown as –, the best), every
recipe accepted by orchestrate.rl's own parser, the refusals of bad input, and which runs are started, reused or
resumed (the run itself faked)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "compare_algorithms", Path(__file__).parent.parent / "bench" / "compare_algorithms.py"
)
ca = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ca)

T0 = 1_700_000_000.0


def write_run(out: Path, name: str, commands: list[tuple[float, list[tuple]]], config: dict | None = None) -> None:
    """OUT/NAME/metrics.jsonl: per command (its start, unix time), records (iteration, elapsed_s[, success])."""
    run = out / name
    run.mkdir(parents=True)
    lines = []
    for start, records in commands:
        for iteration, elapsed, *success in records:
            record = {"iteration": iteration, "elapsed_s": elapsed, "wall_time": round(start + elapsed, 3)}
            if success:
                record["eval_success_rate"] = success[0]
            lines.append(json.dumps(record))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if config is not None:
        (run / "config.json").write_text(json.dumps(config))


def hand_made(out: Path) -> None:
    # fmt: off
    # one command: evaluations at 2.2, 7.5, 9.6, 14.0, 21.0, 29.0 and 31.7 min (past 30: not in the table)
    write_run(out, "grpo", [(T0, [(0, 132.0, 0.315), (1, 180.0), (3, 450.0, 0.5), (6, 576.0, 0.64),
                                  (9, 840.0, 0.6), (12, 1260.0, 0.7), (14, 1740.0, 0.7), (15, 1900.0, 0.9)])])
    # resumed: the first command's last record at 11.0 min; the second command's records add 11.0 min
    write_run(out, "ppo", [(T0, [(0, 200.0, 0.315), (3, 660.0, 0.45)]),
                           (T0 + 5000.0, [(4, 150.0), (6, 390.0, 0.55)])])
    # no evaluation before training, the first one at 12.0 min
    write_run(out, "gspo", [(T0, [(1, 300.0), (3, 720.0, 0.2)])])
    # fmt: on


def test_the_table_takes_the_latest_evaluation_at_or_before_each_mark(tmp_path, capsys):
    hand_made(tmp_path)
    assert ca.main(["--out", str(tmp_path), "--report-only", "--plot", str(tmp_path / "copy.png")]) == 0
    text = (tmp_path / "table.md").read_text()
    assert text in capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows == [
        "| recipe | untrained | at 10 min | at 20 min | at 30 min | best ≤ 30 min | iterations ≤ 30 min |",
        # best: 70.0% first at iteration 12 (21.0 min); at 30: iteration 14's 70.0% (29.0 min); 0.9 at 31.7 min
        # is past the last mark
        "| grpo | 31.5% (it 0, 2.2 min) | 64.0% (it 6, 9.6 min) | 60.0% (it 9, 14.0 min) | 70.0% (it 14, 29.0 min) "
        "| 70.0% (it 12, 21.0 min) | 14 |",
        "| gspo | – | – | 20.0% (it 3, 12.0 min) | 20.0% (it 3, 12.0 min) | 20.0% (it 3, 12.0 min) | 3 |",
        # 660 s + 390 s = 17.5 min
        "| ppo | 31.5% (it 0, 3.3 min) | 31.5% (it 0, 3.3 min) | 55.0% (it 6, 17.5 min) | 55.0% (it 6, 17.5 min) "
        "| 55.0% (it 6, 17.5 min) | 6 |",
    ]
    for png in (tmp_path / "algorithms.png", tmp_path / "copy.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resumed_runs_minutes_add_up_its_commands():
    records = [{"iteration": 0, "elapsed_s": 60.0, "wall_time": T0 + 60.0},
               {"iteration": 1, "elapsed_s": 120.0, "wall_time": T0 + 120.0},
               {"iteration": 2, "elapsed_s": 30.0, "wall_time": T0 + 999.0},  # another command, began T0 + 969
               {"iteration": 3, "elapsed_s": 90.0, "wall_time": T0 + 1059.0},
               {"iteration": 4}]  # fmt: skip
    assert [(m, r["iteration"]) for m, r in ca.timeline(records)] == [(1.0, 0), (2.0, 1), (2.5, 2), (3.5, 3)]


def test_every_registered_algorithm_is_a_recipe_and_sets_what_its_paper_does():
    """The bench's recipes are the registry's algorithms (finetune.algorithms), each resolved by the command
    line's own parser: its loss, estimator, aggregation and paper's options (DAPO's reach the rollouts)."""
    args = ca.parse_args(["--out", "/nonexistent"])
    train = {}
    for name in ca.RECIPES:
        config = ca.resolved(name, ca.recipe_argv(name, args, Path("/nonexistent") / name, 30.0))
        assert config["run"]["max_minutes"] == 30.0 and config["run"]["iterations"] == ca.ITERATIONS
        assert config["eval"]["every"] == 3 and config["eval"]["tasks"] == 200  # the preset's 200
        assert config["train"]["kl_coef"] == 0.0  # the preset's: none adds a KL term
        t, r = config["train"], config["rollouts"]
        train[name] = (t["loss"], t["estimator"], t["aggregation"], t["normalize_std"],
                       t["grpo"]["clip_eps_high"], t["overlong_buffer"], r["dynamic_sampling"])  # fmt: skip
    from finetune.algorithms import ALGORITHMS

    assert list(train) == list(ALGORITHMS)  # every registered one (one added since too), in its order
    for name, a in ALGORITHMS.items():
        assert train[name][:3] == (a.loss, a.estimator, a.aggregation), name
    shipped = {  # what each paper sets, as the command line resolves it
        "grpo": ("grpo", "group", "token", True, 0.2, 0, False),
        "dr_grpo": ("grpo", "group", "token", False, 0.2, 0, False),
        "dapo": ("grpo", "group", "token", True, 0.28, 26, True),
        "gspo": ("gspo", "group", "sequence", True, 0.2, 0, False),
        "rloo": ("reinforce", "rloo", "token", True, 0.2, 0, False),
        "reinforce_pp": ("grpo", "reinforce_pp", "token", True, 0.2, 0, False),
        "reinforce": ("reinforce", "none", "token", True, 0.2, 0, False),
        "ppo": ("ppo", "group", "token", True, 0.2, 0, False),
    }
    assert {name: train[name] for name in shipped} == shipped


@pytest.fixture
def launched(monkeypatch):
    """ca.launch faked: a run with an evaluation every 10 minutes from minute 2 to past its max_minutes (as the
    loop ends after the time is up); rloo's run fails."""
    calls = []

    def launch(argv, log):
        run = Path(argv[argv.index("--run-dir") + 1])
        minutes = float(argv[argv.index("--run.max_minutes") + 1])
        calls.append((run.name, minutes))
        log.write_text("ran\n")
        if run.name == "rloo":
            return 1
        run.mkdir(exist_ok=True)
        (run / "config.json").write_text(json.dumps(ca.resolved(run.name, argv)))
        prior = ca.read_metrics(run / "metrics.jsonl")
        first, start = (prior[-1]["iteration"] + 1 if prior else 0), T0 + 10_000 * (len(prior) + 1)  # a new command
        with open(run / "metrics.jsonl", "a") as f:
            for k in range(int(minutes // 10) + 1):  # at 2, 12, 22, ... minutes of this command
                elapsed = 60.0 * (10 * k + 2)
                f.write(json.dumps({"iteration": first + k, "elapsed_s": elapsed, "wall_time": start + elapsed,
                                    "eval_success_rate": round(0.3 + 0.1 * k, 3)}) + "\n")  # fmt: skip
        return 0

    monkeypatch.setattr(ca, "launch", launch)
    return calls


def test_runs_are_started_reused_and_resumed_and_a_failure_does_not_stop_the_others(tmp_path, launched, capsys):
    out = tmp_path / "out"
    argv = ["--out", str(out), "--recipes", "grpo,rloo,gspo", "--plot", str(tmp_path / "p.png")]
    assert ca.main(argv) == 1  # rloo failed
    assert launched == [("grpo", 30.0), ("rloo", 30.0), ("gspo", 30.0)]
    printed = capsys.readouterr()
    assert (
        "grpo: ran, 32.0 min, 3 iterations; held-out 30.0% (it 0, 2.0 min) -> 60.0% (it 3, 32.0 min), "
        "best 60.0% (it 3, 32.0 min)"
    ) in printed.out
    assert f"rloo: failed (exit 1); see {out / 'rloo.log'}" in printed.out and "failed: rloo" in printed.err
    assert (out / "grpo.done").is_file() and not (out / "rloo.done").is_file()
    assert "| gspo |" in (out / "table.md").read_text() and "| rloo |" not in (out / "table.md").read_text()

    launched.clear()
    assert ca.main(["--out", str(out), "--recipes", "grpo,gspo", "--plot", str(tmp_path / "p.png")]) == 0
    assert launched == [] and "grpo: reused" in capsys.readouterr().out

    # longer: each resumes with the minutes it has left (40 - its last record's 32.0)
    assert ca.main(["--out", str(out), "--recipes", "grpo", "--minutes", "40", "--plot", str(tmp_path / "p.png")]) == 0
    assert launched == [("grpo", pytest.approx(8.0))]
    assert "grpo: ran, 34.0 min, 4 iterations" in capsys.readouterr().out  # 32.0 + the new command's 2.0
    assert json.loads((out / "grpo.done").read_text()) == {"minutes": 40.0}


def bad(capsys, argv) -> tuple[int, str]:
    code = ca.main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return code, err[0]


@pytest.mark.parametrize(
    "extra, start",
    [
        (["--recipes", "grpo,foo"], "error: --recipes: unknown recipe 'foo'"),
        (["--minutes", "0"], "error: --minutes: a number of minutes > 0"),
        (["--minutes", "nan"], "error: --minutes: a number of minutes > 0"),
        (["--minutes", "abc"], "error: argument --minutes: invalid float value"),
        (["--eval-every", "0"], "error: --eval-every:"),
        (["--eval-tasks", "0"], "error: --eval-tasks:"),
        (["--marks", "20,10"], "error: --marks:"),
        (["--recipe", "grpo"], "error: unrecognized arguments: --recipe"),
        (["--options", "--train.algorithm ppo"], "error: --options: --train.algorithm is set by this script or by a"),
        (["--options=--run-dir=/tmp/x"], "error: --options: --run-dir is set by this script or by a recipe"),
        (["--options", "--train.lr '1e-5"], "error: --options: No closing quotation"),
        (["--options", "4 --train.steps_per_epoch"], "error: --options: starts with '4', not an --option"),
        (["--options", "--train.steps_per_epoch 0"], "error: recipe grpo: orchestrate.rl refuses its options: --train"),
    ],
)
def test_bad_input_is_refused_with_one_line(tmp_path, capsys, launched, extra, start):
    code, line = bad(capsys, ["--out", tmp_path / "out", *extra])
    assert code == 2 and line.startswith(start), line
    assert launched == []


def test_an_out_that_is_not_a_writable_folder_is_refused(tmp_path, capsys, launched):
    (tmp_path / "file").write_text("")
    code, line = bad(capsys, ["--out", tmp_path / "file" / "out"])
    assert code == 2 and line.startswith(f"error: --out: {tmp_path / 'file' / 'out'} is not a writable folder"), line


def test_a_run_directory_of_another_recipe_is_refused_before_anything_starts(tmp_path, capsys, launched):
    out = tmp_path / "out"
    args = ca.parse_args(["--out", str(out)])
    ppo = ca.resolved("ppo", ca.recipe_argv("ppo", args, out / "ppo", 30.0))
    write_run(out, "rloo", [(T0, [(0, 60.0, 0.3)])], config=ppo)
    code, line = bad(capsys, ["--out", out, "--recipes", "grpo,rloo"])
    assert code == 2 and line.startswith(f"error: recipe rloo: {out / 'rloo'} holds a run with other settings ("), line
    assert "--train.algorithm" in line and "--train.estimator" in line and "--run.max_minutes" not in line
    assert launched == []  # grpo, which is fine, did not start either

    # the same recipe with another --eval-every is not this run; with another --minutes it is
    write_run(out, "grpo", [(T0, [(0, 60.0, 0.3)])], config=ca.resolved("grpo", ca.recipe_argv("grpo", args, out, 30)))
    code, line = bad(capsys, ["--out", out, "--recipes", "grpo", "--eval-every", "5"])
    assert code == 2 and "(--eval.every)" in line, line
    assert ca.main(["--out", str(out), "--recipes", "grpo", "--minutes", "20", "--plot", str(tmp_path / "p.png")]) == 0


def test_options_reach_every_recipe_and_are_named_in_the_marker_table_and_plot(tmp_path, capsys, launched):
    out = tmp_path / "out"
    argv = ["--out", str(out), "--recipes", "grpo,gspo", "--options", "--train.steps_per_epoch 4 --train.lr 2e-5"]
    assert ca.main(argv) == 0
    for name in ("grpo", "gspo"):
        config = json.loads((out / name / "config.json").read_text())
        assert config["train"]["steps_per_epoch"] == 4 and config["train"]["lr"] == 2e-5
        marker = json.loads((out / f"{name}.done").read_text())
        assert marker == {"minutes": 30.0, "options": ["--train.steps_per_epoch", "4", "--train.lr", "2e-5"]}
    text = (out / "table.md").read_text()
    assert "with `--train.steps_per_epoch 4 --train.lr 2e-5` added to every recipe;" in text
    assert "- grpo (arXiv:2402.03300): `--train.algorithm grpo`\n" in text
    capsys.readouterr()

    # the same run directories with other options are another experiment: refused before anything starts
    launched.clear()
    code, line = bad(capsys, ["--out", out, "--recipes", "grpo", "--options", "--train.steps_per_epoch 2"])
    assert code == 2 and "--train.steps_per_epoch)" in line and launched == [], line

    # recipes that ran with different options: each recipe's line names its own
    (out / "gspo.done").write_text(json.dumps({"minutes": 30.0}))
    text = ca.report(out, [10.0, 20.0, 30.0], None)
    assert "added to every recipe" not in text
    assert "--train.algorithm grpo` + `--train.steps_per_epoch 4 --train.lr 2e-5`" in text
    assert "- gspo (arXiv:2507.18071): `--train.algorithm gspo`\n" in text


def test_report_only_without_runs_is_refused(tmp_path, capsys):
    code, line = bad(capsys, ["--out", tmp_path, "--report-only"])
    assert code == 2 and line.startswith("error: --out: no recipe's run in"), line


@pytest.mark.parametrize("record", ["algorithms", "algorithms_steps4"])
def test_the_docs_show_the_table_of_the_recorded_runs(record):
    """docs/results.md's tables are the script's own, from the runs kept in bench/results/compare_algorithms/RECORD
    (not a copy typed by hand), and its table.md was rebuilt from the same runs."""
    root = Path(__file__).parent.parent
    kept = root / "bench" / "results" / "compare_algorithms" / record
    rows = ca.runs(kept, [10, 20, 30])
    assert rows, f"{kept} holds no recipe's run"
    made = ca.table(rows, [10, 20, 30])
    assert made in (root / "docs" / "results.md").read_text()
    assert made in (kept / "table.md").read_text()
