"""Counterfactual credit per role (--rollouts.counterfactual, orchestrate.loop.counterfactual): forks at each later
role's first call, that role's samples of an episode and its forks one advantage group, the forks' other samples
left out, the forks out of the episode metrics."""

from __future__ import annotations

import asyncio

import pytest

from agents.agent import AgentConfig
from agents.chat import ChatTokens
from agents.env_spec import EnvSpec
from agents.multi_agent import MultiAgentChatAgent
from contract.batch import Sample, credit_ids
from finetune.batch_advantages import batch_advantages
from finetune.config import TrainConfig
from orchestrate.loop.command_line import resolve
from orchestrate.loop.config_checks import ConfigError
from orchestrate.loop.counterfactual import branch_points, counterfactual_metrics, run_counterfactuals
from orchestrate.loop.rollouts import RolloutContext, run_rollouts
from orchestrate.loop.samples import tapes_to_samples
from tapes.tape import SamplingParams
from tests.programs import ScriptedLLM

GAME = EnvSpec("game:hide_and_guess", {"low": 1, "high": 20, "guesses": 3}, "train", run_seed=0)
BOTH = {"hider": "policy", "guesser": "policy"}


def played(tokenizer, parent: list[str], forks: list[str], k: int, roles=None):
    agent = MultiAgentChatAgent(AgentConfig(roles=BOTH), SamplingParams(temperature=0.7, max_tokens=32),
                                ChatTokens(tokenizer), max_context=2048)  # fmt: skip
    llm = ScriptedLLM(tokenizer, parent)
    context = RolloutContext(agent, GAME, llm, iteration=1, policy_version=0)

    async def go():
        tapes = await run_rollouts(context, [0], 1, progress=False)
        llm.replies += forks
        return tapes, await run_counterfactuals(context, tapes, k, roles, progress=False)

    return asyncio.run(go())


def test_a_later_roles_forks_and_its_own_sample_make_one_group(tokenizer):
    # the hider picks 13; the guesser misses it three times (reward 0, the hider 1)
    parent = ["\\boxed{13}", "\\boxed{10}", "\\boxed{higher}", "\\boxed{15}", "\\boxed{lower}", "\\boxed{12}"]
    # forks at the guesser's first call: the hider's secret replayed, the guesser finds it at once in both
    (tape,), forks = played(tokenizer, parent, ["\\boxed{13}", "\\boxed{13}"], k=2)
    assert branch_points(tape, None) == {"guesser": 1} and branch_points(tape, ["hider"]) == {}
    assert len(forks) == 2 and all(f.metadata.counterfactual == "guesser" for f in forks)
    assert all(f.metadata.parent_id == tape.metadata.id and f.metadata.branch_at == 1 for f in forks)
    assert [c.output_text for c in forks[0].llm_calls] == ["\\boxed{13}", "\\boxed{13}"]  # the secret replayed
    assert branch_points(forks[0], None) == {}  # a fork is not forked again
    samples = tapes_to_samples([tape, *forks], require_ref=False)
    # the parent's hider (task group) and guesser, then each fork's guesser alone (its hider's call is the parent's)
    assert [(s["episode_id"] == tape.metadata.id, s["role"]) for s in samples] == [
        (True, "hider"), (True, "guesser"), (False, "guesser"), (False, "guesser")]  # fmt: skip
    hider, guesser, *forked = samples
    assert hider["group_id"] == tape.metadata.group_id
    assert guesser["group_id"] == forked[0]["group_id"] == forked[1]["group_id"] != tape.metadata.group_id
    assert all(s["branch"] is None for s in samples)
    # the guesser's advantage: its return against its forks' from the same secret, not against other tasks' tries
    batch = [Sample.model_validate(s) for s in samples]
    _, groups = credit_ids(batch)
    assert groups[1] == groups[2] == groups[3] != groups[0]
    assert [s.reward for s in batch] == [1.0, 0.0, 1.0, 1.0]  # the forks' guesser found it at once
    advantages = [a.tolist() for a in batch_advantages(batch, TrainConfig(), None, None).per_token]
    assert all(a < 0 for a in advantages[1]) and all(a > 0 for a in advantages[2] + advantages[3])
    assert all(a == 0 for a in advantages[0])  # the hider alone in its task group: nothing to compare with
    assert counterfactual_metrics([tape, *forks]) == {"counterfactual_forks": 2, "counterfactual_forks_dropped": 0,
                                                      "counterfactual_tokens": sum(len(f.llm_calls[1].output_token_ids)
                                                                                   for f in forks)}  # fmt: skip


def test_a_role_that_acts_first_is_not_forked_and_keeps_the_task_group(tokenizer):
    parent = ["\\boxed{13}", "\\boxed{13}"]  # the guesser finds it at once
    (tape,), forks = played(tokenizer, parent, [], k=1, roles=["hider"])  # the hider acts first: nothing to fork
    assert forks == []
    samples = tapes_to_samples([tape], require_ref=False)
    assert {s["group_id"] for s in samples} == {tape.metadata.group_id}


def test_counterfactual_credit_needs_roles():
    assert resolve("solver_judge", {"rollouts.counterfactual": "3"}).rollouts.counterfactual == 3
    with pytest.raises(ConfigError, match="--rollouts.counterfactual: counterfactual credit is per role"):
        resolve("embedded", {"rollouts.counterfactual": "2"})
