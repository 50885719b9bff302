"""Tree rollouts (orchestrate.loop.trees): roots branched by forks restored from their tapes; the `tree`
estimator's credit by subtree, worked by hand; a fork's samples (its replayed turns its parent's); the tree
options' refusals."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from contract.batch import Sample
from finetune.estimators import turn_advantages
from orchestrate.loop.command_line import resolve
from orchestrate.loop.config import TreeSection
from orchestrate.loop.config_checks import ConfigError
from orchestrate.loop.dynamic_sampling import dropped, mark_dropped
from orchestrate.loop.forks import DIVERGED, fork_once
from orchestrate.loop.rollouts import RolloutContext
from orchestrate.loop.samples import tapes_to_samples
from orchestrate.loop.trees import choose_points, eligible_points, generated_tokens, grow_tree, tree_metrics
from tapes.tape import LLMCall, SamplingParams, Tape, TapeMetadata
from tests import test_fork
from tests.test_fork import GAME, ScriptedLLM, answer, game_agent, wrong_guesses

program_agent = test_fork.program_agent  # the fixture

# -- the estimator, by hand ---------------------------------------------------------------------------------


def advantages(episodes, branches, normalize_std=False, gamma=1.0, baseline="tree"):
    """{episode: [advantage per own turn]} for episodes {id: [(turn, reward), ...]} in one group."""
    ids = list(episodes)
    _, adv = turn_advantages([episodes[e] for e in ids], ids, ["task"] * len(ids), baseline, gamma, normalize_std,
                             branches=[branches.get(e) for e in ids])  # fmt: skip
    return dict(zip(ids, adv))


def test_tree_credit_by_subtree_worked_by_hand():
    # roots a (rewards 0, 1) and b (0, 0); c forks a at turn 1 (replays a's turn 0, reward 0) and earns 0.
    # G_0: a 1, b 0, c 0; the task's mean 1/3.
    # a's turn 0 is shared by a and c: mean G_0 1/2, against the task's 1/3 -> +1/6.
    # a's turn 1 (after c branched off): G_1 1 against the branch point's mean G_1 over {a, c}, 1/2 -> +1/2.
    # c's turn 1: G_1 0 against the same 1/2 -> -1/2.  b: 0 - 1/3.
    episodes = {"a": [(0, 0.0), (1, 1.0)], "b": [(0, 0.0), (1, 0.0)], "c": [(1, 0.0)]}
    branch = {"c": {"parent_id": "a", "turn": 1, "prefix_rewards": [0.0]}}
    adv = advantages(episodes, branch)
    assert adv["a"] == pytest.approx([1 / 6, 1 / 2])
    assert adv["c"] == pytest.approx([-1 / 2])
    assert adv["b"] == pytest.approx([-1 / 3, -1 / 3])
    # along each path the credits sum to G_0 minus the task's mean
    assert adv["a"][0] + adv["a"][1] == pytest.approx(1 - 1 / 3)
    assert adv["a"][0] + adv["c"][0] == pytest.approx(0 - 1 / 3)
    # normalised: over the std of the task's G_0 (sample std of 1, 0, 0)
    scaled = advantages(episodes, branch, normalize_std=True)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    assert scaled["a"] == pytest.approx([(1 / 6) / (std + 1e-6), (1 / 2) / (std + 1e-6)])


def test_a_fork_of_a_fork_and_discounting():
    # a: rewards (0, 0, 1); d forks a at 1 and earns (0, 0); e forks d at 2 and earns 1. gamma 0.5.
    # G: a (0.25, 0.5, 1), d (0, 0, 0), e (0.25, 0.5, 1) with e's first two turns a's and d's.
    episodes = {"a": [(0, 0.0), (1, 0.0), (2, 1.0)], "d": [(1, 0.0), (2, 0.0)], "e": [(2, 1.0)]}
    branch = {"d": {"parent_id": "a", "turn": 1, "prefix_rewards": [0.0]},
              "e": {"parent_id": "d", "turn": 2, "prefix_rewards": [0.0, 0.0]}}  # fmt: skip
    adv = advantages(episodes, branch, gamma=0.5)
    # the task {a, d, e}: mean G_0 = 0.5/3. a's turn 0 is below everything: 1/6 - 1/6 = 0.
    # a's turns 1, 2 (after d branched at 1): G_1 of a 0.5 against mean G_1 over {a, d, e} = 1/3.
    # d's turn 1 (shared with e): mean G_1 over {d, e} 0.25, against 1/3. d's turn 2: G_2 0 against {d, e}'s 0.5.
    # e's turn 2: 1 against 0.5.
    assert adv["a"] == pytest.approx([0.0, 0.5 - 1 / 3, 0.5 - 1 / 3])
    assert adv["d"] == pytest.approx([0.25 - 1 / 3, -0.5])
    assert adv["e"] == pytest.approx([0.5])


def test_without_forks_the_tree_estimator_is_grpo():
    rng = random.Random(0)
    episodes = {f"r{i}": [(0, rng.random()), (1, rng.random())] for i in range(5)}
    tree, group = advantages(episodes, {}, normalize_std=True), advantages(episodes, {}, True, baseline="group")
    for e in episodes:
        assert tree[e] == pytest.approx(group[e], abs=1e-6)
    flat = {"x": [(0, 1.0)], "y": [(0, 1.0)], "z": [(0, 1.0)]}
    assert advantages(flat, {}, normalize_std=True) == {"x": [0.0], "y": [0.0], "z": [0.0]}


def test_turn_estimators_count_a_forks_replayed_turns_once_in_its_parent():
    """batch (ReBN) and reinforce_pp normalise over the turns the batch trains: a fork's replayed turns are
    its parent's, counted there; the fork gets advantages for its own turns only."""
    episodes = {"a": [(0, 0.0), (1, 1.0)], "b": [(0, 0.0), (1, 0.0)], "c": [(1, 0.0)]}
    branch = {"c": {"parent_id": "a", "turn": 1, "prefix_rewards": [0.0]}}
    # gamma 1: trained returns a (1, 1), b (0, 0), c's turn 1: 0 -> five values, mean 0.4, centred
    adv = advantages(episodes, branch, baseline="batch")
    assert adv["a"] == pytest.approx([0.6, 0.6]) and adv["b"] == pytest.approx([-0.4, -0.4])
    assert adv["c"] == pytest.approx([-0.4])
    # reinforce_pp weighs each turn by its tokens; with forks it used to look up the replayed turn's tokens
    ids = list(episodes)
    lengths = [[1] * len(episodes[e]) for e in ids]
    _, adv = turn_advantages([episodes[e] for e in ids], ids, ["task"] * 3, "reinforce_pp", 1.0, False,
                             lengths=lengths, branches=[branch.get(e) for e in ids])  # fmt: skip
    assert [a for episode in adv for a in episode] == pytest.approx([0.6, 0.6, -0.4, -0.4, -0.4])


def test_a_forks_replayed_turns_take_its_parents_shaped_rewards():
    """Overlong shaping is applied to the samples' own turns; a fork's replayed turns are its parent's, so
    when the parent is in the batch its shaped rewards are the fork's too (the Branch holds raw ones)."""
    from finetune.estimators import episode_returns

    # a's turn 0 was cut (shaped: -0.5), c forks a at 1 and replays it; d forks c at 2
    turns = [[(0, -0.5), (1, 1.0)], [(1, 1.0), (2, 0.0)], [(2, 1.0)]]
    branches = [None, {"parent_id": "a", "turn": 1, "prefix_rewards": [0.0]},
                {"parent_id": "c", "turn": 2, "prefix_rewards": [0.0, 1.0]}]  # fmt: skip
    returns = episode_returns(turns, ["a", "c", "d"], 1.0, branches)
    assert returns["a"][0] == returns["c"][0] - 0.0 == pytest.approx(0.5)  # identical outcome, identical G_0
    assert returns["d"] == pytest.approx({0: 1.5, 1: 2.0, 2: 1.0})
    # without its parent in the batch the fork's own record of the prefix is used
    alone = episode_returns(turns[1:], ["c", "d"], 1.0, branches[1:])
    assert alone["c"] == pytest.approx({0: 1.0, 1: 1.0, 2: 0.0})


def test_a_trees_size_has_one_formula_and_a_limit():
    from orchestrate.loop.config_checks import TAPES_PER_ITERATION_LIMIT

    tree = TreeSection(width=4, points=2, depth=3)
    assert tree.max_episodes(16) == 16 * (1 + 6 + 36 + 216)  # each level forks every episode of the last
    assert TreeSection(width=3).max_episodes(2) == 2 * 3
    assert resolve("game", {"tree.width": "4", "tree.points": "2", "tree.depth": "3"}).tree.depth == 3
    with pytest.raises(ConfigError, match=rf"^--tree.depth: 8 tasks x up to .* more tapes per iteration than the "
                                          rf"limit {TAPES_PER_ITERATION_LIMIT}"):  # fmt: skip
        resolve("game", {"tree.width": "8", "tree.points": "4", "tree.depth": "5"})


# -- trees on the game, against scripted LLMs -------------------------------------------------------------------


def tree_llm(tokenizer, wrong_calls, seed=0):
    """Wrong guesses for the first `wrong_calls` calls (the roots), the right number after (the forks)."""
    right = answer(GAME, seed)
    texts = (wrong_guesses(GAME, seed, 3) * wrong_calls)[:wrong_calls] + [f"\\boxed{{{right}}}"] * 50
    return ScriptedLLM(tokenizer, texts, version=1)


def test_a_tree_branches_each_root_and_its_forks_restore_the_game(tokenizer):
    agent = game_agent(tokenizer)
    tree = TreeSection(width=3, points=1, depth=1)
    llm = tree_llm(tokenizer, 2 * 4)  # two roots of four wrong guesses (the game's max_turns)
    tapes = asyncio.run(grow_tree(RolloutContext(agent, GAME, llm, 5, 1), 0, 2, tree))
    roots, forks = tapes[:2], tapes[2:]
    assert all(r.metadata.parent_id is None and r.metadata.reward == 0 for r in roots)
    assert len(forks) == 4  # one point per root, width 3: two forks beside the root's own continuation
    ids = {r.metadata.id for r in roots}
    for fork in forks:
        m = fork.metadata
        parent = next(r for r in roots if r.metadata.id == m.parent_id)
        assert m.parent_id in ids and 1 <= m.branch_at <= 3 and m.group_id == roots[0].metadata.group_id
        assert [c.id for c in fork.llm_calls[: m.branch_at]] == [c.id for c in parent.llm_calls[: m.branch_at]]
        assert m.success and m.reward == 1.0 and len(fork.llm_calls) == m.branch_at + 1 and m.iteration == 5
        assert generated_tokens(fork) == len(fork.llm_calls[-1].output_token_ids)
    # the same root's two forks branch at the same point; the points are the same on the same tapes
    assert len({f.metadata.branch_at for f in forks if f.metadata.parent_id == roots[0].metadata.id}) == 1
    metrics = tree_metrics(tapes)
    assert metrics == {"tree_forks": 4, "tree_forks_dropped": 0, "tree_depth_max": 1, "tree_roots_unforked": 0}


def test_depth_two_branches_the_branches_and_the_budget_stops_them(tokenizer):
    agent = game_agent(tokenizer)
    wrong = [f"\\boxed{{{n}}}" for n in wrong_guesses(GAME, 0, 3)]
    llm = ScriptedLLM(tokenizer, (wrong * 40)[:100], version=1)  # everything wrong: every episode 4 turns
    # by entropy: the scripted calls are all equally sure, so the earliest eligible call: 1, then 2 on the fork
    tree = TreeSection(width=2, depth=2, branch_by="entropy")
    tapes = asyncio.run(grow_tree(RolloutContext(agent, GAME, llm, 1, 1), 0, 1, tree))
    assert [t.metadata.branch_at for t in tapes] == [None, 1, 2]
    root, first, second = tapes
    assert second.metadata.parent_id == first.metadata.id and first.metadata.parent_id == root.metadata.id
    assert tree_metrics(tapes)["tree_depth_max"] == 2
    # a budget of the root's own tokens leaves no room for a fork
    llm = ScriptedLLM(tokenizer, (wrong * 40)[:100], version=1)
    budget = TreeSection(width=4, token_budget=generated_tokens(root))
    alone = asyncio.run(grow_tree(RolloutContext(agent, GAME, llm, 1, 1), 0, 1, budget))
    assert len(alone) == 1
    assert tree_metrics(alone)["tree_roots_unforked"] == 1  # the budget's doing, counted
    assert tree_metrics(tapes)["tree_roots_unforked"] == 0


def test_branch_points_turn_and_entropy():
    def tape(logprobs, branch_at=None):
        calls = [LLMCall(prompt_token_ids=[1], output_token_ids=[2] * len(lp), logprobs=lp) for lp in logprobs]
        return Tape(metadata=TapeMetadata(branch_at=branch_at), llm_calls=calls)

    t = tape([[-0.1], [-0.1], [-3.0, -3.0], [-0.1], [-2.0]])
    assert eligible_points(t) == [1, 2, 3, 4] and eligible_points(tape([[-1.0]] * 5, branch_at=3)) == [4]
    # entropy: the largest rises of the first tokens' surprisal over the call before: call 2 (+2.9), call 4 (+1.9)
    assert choose_points(t, 2, "entropy", random.Random(0)) == [2, 4]
    picks = {tuple(choose_points(t, 2, "turn", random.Random(s))) for s in range(30)}
    assert len(picks) > 3 and all(len(p) == 2 and set(p) <= {1, 2, 3, 4} for p in picks)
    assert choose_points(t, 9, "turn", random.Random(0)) == [1, 2, 3, 4]
    failed = tape([[-1.0]] * 3)
    failed.metadata.error = "boom"
    assert eligible_points(failed) == []


def test_a_fork_that_does_not_come_back_is_kept_marked_and_never_trained(tokenizer, tmp_path, capsys):
    tape = asyncio.run(
        grow_tree(
            RolloutContext(game_agent(tokenizer), GAME, tree_llm(tokenizer, 4), 1, 1),
            0,
            1,
            TreeSection(width=2, depth=1, token_budget=1),
        )
    )[0]
    other = game_agent(tokenizer, instruction="Be quick.")  # renders another prompt: never back at call 2
    fork = asyncio.run(fork_once(tape, other, 2, tree_llm(tokenizer, 0), None, keep_diverged=True))
    assert fork.metadata.dropped == DIVERGED and "prompt differs" in fork.metadata.error
    assert tree_metrics([tape, fork])["tree_forks_dropped"] == 1
    assert tapes_to_samples([fork], require_ref=False) == []
    # the replay command skips it (its record is the failure), and says so; the root replays identical
    from argparse import Namespace

    from orchestrate.after.replay import _replay_files
    from orchestrate.loop.samples import save_tapes

    path = tmp_path / "iter_000001.jsonl"
    save_tapes(path, [tape, fork])
    assert _replay_files([path], {path: game_agent(tokenizer)}, Namespace(index=None, quiet=False), None) == 0
    out = capsys.readouterr().out
    assert "tape 2 skipped" in out and "1 tapes replayed: 1 identical, 0 differ; 1 diverged forks skipped" in out
    for t in (tape, fork):  # its group then left out by dynamic sampling: the fork is still counted as dropped
        mark_dropped(t)
    assert fork.metadata.dropped == DIVERGED and dropped(tape)
    assert tree_metrics([tape, fork]) == {
        "tree_forks": 0,
        "tree_forks_dropped": 1,
        "tree_depth_max": 0,
        "tree_roots_unforked": 0,
    }


# -- a fork's samples ---------------------------------------------------------------------------------


def test_a_forks_sample_trains_its_own_turns_and_names_its_branch(tokenizer):
    tapes = asyncio.run(
        grow_tree(RolloutContext(game_agent(tokenizer), GAME, tree_llm(tokenizer, 4), 1, 1), 0, 1, TreeSection(width=2))
    )
    root, fork = tapes
    k = fork.metadata.branch_at
    root_sample, fork_sample = tapes_to_samples([root, fork], False)
    fork_sample = Sample.model_validate(fork_sample)
    assert fork_sample.branch.parent_id == root.metadata.id and fork_sample.branch.turn == k
    assert fork_sample.branch.prefix_rewards == [0.0] * k
    assert [t.index for t in fork_sample.turns] == [k]  # only its own turn is trained
    assert fork_sample.behaviour_logprobs == fork.llm_calls[k].logprobs
    # the same tokens as the root up to the branch point: the replayed outputs are context
    assert fork_sample.prompt_ids == root_sample["prompt_ids"]
    start = fork_sample.turns[0].start
    assert fork_sample.completion_ids[:start] == root_sample["completion_ids"][:start]
    # the learner's returns run over the whole episode: the fork's G_0 is its win
    samples = [Sample.model_validate(root_sample), fork_sample]
    returns, adv = turn_advantages([[(t.index, t.reward) for t in s.all_turns] for s in samples],
                                   [s.episode_id for s in samples], [s.group_id for s in samples], "group",
                                   branches=[s.branch for s in samples])  # fmt: skip
    assert returns[1] == [1.0] and adv[1][0] > 0 > adv[0][0]
    # without its parent in the batch (an offline filter kept the winning fork alone) the fork is trained whole:
    # its replayed turns too, as the episode it is, with no branch to share
    (alone,) = tapes_to_samples([fork], False)
    alone = Sample.model_validate(alone)
    assert alone.branch is None and [t.index for t in alone.turns] == list(range(k + 1))
    assert alone.behaviour_logprobs == [x for c in fork.llm_calls for x in c.logprobs]
    assert alone.completion_ids == fork_sample.completion_ids and alone.prompt_ids == fork_sample.prompt_ids


def test_forks_sample_at_the_tree_temperature_and_the_learner_scores_them_there(tokenizer):
    from tests.test_fork import SAMPLING

    roots = SAMPLING.model_copy(update={"temperature": 0.7})
    tree = TreeSection(width=2, temperature=1.5)
    tapes = asyncio.run(
        grow_tree(RolloutContext(game_agent(tokenizer), GAME, tree_llm(tokenizer, 4), 1, 1, roots), 0, 1, tree)
    )
    root, fork = tapes
    k = fork.metadata.branch_at
    assert {c.sampling.temperature for c in root.llm_calls} == {0.7}
    # the replayed calls are the parent's (sampled at 0.7); the fork's own at the tree's temperature
    assert [c.sampling.temperature for c in fork.llm_calls] == [0.7] * k + [1.5] * (len(fork.llm_calls) - k)
    root_sample, fork_sample = tapes_to_samples([root, fork], False)
    assert root_sample["temperature"] == 0.7 and fork_sample["temperature"] == 1.5
    (alone,) = tapes_to_samples([fork], False)  # without its parent: its own calls alone, at their temperature
    assert alone["temperature"] == 1.5 and [t["index"] for t in alone["turns"]] == [
        t["index"] for t in fork_sample["turns"]
    ]
    # replayed, the fork asks its own calls at its temperature and its parent's as recorded: identical
    from orchestrate.after.replay import replay_tape

    for tape in (root, fork):
        _, diff = asyncio.run(replay_tape(tape, game_agent(tokenizer)))
        assert diff.identical, diff.report()
    # the loop passes no sampling (the agent's is the run's): the forks keep the parent's max_tokens and top_p
    agent = game_agent(tokenizer)
    tapes = asyncio.run(grow_tree(RolloutContext(agent, GAME, tree_llm(tokenizer, 4), 1, 1), 0, 1, tree))
    root, fork = tapes
    own = fork.llm_calls[fork.metadata.branch_at :]
    assert {(c.sampling.temperature, c.sampling.max_tokens, c.sampling.top_p) for c in own} == {
        (1.5, root.llm_calls[0].sampling.max_tokens, root.llm_calls[0].sampling.top_p)}  # fmt: skip
    assert root.llm_calls[0].sampling.max_tokens == SAMPLING.max_tokens != SamplingParams().max_tokens
    # none given: the forks sample as the roots
    same = asyncio.run(
        grow_tree(
            RolloutContext(game_agent(tokenizer), GAME, tree_llm(tokenizer, 4), 1, 1, roots), 0, 1, TreeSection(width=2)
        )
    )
    assert {c.sampling.temperature for t in same for c in t.llm_calls} == {0.7}


def test_a_sample_may_not_train_its_parents_turns():
    with pytest.raises(ValueError, match="before the branch point"):
        Sample(prompt_ids=[1], completion_ids=[2, 3], behaviour_logprobs=[-1.0], reward=0.0, group_id="g",
               turns=[{"index": 0, "start": 0, "length": 1, "reward": 0.0}],
               branch={"parent_id": "p", "turn": 1, "prefix_rewards": [0.0]})  # fmt: skip
    with pytest.raises(ValueError, match="prefix_rewards has 0 values for 2 replayed turns"):
        Sample(prompt_ids=[1], completion_ids=[2, 3], behaviour_logprobs=[-1.0], reward=0.0, group_id="g",
               turns=[{"index": 2, "start": 1, "length": 1, "reward": 0.0}],
               branch={"parent_id": "p", "turn": 2, "prefix_rewards": []})  # fmt: skip


# -- the options ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, overrides, message",
    [
        ("game", {"tree.width": "1"}, r"^--tree.width: 1 continuation per branch point is the chain itself"),
        ("embedded", {"tree.width": "2"}, r"^--tree.width: episodes of one turn \(--agent.max_turns 1\)"),
        ("embedded", {"tree.width": "2", "agent.max_turns": "3"}, r"^--tree.width: episodes of one turn \(--env.id"),
        ("game", {"tree.depth": "2"}, r"^--tree.depth: is an option of tree rollouts, which are off"),
        (
            "game",
            {"tree.width": "2", "tree.token_budget": "100"},
            r"^--tree.token_budget: 100 tokens is less than one root episode can generate \(5 turn\(s\) x ",
        ),
        ("game", {"tree.width": "2", "tree.branch_by": "luck"}, r"^--tree.branch_by: "),
        ("game", {"tree.width": "2", "tree.points": "0"}, r"^--tree.points: "),
        ("game", {"tree.width": "2", "tree.temperature": "0"}, r"^--tree.temperature: "),
        ("game", {"tree.width": "2", "tree.temperature": "nan"}, r"^--tree.temperature: "),
        ("game", {"tree.temperature": "1.5"}, r"^--tree.temperature: is an option of tree rollouts, which are off"),
    ],
)
def test_tree_options_are_refused_in_one_line(preset, overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve(preset, overrides)


def test_tree_options_that_work():
    config = resolve("game", {"tree.width": "3", "tree.depth": "2", "tree.token_budget": "2000",
                              "tree.branch_by": "entropy", "train.estimator": "tree", "tree.temperature": "1.3"})  # fmt: skip
    assert config.tree.width == 3 and config.train.estimator == "tree" and config.tree.temperature == 1.3
    # one root a task: its forks are its group's other episodes (chains refuse it: a group of one)
    assert resolve("game", {"tree.width": "4", "rollouts.attempts": "1", "train.estimator": "tree"}).tree.width == 4
    with pytest.raises(ConfigError, match=r"^--rollouts.attempts: 1 attempt per task leaves every group of one"):
        resolve("game", {"rollouts.attempts": "1", "train.estimator": "tree"})


def test_an_agent_programs_episodes_branch_after_its_tool_call(tokenizer, program_agent):
    """A tree of an agent program (through the gateway): the root calls its python tool, then answers wrong; the
    fork replays the tool call (the program runs its tool again) and answers live."""
    from tests.test_fork import ARITHMETIC, product_of, tool_reply

    a, b = product_of(3)
    agent = program_agent()
    llm = ScriptedLLM(tokenizer, [tool_reply(a, b), "\\boxed{1}", f"The answer is \\boxed{{{a * b}}}."], version=4)
    tapes = asyncio.run(grow_tree(RolloutContext(agent, ARITHMETIC, llm, 2, 4), 3, 1, TreeSection(width=2)))
    root, fork = tapes
    assert root.metadata.reward == 0.0 and len(root.llm_calls) == 2
    assert fork.metadata.parent_id == root.metadata.id and fork.metadata.branch_at == 1
    assert fork.metadata.error is None and fork.metadata.reward == 1.0
    assert fork.llm_calls[0].id == root.llm_calls[0].id and fork.llm_calls[1].extends_previous is True
    _, sample = tapes_to_samples([root, fork], require_ref=False)
    assert sample["branch"]["turn"] == 1 and [t["index"] for t in sample["turns"]] == [1]


class SwappingLLM(ScriptedLLM):
    """Version 1 for the first `swap_after` calls, then version 2: new weights arrived during the tree."""

    def __init__(self, tokenizer, texts, swap_after):
        super().__init__(tokenizer, texts, version=1)
        self.swap_after = swap_after

    async def complete_ids(self, prompt_ids, sampling, **kw):
        self.version = 1 if len(self.prompts) < self.swap_after else 2
        return await super().complete_ids(prompt_ids, sampling, **kw)


def test_under_new_weights_a_forks_own_calls_carry_the_version_that_sampled_them(tokenizer):
    """Generation ahead of training (run.async_level > 0): the roots were sampled by version 1, the forks' live
    calls by version 2; their replayed calls keep version 1 and their samples are version 2's."""
    right = answer(GAME, 0)
    llm = SwappingLLM(tokenizer, wrong_guesses(GAME, 0, 3) + ["\\boxed{1}"] + [f"\\boxed{{{right}}}"] * 4, 4)
    root, *forks = asyncio.run(
        grow_tree(RolloutContext(game_agent(tokenizer), GAME, llm, 1, 1), 0, 1, TreeSection(width=3))
    )
    assert [c.policy_version for c in root.llm_calls] == [1, 1, 1, 1] and len(forks) == 2
    for fork in forks:
        k = fork.metadata.branch_at
        assert [c.policy_version for c in fork.llm_calls] == [1] * k + [2]
        _, sample = tapes_to_samples([root, fork], require_ref=False)
        assert sample["policy_version"] == 2 and sample["version_changes"] is None
