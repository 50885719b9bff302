"""--run.max_minutes (issue 25.5): the loop starts no new iteration once the time is up, ends like a run that
reached run.iterations, and the same command resumes it. Through `orchestrate.rl`'s main and the real Loop,
with its set-up (servers, trainer) and its rollouts faked: a fake trainer "trains" each batch in one minute of
the loop's clock (it moves the command's start back by 60 s). No vLLM."""

from __future__ import annotations

import contextlib
import json

import pytest

from contract.rundir import RunDir
from orchestrate.loop import iteration as loop_module
from orchestrate.loop import report as report_module
from orchestrate.loop.metrics import read_metrics
from orchestrate.loop.servers import Servers
from tests.test_dynamic_sampling import episode


class FakeTrainer:
    """Publishes checkpoint j when the loop waits for it (its batch must be written), a minute later."""

    def __init__(self, loop):
        self.loop, self.run = loop, loop.run
        self.trained: list[int] = []

    def newest_checkpoint(self) -> int:
        return self.run.newest_checkpoint()

    def wait_for_checkpoint(self, j, progress=False, desc=None):
        assert self.run.batch(j).is_file(), f"checkpoint {j} waited for before its batch was written"
        if self.run.checkpoint(j).is_dir():  # a resumed run's: trained before the stop
            return self.run.checkpoint(j)
        self.trained.append(j)
        self.run.checkpoint(j).mkdir(parents=True)
        (self.run.checkpoint(j) / "config.json").write_text("{}")
        self.loop.started -= 60.0  # a minute of training on the loop's clock
        return self.run.checkpoint(j)

    def weights_changed(self, j) -> bool:
        return True

    def iteration_metrics(self, j) -> dict:
        return {}


class FakeServer:
    base_url, headers = "http://policy", {}

    async def healthy(self):
        return True

    def reload_weights(self, path, verify=True):
        pass


@pytest.fixture
def fake_loop(monkeypatch):
    """The real Loop with its servers, trainer and rollouts faked; yields the trainers it made, one per command."""
    trainers = []

    def start(self, stack):
        from orchestrate.loop.evaluation import Evaluation

        self.train_env, self.evaluation = None, Evaluation(self.config, self.run)
        self.trainer = FakeTrainer(self)
        trainers.append(self.trainer)
        self.servers = Servers(self.config, self.run, None, [FakeServer()], progress=False)
        self.servers.use(self.trainer)
        self.servers.weights.served = self.trainer.newest_checkpoint()  # as resuming leaves it

    async def rollouts(self, spec, seeds, attempts, iteration, sampling, desc, follow=False, tree=None):
        tapes = [episode(s, float(a % 2), iteration=iteration) for s in seeds for a in range(attempts)]
        return tapes, 0.0, 0.0

    monkeypatch.setattr(loop_module.Loop, "_start", start)
    monkeypatch.setattr(loop_module.Loop, "_rollouts", rollouts)
    monkeypatch.setattr(loop_module, "interrupting_signals", contextlib.nullcontext)
    monkeypatch.setattr(report_module, "plot_metrics", lambda records, path: None)  # matplotlib: seconds
    return trainers


def command(run, model, *extra):
    return ["--run-dir", str(run), "--model.policy", str(model), "--iterations", "5", "--eval.every", "0",
            "--rollouts.tasks_per_iteration", "2", "--rollouts.attempts", "2", *extra]  # fmt: skip


def completed(run) -> int:
    return json.loads((run / "state.json").read_text())["completed_iteration"]


def test_the_time_limit_ends_the_run_after_the_iteration_in_progress_and_the_same_command_resumes(
    tmp_path, folder_model, fake_loop, capsys
):
    """A minute per iteration, 1.5 minutes per command: iteration 1 ends at 1.0 min (go on), iteration 2 at
    2.0 (>= 1.5: no iteration 3). Each command does 2 of the 5 iterations; the third reaches run.iterations."""
    from orchestrate import rl

    run = tmp_path / "run"
    argv = command(run, folder_model, "--run.max_minutes", "1.5")
    assert rl.main(argv) == 0
    out = capsys.readouterr().out
    assert "Stopped at the time limit (--run.max_minutes 1.5) after iteration 2 of 5" in out, out
    assert completed(run) == 2 and fake_loop[0].trained == [1, 2]
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [1, 2]
    assert [round(m["elapsed_s"] / 60) for m in metrics] == [1, 2]  # the clock the limit is read on
    assert sorted(p.name for p in RunDir(run).batches.iterdir()) == ["000001.jsonl", "000002.jsonl"]
    assert RunDir(run).read_phase()["phase"] == "done" and RunDir(run).read_phase()["iteration"] == 2

    assert rl.main(argv) == 0  # the same command: a new budget
    out = capsys.readouterr().out
    assert "Resuming" in out and "after iteration 4 of 5" in out, out
    assert completed(run) == 4 and fake_loop[1].trained == [3, 4]

    assert rl.main(argv) == 0  # iteration 5 is the last one: no time-limit line
    out = capsys.readouterr().out
    assert completed(run) == 5 and fake_loop[2].trained == [5] and "time limit" not in out, out
    assert [m["iteration"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_a_tiny_limit_still_completes_one_iteration(tmp_path, folder_model, fake_loop, capsys):
    from orchestrate import rl

    run = tmp_path / "run"
    assert rl.main(command(run, folder_model, "--run.max_minutes", "0.001")) == 0
    assert "after iteration 1 of 5" in capsys.readouterr().out
    assert completed(run) == 1 and len(read_metrics(run / "metrics.jsonl")) == 1


def test_at_async_level_1_the_batches_generated_ahead_are_trained_before_the_run_ends(
    tmp_path, folder_model, fake_loop, capsys
):
    """Level 1: batch 2 is generated before checkpoint 1 is waited for. Checks at iterations 2 (0 min) and 3
    (1.0 min) pass; at 4 (2.0 min) none is generated, and batch 3, generated ahead, is trained and recorded."""
    from orchestrate import rl

    run = tmp_path / "run"
    assert rl.main(command(run, folder_model, "--run.max_minutes", "1.5", "--run.async_level", "1")) == 0
    assert "after iteration 3 of 5" in capsys.readouterr().out
    assert completed(run) == 3 and fake_loop[0].trained == [1, 2, 3]
    assert [m["iteration"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(p.name for p in RunDir(run).batches.iterdir()) == ["000001.jsonl", "000002.jsonl", "000003.jsonl"]


def test_the_limit_may_change_on_resume_and_other_options_may_not(tmp_path, folder_model, fake_loop, rl_cli):
    """(The refusal releases the run directory's lock: the next command in this process may take it.)"""
    run = tmp_path / "run"
    assert rl_cli(command(run, folder_model, "--run.max_minutes", "0.001"))[0] == 0
    assert rl_cli(command(run, folder_model, "--run.max_minutes", "0.001", "--rollouts.temperature", "1")) == (
        2,
        f"error: {run} was started with other settings (--rollouts.temperature); resume it with the same options, "
        "or pass a new --run-dir",
    )
    assert rl_cli(command(run, folder_model, "--run.max_minutes", "30"))[0] == 0  # a new budget
    assert rl_cli(command(run, folder_model))[0] == 0  # or none
    assert completed(run) == 5


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_a_limit_that_is_not_a_positive_number_is_refused(tmp_path, folder_model, rl_cli, value):
    run = tmp_path / "run"
    code, line = rl_cli(command(run, folder_model, "--run.max_minutes", value))
    assert code == 2 and line.startswith("error: --run.max_minutes:"), line
    assert not run.exists()


def test_a_batch_of_which_no_episode_can_be_trained_on_ends_the_run_in_one_line_naming_the_cause(
    tmp_path, folder_model, fake_loop, monkeypatch, capsys
):
    """Every episode failed (here, an agent program that made no LLM call: its empty answer was scored): exit 1,
    one line that names the cause, not a traceback and not the reward's reason."""
    from orchestrate import rl
    from tapes.tape import EnvObservation

    async def no_calls(self, spec, seeds, attempts, iteration, sampling, desc, follow=False, tree=None):
        tapes = []
        for s in seeds:
            for _ in range(attempts):
                tape = episode(s, 0.0, iteration=iteration)
                tape.steps, tape.llm_calls = [EnvObservation(text="y", turn=0, reward=0.0)], []
                tape.metadata.author, tape.metadata.reward_reason = "my_agent:play", "no \\boxed{} answer"
                tapes.append(tape)
        return tapes, 0.0, 0.0

    monkeypatch.setattr(loop_module.Loop, "_rollouts", no_calls)
    assert rl.main(command(tmp_path / "run", folder_model)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: no episode of 4 can be trained on; the first's: the agent (my_agent:play) made no LLM "
                   "call (no \\boxed{} answer)"], err  # fmt: skip
