"""Dynamic sampling (DAPO, issue 25.3): which groups are dropped, which extra seeds are drawn, the bound, the
marks on the tapes and the batch written from the kept groups, the loop's generate() with a fake rollout, and
the refusals of the option. No vLLM."""

from __future__ import annotations

import pytest

from agents.env_spec import EnvSpec
from contract.batch import read_batch
from contract.rundir import RunDir
from finetune.config import TrainConfig
from orchestrate.loop.command_line import resolve
from orchestrate.loop.config import RLConfig
from orchestrate.loop.config_checks import ConfigError
from orchestrate.loop.dynamic_sampling import (
    SPREAD_TOLERANCE,
    dropped,
    dynamic_metrics,
    has_signal,
    iteration_seeds,
    sample_dynamically,
)
from orchestrate.loop.metrics import read_metrics
from orchestrate.loop.rollouts import new_tape
from tapes.store import read_tapes
from tapes.tape import EnvAction, EnvObservation, LLMCall, SamplingParams

SPEC = EnvSpec("math:arithmetic", {}, "train", 0)


def episode(seed, rewards, *, iteration=1, n_tokens=3, error=None, max_tokens=128):
    """One attempt at `seed`: one LLM call and one observation per turn reward (None: an episode whose
    environment failed)."""
    tape = new_tape(SPEC, seed, iteration=iteration, group_id=f"{iteration}:train:{seed}", policy_version=0)
    if isinstance(rewards, (int, float)):
        rewards = [rewards]
    for turn, reward in enumerate(rewards, start=1):
        ids = list(range(n_tokens))
        call = LLMCall(output_token_ids=ids, prompt_token_ids=[1, 2], logprobs=[-1.0] * len(ids), turn=turn,
                       sampling=SamplingParams(max_tokens=max_tokens))  # fmt: skip
        tape.append(EnvAction(text="x", turn=turn), llm_call=call)
        tape.append(EnvObservation(text="y", turn=turn, reward=reward, terminated=turn == len(rewards)))
    tape.metadata.turns = len(rewards)
    tape.metadata.reward = float(sum(rewards))
    tape.metadata.error = error
    return tape


class FakeRollout:
    """rollout(seeds) -> tapes, each seed's attempts earning the rewards of `table[seed]`; records the rounds."""

    def __init__(self, table, iteration=1):
        self.table, self.iteration, self.rounds = table, iteration, []

    def __call__(self, seeds):
        self.rounds.append(list(seeds))
        return [episode(s, r, iteration=self.iteration) for s in seeds for r in self.table[s]]


TRAIN = TrainConfig()  # group baseline, gamma 1, no overlong shaping


def rollouts(n, dynamic=False, extra=None):
    return RLConfig.model_validate(
        {"rollouts": {"tasks_per_iteration": n, "dynamic_sampling": dynamic, "max_extra_tasks": extra}}
    ).rollouts


def test_seed_blocks_are_disjoint_and_unchanged_without_dynamic_sampling():
    assert iteration_seeds(3, rollouts(4)) == ([8, 9, 10, 11], [])  # the loop's seeds as they always were
    assert rollouts(4, dynamic=True).max_extra_tasks == 4  # default: tasks_per_iteration
    # n 4 + M 3 per iteration: iteration i owns 7(i-1) .. 7i-1, its own tasks first
    r = rollouts(4, dynamic=True, extra=3)
    assert iteration_seeds(1, r) == ([0, 1, 2, 3], [4, 5, 6])
    assert iteration_seeds(2, r) == ([7, 8, 9, 10], [11, 12, 13])
    seen = [s for i in range(1, 50) for part in iteration_seeds(i, r) for s in part]
    assert len(seen) == len(set(seen)) == 49 * 7 and min(seen) == 0  # disjoint, dense, all non-negative


def test_rounds_fill_the_batch_until_the_bound():
    """Iteration 2, n 4, M 3 (seeds 7-10, extras 11-13). 8 and 9 earn the same in both attempts: dropped.
    Round 1 draws the 2 missing (11, 12): 11 dropped, 12 kept; round 2 draws 1 (13): dropped; no extra is left,
    so the batch holds 3 groups: 7, 10, 12."""
    table = {7: [1, 0], 8: [1, 1], 9: [0, 0], 10: [1, -1], 11: [0, 0], 12: [1, 0], 13: [-1, -1]}
    fake = FakeRollout(table, iteration=2)
    seeds, extra = iteration_seeds(2, rollouts(4, dynamic=True, extra=3))
    chosen = sample_dynamically(fake, seeds, extra, TRAIN)
    assert fake.rounds == [[7, 8, 9, 10], [11, 12], [13]]
    assert (chosen.rounds, chosen.extra_tasks) == (2, 3)
    assert chosen.kept == ["2:train:7", "2:train:10", "2:train:12"]
    assert len(chosen.tapes) == 14  # every tape generated is kept
    assert sorted({t.context["env"]["seed"] for t in chosen.batch}) == [7, 10, 12]
    assert sorted({t.context["env"]["seed"] for t in chosen.tapes if dropped(t)}) == [8, 9, 11, 13]
    assert dynamic_metrics(chosen.tapes, 4, TRAIN) == {
        "dynamic_extra_tasks": 3, "dynamic_dropped_groups": 4, "dynamic_kept_groups": 3,
    }  # fmt: skip


def test_a_full_batch_stops_drawing():
    """n 2, M 4: seed 0 dropped, 1 kept; round 1 draws only seed 2 (kept): 3, 4, 5 are never played."""
    fake = FakeRollout({0: [1, 1], 1: [0, 1], 2: [1, 0, 0]})
    chosen = sample_dynamically(fake, [0, 1], [2, 3, 4, 5], TRAIN)
    assert fake.rounds == [[0, 1], [2]] and chosen.kept == ["1:train:1", "1:train:2"]
    assert dynamic_metrics(chosen.tapes, 2, TRAIN) == {
        "dynamic_extra_tasks": 1, "dynamic_dropped_groups": 1, "dynamic_kept_groups": 2,
    }  # fmt: skip
    nothing_missing = FakeRollout({0: [1, 0], 1: [0, 1]})
    assert sample_dynamically(nothing_missing, [0, 1], [2, 3], TRAIN).rounds == 0 and nothing_missing.rounds == [[0, 1]]


def test_without_any_signal_the_batch_is_the_iterations_own_groups():
    """No group has signal after the bound: the batch is the first n groups (as without dynamic sampling,
    every advantage 0); only the extra groups are dropped."""
    fake = FakeRollout({0: [1, 1], 1: [0, 0], 2: [-1, -1], 3: [1, 1]})
    chosen = sample_dynamically(fake, [0, 1], [2, 3], TRAIN)
    assert fake.rounds == [[0, 1], [2, 3]] and chosen.kept == []
    assert sorted({t.context["env"]["seed"] for t in chosen.batch}) == [0, 1]
    assert dynamic_metrics(chosen.tapes, 2, TRAIN) == {
        "dynamic_extra_tasks": 2, "dynamic_dropped_groups": 2, "dynamic_kept_groups": 0,
    }  # fmt: skip
    no_bound = FakeRollout({0: [1, 1], 1: [0, 1]})  # max_extra_tasks 0: drop, never fill
    chosen = sample_dynamically(no_bound, [0, 1], [], TRAIN)
    assert no_bound.rounds == [[0, 1]] and chosen.kept == ["1:train:1"] and len(chosen.batch) == 2


def test_signal_is_the_return_the_estimators_compare():
    group = lambda *rewards, **kw: [episode(0, r, **kw) for r in rewards]  # noqa: E731
    assert not has_signal(group(0.1 + 0.2, 0.3), TRAIN)  # 0.30000000000000004 vs 0.3: equal within tolerance
    assert has_signal(group(0.3, 0.3 + 10 * SPREAD_TOLERANCE), TRAIN)
    assert not has_signal(group(1.0), TRAIN)  # a group of one episode
    # an infrastructure failure is left out of the group: one scored episode left, no signal
    failed = [episode(0, 1.0), episode(0, 0.0, error="sandbox died")]
    assert not has_signal(failed, TRAIN)
    assert has_signal([*failed, episode(0, 0.0)], TRAIN)
    # per-turn rewards: G_0 = r_1 + gamma r_2. [0, 1] vs [1, 0]: 1 vs 1 at gamma 1, 0.9 vs 1 at gamma 0.9
    turns = group([0.0, 1.0], [1.0, 0.0])
    assert not has_signal(turns, TRAIN)
    assert has_signal(turns, TrainConfig(gamma=0.9))
    # overlong shaping (the calls' limit 10, buffer 4): 10 tokens lose the whole penalty, 4 tokens nothing
    shaped = TrainConfig(overlong_buffer=4)
    long_and_short = [episode(0, 1.0, n_tokens=10, max_tokens=10), episode(0, 1.0, n_tokens=4, max_tokens=10)]
    assert has_signal(long_and_short, shaped) and not has_signal(long_and_short, TRAIN)


# -- the loop's generate() and record, its rollouts faked ---------------------------------------------------


class Trainer:
    def iteration_metrics(self, j):
        return {}


def make_loop(tmp_path, table, *, async_level=0, kl=0.0, extra=2):
    from orchestrate.loop.evaluation import Evaluation
    from orchestrate.loop.iteration import Loop
    from orchestrate.loop.servers import Servers

    config = RLConfig.model_validate({
        "rollouts": {"tasks_per_iteration": 2, "attempts": 2, "dynamic_sampling": True, "max_extra_tasks": extra},
        "run": {"async_level": async_level}, "train": {"kl_coef": kl}, "eval": {"every": 0},
    })  # fmt: skip
    run = RunDir(tmp_path / "run")
    run.create()
    loop = Loop(config, run, progress=False)
    loop.train_env, loop.trainer, loop.evaluation = SPEC, Trainer(), Evaluation(config, run)
    loop.started, loop.run.write_phase = 0.0, lambda *a: None
    loop.calls, loop.annotated = [], []
    loop.servers = Servers(config, run, None, [], progress=False)

    async def rollouts(spec, seeds, attempts, iteration, sampling, desc, follow=False, tree=None):
        loop.calls.append((list(seeds), follow))
        return [episode(s, r, iteration=iteration) for s in seeds for r in table[s][:attempts]], 0.0, 0.0

    def reference(tapes):
        loop.annotated.append(sorted({t.context["env"]["seed"] for t in tapes}))
        for tape in tapes:
            for call in tape.llm_calls:
                call.ref_logprobs = [-2.0] * len(call.output_token_ids)

    loop._rollouts, loop.servers.score_reference = rollouts, reference
    return loop


@pytest.mark.parametrize("async_level", [0, 1])
def test_generate_saves_every_tape_and_trains_on_the_kept_groups(tmp_path, async_level):
    """Iteration 2 (n 2, M 2: seeds 4, 5, extras 6, 7): 4 dropped; round 1 draws 6 (dropped), round 2 draws 7
    (kept): the batch is groups 5 and 7. The reference pass annotates the batch's tapes only."""
    table = {4: [1, 1], 5: [1, 0], 6: [0, 0], 7: [0, 1]}
    loop = make_loop(tmp_path, table, async_level=async_level, kl=0.01)
    loop.generate(2)
    assert loop.calls == [([4, 5], async_level > 0), ([6], async_level > 0), ([7], async_level > 0)]
    assert loop.annotated == [[5, 7]]
    saved = list(read_tapes(loop.run.iteration_tapes(2)))
    assert [(t.context["env"]["seed"], dropped(t)) for t in saved] == [
        (4, True), (4, True), (5, False), (5, False), (6, True), (6, True), (7, False), (7, False)]  # fmt: skip
    assert saved[0].model_dump(mode="json")["metadata"]["dropped"] == "dynamic_sampling"  # the mark on file
    # dropped groups' calls carry no reference log-probs (they are not trained on); the batch's do
    assert all((c.ref_logprobs is None) == dropped(t) for t in saved for c in t.llm_calls)
    batch = read_batch(loop.run.batch(2))
    assert sorted(s.group_id for s in batch) == ["2:train:5", "2:train:5", "2:train:7", "2:train:7"]
    assert {s.episode_id for s in batch} == {t.metadata.id for t in saved if not dropped(t)}

    # resumed after the tapes were saved: nothing is played again and the same batch is written from them
    loop.run.batch(2).unlink()
    again = make_loop(tmp_path, {}, async_level=async_level, kl=0.01)
    again.generate(2)
    assert again.calls == [] and again.annotated == []
    assert [s.sample_id for s in read_batch(again.run.batch(2))] == [s.sample_id for s in batch]

    again.complete(2)  # the record, from the saved tapes
    record = read_metrics(again.run.metrics_path)[-1]
    assert (record["dynamic_extra_tasks"], record["dynamic_dropped_groups"], record["dynamic_kept_groups"]) == (2, 2, 2)
    assert record["tapes"] == 8  # rollout metrics count every tape generated


def test_generate_without_the_option_is_unchanged(tmp_path):
    loop = make_loop(tmp_path, {2: [1, 1], 3: [0, 1]})
    loop.config = loop.config.model_copy(update={"rollouts": rollouts(2)})
    loop.generate(2)
    assert [c[0] for c in loop.calls] == [[2, 3]]
    assert len(read_batch(loop.run.batch(2))) == 4 and not any(map(dropped, read_tapes(loop.run.iteration_tapes(2))))


# -- refusals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--train.estimator", "batch"], ["--rollouts.dynamic_sampling", "estimator batch", "group or rloo"]),
        (["--train.algorithm", "reinforce_pp"], ["--rollouts.dynamic_sampling", "reinforce_pp"]),
        (["--train.algorithm", "ppo"], ["--rollouts.dynamic_sampling", "critic"]),
        (["--rollouts.attempts", "1"], ["--rollouts.dynamic_sampling", "1 attempt"]),
    ],
)
def test_dynamic_sampling_is_refused_where_equal_groups_have_advantages(tmp_path, rl_cli, extra, words):
    run_dir = tmp_path / "run"
    code, line = rl_cli(["--run-dir", run_dir, "--rollouts.dynamic_sampling", "true", *extra])
    assert code == 2, line
    assert all(w in line for w in words), line
    assert not run_dir.exists()


def test_max_extra_tasks_without_dynamic_sampling_is_refused(tmp_path, rl_cli):
    code, line = rl_cli(["--run-dir", tmp_path / "run", "--rollouts.max_extra_tasks", "3"])
    assert code == 2 and line.startswith("error: --rollouts.max_extra_tasks:"), line


def test_extra_tasks_count_in_the_tapes_limit_and_rloo_is_accepted():
    # 512 x 1500 tapes fit in the limit 2^20; with 512 extra tasks, 1024 x 1500 do not
    resolve("embedded", {"rollouts.tasks_per_iteration": "512", "rollouts.attempts": "1500"})
    with pytest.raises(ConfigError, match="--rollouts.attempts: 1024 tasks"):
        resolve("embedded", {"rollouts.dynamic_sampling": "true", "rollouts.tasks_per_iteration": "512",
                             "rollouts.attempts": "1500"})  # fmt: skip
    config = resolve("embedded", {"rollouts.dynamic_sampling": "true", "train.estimator": "rloo"})
    assert config.rollouts.max_extra_tasks == config.rollouts.tasks_per_iteration


def test_group_relative_is_declared_on_the_registration():
    from finetune.estimators import ESTIMATORS, register_estimator

    grouped = {n for n, s in ESTIMATORS.items() if s.group_relative}
    assert {"group", "rloo"} <= grouped and not {"batch", "none"} & grouped
    with pytest.raises(ValueError, match="group_relative"):
        register_estimator("not-grouped", group_relative=True)(lambda x: {})
    assert "not-grouped" not in ESTIMATORS


def test_turning_dynamic_sampling_on_is_a_change_a_resume_refuses():
    """A run started without dynamic sampling resumed with it on differs in both its options (orchestrate.rl
    refuses the resume, naming them)."""
    from orchestrate.loop.resume import config_differences

    off = RLConfig().model_dump(mode="json")
    on = RLConfig.model_validate({"rollouts": {"dynamic_sampling": True}}).model_dump(mode="json")
    assert config_differences(off, off) == []
    assert config_differences(off, on) == ["rollouts.dynamic_sampling", "rollouts.max_extra_tasks"]
