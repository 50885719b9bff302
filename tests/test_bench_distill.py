"""bench/bench_distill.py's clock and its student's options."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from bench_distill import first_reaching, held_out, student_options  # noqa: E402


def test_held_out_leaves_the_evaluations_minutes_out(tmp_path):
    rows = [
        {"iteration": 0, "eval_success_rate": 0.3, "elapsed_s": 60.0, "time_eval": 30.0},
        {"iteration": 1, "elapsed_s": 120.0, "time_train": 50.0},
        {"iteration": 2, "eval_success_rate": 0.6, "elapsed_s": 240.0, "time_eval": 30.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert held_out(tmp_path) == [(1.0, 0.3, 0), (4.0, 0.6, 2)]
    # 30 s of evaluation before the first point, 60 s before the second
    assert held_out(tmp_path, evaluations=False) == [(0.5, 0.3, 0), (3.0, 0.6, 2)]
    assert first_reaching(held_out(tmp_path, evaluations=False), 0.6) == 3.0
    assert first_reaching(held_out(tmp_path), 0.7) is None
    # iteration 1's checkpoint measured afterwards: a point at the end of iteration 1, evaluations' minutes out
    assert held_out(tmp_path, evaluations=False, measured={1: 0.7}) == [(0.5, 0.3, 0), (1.5, 0.7, 1), (3.0, 0.6, 2)]
    assert first_reaching(held_out(tmp_path, measured={1: 0.7}), 0.7) == 2.0
    assert held_out(tmp_path, measured={2: 0.9}) == held_out(tmp_path)  # the run's own evaluation stands


def test_compare_curves_as_step_functions():
    from bench_distill import compare_curves

    # RL: 25% from the start, 60% from minute 9; the student: 25%, 10% from 3, 60% from 6, 40% from 12
    rl = [(1.0, 0.25, 0), (9.0, 0.6, 9)]
    student = [(0.5, 0.25, 0), (3.0, 0.1, 2), (6.0, 0.6, 4), (12.0, 0.4, 8)]
    out = compare_curves(student, rl, 15.0)
    # ahead 6-9 (3 min), behind 3-6 and 12-15 (6 min), level 0-3 and 9-12 (6 min)
    assert out["minutes"] == pytest.approx({"ahead": 3.0, "level": 6.0, "behind": 6.0})
    assert out["mean_success"]["rl"] == pytest.approx((9 * 0.25 + 6 * 0.6) / 15)
    assert out["mean_success"]["student"] == pytest.approx((3 * 0.25 + 3 * 0.1 + 6 * 0.6 + 3 * 0.4) / 15)
    # an evaluation after `until` does not count
    assert compare_curves(student, rl + [(20.0, 0.0, 12)], 15.0) == out


def test_student_options_replace_a_default_given_again():
    assert student_options("T", []) == [
        "--teacher.model", "T", "--train.estimator", "zero", "--rollouts.temperature", "1.0", "--eval.every", "2",
    ]  # fmt: skip
    options = student_options("T", ["--train.estimator", "batch", "--teacher.coef", "1"])
    assert options.count("--train.estimator") == 1
    assert options[options.index("--train.estimator") + 1] == "batch"
    assert "--rollouts.temperature" in options and options[-2:] == ["--teacher.coef", "1"]


@pytest.mark.parametrize("option", ["--run.seed", "--run.seed=1", "--env.options", "--eval.tasks"])
def test_student_options_that_change_the_held_out_tasks_are_refused(option):
    with pytest.raises(ValueError, match=f"^--student-options {option.split('=')[0]}: changes the held-out"):
        student_options("T", [option, "1"] if "=" not in option else [option])


def test_the_newest_checkpoint_is_measured_when_the_run_did_not_evaluate_it(tmp_path):
    from bench_distill import newest_checkpoint

    from contract.rundir import WEIGHTS_FILE, RunDir

    run = RunDir(tmp_path)
    for i in (5, 6):
        run.checkpoint(i).mkdir(parents=True)
        (run.checkpoint(i) / WEIGHTS_FILE).write_text("{}")
    points = [(0.5, 0.3, 0), (2.0, 0.6, 5)]
    measured = []

    def measure(run_dir, iteration):
        measured.append((run_dir, iteration))
        return 0.65

    # the run stopped after checkpoint 6, its last evaluation was of 5: 6 is measured, not labelled with 5's
    assert newest_checkpoint(tmp_path, points, measure) == (run.checkpoint(6), 0.65, 6, "orchestrate.eval --version 6")
    assert measured == [(tmp_path, 6)]
    # evaluated by the run: its own figure, nothing measured again
    assert newest_checkpoint(tmp_path, [*points, (3.0, 0.7, 6)], measure) == (
        run.checkpoint(6), 0.7, 6, "the run's evaluation")  # fmt: skip
    assert len(measured) == 1


def test_the_plot_labels_read_the_runs_resolved_configs(tmp_path):
    from bench_distill import rl_setting, setting

    from contract.rundir import RunDir

    student, rl = RunDir(tmp_path / "student"), RunDir(tmp_path / "rl")
    for run in (student, rl):
        run.root.mkdir()
    student.save_config({"rollouts": {"tasks_per_iteration": 16, "attempts": 2}, "teacher": {"coef": 1.0},
                         "train": {"lr": 2e-5, "estimator": "batch"}})  # fmt: skip
    rl.save_config({"tree": {"width": 3}, "train": {"algorithm": "grpo", "estimator": "tree"}})
    assert setting(student.root) == "lr 2e-05, 16 tasks x 2, batch + teacher x 1"
    assert rl_setting(rl.root) == "GRPO, tree, trees of width 3"
    student.save_config({"rollouts": {"tasks_per_iteration": 16, "attempts": 2},
                         "teacher": {"coef": 0.0, "topk": 20, "topk_coef": 1.0},
                         "train": {"lr": 2e-5, "estimator": "zero"}})  # fmt: skip
    assert setting(student.root) == "lr 2e-05, 16 tasks x 2, top-20 x 1"


def test_held_out_reads_the_curve_a_run_was_evaluated_into_afterwards(tmp_path):
    from bench_distill import CURVE

    curve = tmp_path / CURVE / "curve.json"
    curve.parent.mkdir(parents=True)
    points = [{"version": 0, "minutes": 0.0, "training_minutes": 0.0, "pass@1": {"value": 0.3, "ci95": [0.2, 0.4]}},
              {"version": 2, "minutes": 1.5, "training_minutes": 1.2, "pass@1": {"value": 0.5, "ci95": [0.4, 0.6]}}]  # fmt: skip
    curve.write_text(json.dumps({"run": str(tmp_path), "points": points}))
    assert held_out(tmp_path) == [(0.0, 0.3, 0), (1.5, 0.5, 2)]
    assert held_out(tmp_path, evaluations=False) == [(0.0, 0.3, 0), (1.2, 0.5, 2)]


def test_a_runs_checkpoints_go_once_its_curve_is_written_but_the_teachers(tmp_path):
    from bench_distill import CURVE, drop_evaluated

    from contract.rundir import WEIGHTS_FILE, RunDir

    run = RunDir(tmp_path)
    for i in (1, 2, 3):
        run.checkpoint(i).mkdir(parents=True)
        (run.checkpoint(i) / WEIGHTS_FILE).write_text("{}")
    drop_evaluated(tmp_path, keep=run.checkpoint(3))  # no curve yet: nothing is deleted
    assert all(run.checkpoint(i).is_dir() for i in (1, 2, 3))
    (tmp_path / CURVE).mkdir(parents=True)
    (tmp_path / CURVE / "curve.json").write_text("{}")
    drop_evaluated(tmp_path, keep=run.checkpoint(3))
    assert [run.checkpoint(i).is_dir() for i in (1, 2, 3)] == [False, False, True]
    drop_evaluated(tmp_path)
    assert not run.checkpoint(3).exists()


def test_a_teacher_no_better_than_the_untrained_model_starts_no_student(tmp_path, monkeypatch, capsys):
    import bench_distill

    grpo = tmp_path / "game-grpo"
    grpo.mkdir()
    rows = [
        {"iteration": i, "eval_success_rate": 0.25, "elapsed_s": 60.0 * (i + 1), "time_eval": 5.0} for i in (0, 3, 6)
    ]
    (grpo / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "game-teacher.json").write_text(json.dumps({"path": str(grpo), "success": 0.25, "iteration": 3}))
    started = []
    monkeypatch.setattr(bench_distill, "run", lambda *a, **k: started.append(a))
    monkeypatch.setattr(
        sys, "argv", ["bench_distill.py", "--preset", "game", "--reuse-grpo", "--out-dir", str(tmp_path)]
    )
    assert bench_distill.main() == 1
    assert started == [] and not (tmp_path / "game-distill").exists()
    assert "no better than the untrained model (25.0%): nothing to distill" in capsys.readouterr().err


def test_a_student_against_several_rl_runs(tmp_path):
    """bench/distill_vs_rl_runs.py: the student's curve from a bench_distill JSON, RL curves from bench_distill
    and bench_trees JSONs, each compared to the shorter curve's end; ahead / level / behind at the last evaluation
    within the minutes asked, and the runs' mean there."""
    from distill_vs_rl_runs import compare, read_curve

    distill = tmp_path / "distill.json"
    distill.write_text(json.dumps({"grpo": [[0.5, 0.25, 0], [9.0, 0.6, 9], [30.5, 0.6, 36]],
                                   "distill": [[0.5, 0.25, 0], [11.0, 0.6, 10], [29.0, 0.6, 30]]}))  # fmt: skip
    trees = tmp_path / "trees.json"
    trees.write_text(json.dumps({"runs": {"chain": {"curve": [{"minutes": 0.5, "success": 0.25, "iteration": 0},
                                                              {"minutes": 20.0, "success": 0.45, "iteration": 20}]}}}))  # fmt: skip
    student = read_curve(str(distill), "distill")
    runs = {"own": read_curve(str(distill), "grpo"), "chain": read_curve(f"{trees}:chain", "grpo")}
    assert runs["chain"] == [(0.5, 0.25, 0), (20.0, 0.45, 20)]
    with pytest.raises(ValueError, match="no arm 'tree'"):
        read_curve(f"{trees}:tree", "grpo")
    result = compare(student, runs, minutes=30.0)
    assert result["student_last"] == (29.0, 0.6, 30)
    assert result["runs"]["own"]["last"] == (9.0, 0.6, 9)  # 30.5 is past the 30 minutes
    assert result["rl_mean_last"] == pytest.approx((0.6 + 0.45) / 2)
    assert (result["student_ahead_of"], result["student_level_with"], result["student_behind"]) == (1, 1, 0)
    own = result["runs"]["own"]["curves"]  # to 29.0 (the student's end): behind from 9 to 11, level after
    assert own["until"] == 29.0
    assert own["minutes"] == pytest.approx({"ahead": 0.0, "level": 27.0, "behind": 2.0})
    chain = result["runs"]["chain"]["curves"]  # to 20.0 (the chain's end): ahead from 11
    assert chain["minutes"] == pytest.approx({"ahead": 9.0, "level": 11.0, "behind": 0.0})
