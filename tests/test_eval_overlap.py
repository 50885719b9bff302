"""eval.overlap: with async_level 0 an evaluation plays after the next batch is handed to the trainer (while it
trains), on the weights it evaluates; the run's end, a time limit and a kill in between lose nothing. Through
`orchestrate.rl`'s main and the real Loop with test_time_limit's fakes (no vLLM), the evaluation itself faked
to record when it played."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from contract.rundir import RunDir
from orchestrate.loop import iteration as loop_module
from orchestrate.loop.command_line import resolve
from orchestrate.loop.config_checks import ConfigError, check_colocation, overlap_eval
from orchestrate.loop.metrics import read_metrics
from orchestrate.loop.setup import interrupting_signals
from tests.test_time_limit import completed, fake_loop  # noqa: F401 (the fixture)


def command(run, model, *extra, iterations=4, every=2, overlap="on"):
    return ["--run-dir", str(run), "--model.policy", str(model), "--iterations", str(iterations), "--eval.every",
            str(every), "--eval.overlap", overlap, "--rollouts.tasks_per_iteration", "2", "--rollouts.attempts", "2",
            *extra]  # fmt: skip


@pytest.fixture
def evaluations(monkeypatch, fake_loop):  # noqa: F811
    """Each evaluation as (iteration, version served, batches written, checkpoints the trainer was asked for)."""
    played = []

    def evaluate(self, i):
        batches = sorted(int(p.stem) for p in RunDir(self.run.root).batches.glob("*.jsonl"))
        played.append((i, self.servers.served, batches, list(self.trainer.trained)))
        return {"eval_success_rate": 0.5}

    monkeypatch.setattr(loop_module.Loop, "evaluate", evaluate)
    return played


def test_an_evaluation_plays_while_the_trainer_trains_the_next_batch(tmp_path, folder_model, evaluations):
    from orchestrate import rl

    run = tmp_path / "run"
    assert rl.main(command(run, folder_model)) == 0
    # iteration 2's evaluation: checkpoint 2 served, batch 3 written, checkpoint 3 not yet waited for; the last
    # one (4) has no next batch and plays at once
    assert evaluations == [(0, 0, [], []), (2, 2, [1, 2, 3], [1, 2]), (4, 4, [1, 2, 3, 4], [1, 2, 3, 4])]
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1, 2, 3, 4]
    assert [m["iteration"] for m in metrics if "eval_success_rate" in m] == [0, 2, 4]
    assert completed(run) == 4


def test_off_it_plays_before_the_next_rollouts(tmp_path, folder_model, evaluations):
    from orchestrate import rl

    run = tmp_path / "run"
    assert rl.main(command(run, folder_model, overlap="off")) == 0
    assert evaluations == [(0, 0, [], []), (2, 2, [1, 2], [1, 2]), (4, 4, [1, 2, 3, 4], [1, 2, 3, 4])]


def test_at_the_time_limit_the_deferred_evaluation_plays_and_is_recorded(tmp_path, folder_model, evaluations):
    """A minute per iteration, 1.5 minutes: iteration 1's evaluation waits for batch 2; no iteration 3 starts,
    so iteration 2's plays at once. Both are recorded."""
    from orchestrate import rl

    run = tmp_path / "run"
    assert rl.main(command(run, folder_model, "--run.max_minutes", "1.5", iterations=5, every=1)) == 0
    assert [e[:3] for e in evaluations] == [(0, 0, []), (1, 1, [1, 2]), (2, 2, [1, 2])]
    assert completed(run) == 2
    assert [m["iteration"] for m in read_metrics(run / "metrics.jsonl") if "eval_success_rate" in m] == [0, 1, 2]


def test_a_kill_while_an_evaluation_waits_loses_nothing(tmp_path, folder_model, evaluations, monkeypatch):
    """Killed in iteration 3's rollouts, iteration 2 served and not evaluated: not complete. The same command
    serves checkpoint 2 again, evaluates it on those weights, and goes on."""
    from orchestrate import rl

    rollouts = loop_module.Loop._rollouts

    async def killed_at_3(self, spec, seeds, attempts, iteration, *args, **kwargs):
        if iteration == 3:
            raise KeyboardInterrupt
        return await rollouts(self, spec, seeds, attempts, iteration, *args, **kwargs)

    run = tmp_path / "run"
    argv = command(run, folder_model)
    monkeypatch.setattr(loop_module.Loop, "_rollouts", killed_at_3)
    assert rl.main(argv) == 130  # as Ctrl-C or SIGTERM ends it
    assert completed(run) == 1 and [e[0] for e in evaluations] == [0]
    monkeypatch.setattr(loop_module.Loop, "_rollouts", rollouts)
    assert rl.main(argv) == 0
    assert [(e[0], e[1]) for e in evaluations] == [(0, 0), (2, 2), (4, 4)]
    assert completed(run) == 4
    assert [m["iteration"] for m in read_metrics(run / "metrics.jsonl")] == [0, 1, 2, 3, 4]


async def interrupt_where_a_cancel_is_swallowed(sig=signal.SIGINT):
    """Send `sig` to this process, then wait in code that swallows a cancel (as a call did in a real run)."""
    os.kill(os.getpid(), sig)
    try:
        await asyncio.sleep(2)
    except asyncio.CancelledError:
        pass  # swallowed


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_in_the_rollouts_ends_the_run_even_where_the_cancel_is_swallowed(
    tmp_path, folder_model, evaluations, monkeypatch, sig, terminal_sigint
):
    """Ctrl-C or SIGTERM in iteration 2's rollouts, inside a call that swallows a cancel (as httpcore's shielded
    close does; asyncio.run turns a SIGINT into a cancel of its task, and the run went on): the run ends at
    once, as a kill does (130, iteration 1 complete), and the handlers from before are back after."""
    from orchestrate import rl

    monkeypatch.setattr(loop_module, "interrupting_signals", interrupting_signals)
    rollouts = loop_module.Loop._rollouts

    async def interrupted_at_2(self, spec, seeds, attempts, iteration, *args, **kwargs):
        if iteration == 2:
            await interrupt_where_a_cancel_is_swallowed(sig)
        return await rollouts(self, spec, seeds, attempts, iteration, *args, **kwargs)

    monkeypatch.setattr(loop_module.Loop, "_rollouts", interrupted_at_2)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert rl.main(command(tmp_path / "run", folder_model)) == 130
    assert completed(tmp_path / "run") == 1
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_sigint_ignored_from_the_start_stays_ignored(capsys, terminal_sigint):
    """Under nohup or a shell's `&` SIGINT is ignored from the start: the loop leaves it so (SIGTERM still ends
    it), says so with its process id, and puts both back after."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        term = signal.getsignal(signal.SIGTERM)
        with interrupting_signals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (term, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is term
        assert (
            f"SIGINT is ignored in this process (started with nohup or in the background): stop it with SIGTERM (kill {os.getpid()})"
            in capsys.readouterr().out
        )
    finally:
        signal.signal(signal.SIGINT, before)
    with interrupting_signals():  # a terminal's SIGINT (the fixture's): nothing to say
        pass
    assert "SIGINT is ignored" not in capsys.readouterr().out


def test_auto_overlaps_only_where_the_servers_and_the_learner_compute_apart():
    """On shared CPU cores an overlapped evaluation slowed the run 2.3x (bench/results/bench_eval_overlap/eval_overlap_embedded-shared.json):
    auto overlaps on split cores, on GPUs not colocated, with servers by URL; never colocated nor above level 0."""

    def config(**overrides):
        return resolve("embedded", {k.replace("__", "."): v for k, v in overrides.items()})

    assert not overlap_eval(config(), count=0)  # CPU, the cores shared
    assert overlap_eval(config(server__cpus="0", trainer__cpus="1"), count=0)
    assert overlap_eval(config(eval__overlap="on"), count=0)
    assert not overlap_eval(config(server__cpus="0", trainer__cpus="1", eval__overlap="off"), count=0)
    assert not overlap_eval(config(run__async_level="1", eval__overlap="on"), count=0)  # it overlaps anyway
    assert not overlap_eval(config(), count=2)  # GPUs: the servers and the learner both on GPU 0, colocated
    base = config()
    learner_apart = base.model_copy(update={"trainer": base.trainer.model_copy(update={"gpus": "1"})})
    assert overlap_eval(learner_apart, count=2)
    assert overlap_eval(config(server__policy_urls=["http://elsewhere:8000"]), count=0)
    with pytest.raises(ConfigError, match=r"^--eval.overlap: on plays evaluations while the learner trains, but "):
        check_colocation(config(eval__overlap="on"), count=1)
    with pytest.raises(ConfigError, match=r"^--eval.overlap: "):
        config(eval__overlap="yes")
