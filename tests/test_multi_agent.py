"""The built-in agent on GEM's multi-agent API (agents.multi_agent): each agent id a role with its own
conversation, rewards on each role's turns, samples per role; the two-player hide_and_guess game."""

from __future__ import annotations

import asyncio

import pytest

from agents.agent import AgentConfig, ChatAgent, role_rewards, turn_rewards
from agents.chat import ChatTokens
from agents.envs import make_env
from agents.multi_agent import MultiAgentChatAgent
from orchestrate.loop.samples import tape_samples
from orchestrate.serving.recorded import ReplayLLM
from tapes.tape import EnvObservation, SamplingParams, Tape
from tests.programs import ScriptedLLM, WithBase

SAMPLING = SamplingParams(temperature=0.7, max_tokens=32)
BOTH = {"hider": "policy", "guesser": "policy"}


def game(**options):
    return make_env("game:hide_and_guess", {"low": 1, "high": 20, "guesses": 3, **options}, split="train", run_seed=0)


def agent(tokenizer, roles=BOTH, **config):
    return MultiAgentChatAgent(AgentConfig(roles=roles, **config), SAMPLING, ChatTokens(tokenizer), max_context=2048)


def play(player, llm, env=None):
    tape = Tape()
    asyncio.run(player.run_episode(env or game(), 0, llm, tape))
    return tape


def test_two_players_take_turns_each_in_its_own_conversation(tokenizer):
    replies = ["\\boxed{13}", "\\boxed{10}", "\\boxed{higher}", "\\boxed{15}", "\\boxed{lower}", "\\boxed{13}"]
    llm = ScriptedLLM(tokenizer, replies)
    tape = play(agent(tokenizer), llm)
    assert tape.metadata.error is None
    calls = tape.llm_calls
    assert [c.role for c in calls] == ["hider", "guesser"] * 3 and [c.turn for c in calls] == [1, 2, 3, 4, 5, 6]
    assert [c.extends_previous for c in calls] == [None, None, True, True, True, True]  # each its own thread
    assert "Pick a secret whole number" in calls[0].prompt_text and "Pick" not in calls[1].prompt_text
    assert "Your number is 13. The guesser says 10" in tokenizer.decode(calls[2].prompt_token_ids)
    assert "10 is too low. The number is between 11 and 20. 2 guesses left." in calls[3].prompt_text
    assert role_rewards(tape) == {"hider": 0.0, "guesser": 1.0} and tape.metadata.success is True
    samples = tape_samples(tape, require_ref=False)
    assert [(s["role"], [t["index"] for t in s["turns"]]) for s in samples] == [("hider", [0, 2, 4]),
                                                                              ("guesser", [1, 3, 5])]  # fmt: skip
    # played again from its tape, the same calls come back
    again = play(agent(tokenizer), ReplayLLM(tape, strict=True))
    assert [c.prompt_token_ids for c in again.llm_calls] == [c.prompt_token_ids for c in calls]


def test_the_hider_is_kept_honest_and_wins_when_the_guesses_run_out(tokenizer):
    replies = ["\\boxed{13}", "\\boxed{10}", "\\boxed{lower}", "\\boxed{5}", "I won't say", "\\boxed{1}"]
    tape = play(agent(tokenizer), ScriptedLLM(tokenizer, replies))
    # a lie and an unreadable answer each cost the hider; the guesser was told the truth; the hider won the game
    assert turn_rewards(tape) == [0.0, 0.0, -0.5, 0.0, -0.5 + 1.0, 0.0]
    assert "10 is too low." in tape.llm_calls[3].prompt_text
    assert role_rewards(tape) == {"hider": 0.0, "guesser": 0.0} and tape.metadata.success is False


def test_a_secret_outside_the_range_costs_the_hider_and_one_is_drawn(tokenizer):
    tape = play(agent(tokenizer), ScriptedLLM(tokenizer, ["\\boxed{99}", "\\boxed{7}", "\\boxed{higher}",
                                                          "\\boxed{8}", "\\boxed{lower}", "\\boxed{9}"]))  # fmt: skip
    assert turn_rewards(tape)[0] == -1.0
    assert any(s.info.get("format_error") for s in tape.steps if isinstance(s, EnvObservation) and s.turn == 1)


def test_a_player_bound_to_base_asks_the_base_model(tokenizer):
    llm = WithBase(tokenizer, ["\\boxed{10}", "\\boxed{13}"], ["\\boxed{13}", "\\boxed{higher}"])
    tape = play(agent(tokenizer, roles={"hider": "base", "guesser": "policy"}), llm)
    assert [(c.role, c.output_text) for c in tape.llm_calls] == [
        ("hider", "\\boxed{13}"), ("guesser", "\\boxed{10}"), ("hider", "\\boxed{higher}"), ("guesser", "\\boxed{13}")]  # fmt: skip
    assert len(llm.base.prompts) == 2 and len(llm.prompts) == 2


def test_players_with_adapters_of_their_own_ask_them_and_see_their_own_worked_examples(tokenizer):
    from agents.agent import Example

    llm = WithBase(tokenizer, [], [], {"hider": ["\\boxed{13}", "\\boxed{higher}"],
                                       "guesser": ["\\boxed{10}", "\\boxed{13}"]})  # fmt: skip
    shown = {"hider": [Example(question="Pick one of 1-50.", solution="\\boxed{37}")],
             "guesser": [Example(question="Guess one of 1-50.", solution="\\boxed{25}")]}  # fmt: skip
    tape = play(agent(tokenizer, roles={"hider": "adapter", "guesser": "adapter"}, role_examples=shown), llm)
    assert [(c.role, c.output_text) for c in tape.llm_calls] == [
        ("hider", "\\boxed{13}"), ("guesser", "\\boxed{10}"), ("hider", "\\boxed{higher}"), ("guesser", "\\boxed{13}")]  # fmt: skip
    hider, guesser = tape.llm_calls[0], tape.llm_calls[1]
    assert [m["content"] for m in hider.messages[:2]] == ["Pick one of 1-50.", "\\boxed{37}"]
    assert "Guess one of 1-50." in guesser.prompt_text and "Pick one of" not in guesser.prompt_text
    assert "Pick a secret whole number" in hider.prompt_text  # the game's own observation after the example
    from orchestrate.loop.command_line import resolve
    from orchestrate.loop.config_checks import ConfigError

    with pytest.raises(ConfigError, match="--agent.role_examples: 'judge' is not a role of agent.roles"):
        resolve("hide_and_guess", {"agent.role_examples": '{"judge": []}'})


def test_an_output_cut_by_max_tokens_ends_the_episode_and_the_turn_limit_truncates(tokenizer):
    cut = ScriptedLLM(tokenizer, ["\\boxed{13}", "\\boxed{1"], eos=False)
    original = cut.complete_ids

    async def length(*args, **kw):
        call = await original(*args, **kw)
        call.finish_reason = "length" if call.output_text.endswith("{1") else "stop"
        return call

    cut.complete_ids = length
    tape = play(agent(tokenizer, truncation_reward=-0.2), cut)
    assert turn_rewards(tape) == [0.0, -0.2] and tape.metadata.truncated
    tape = play(
        agent(tokenizer, max_turns=3), ScriptedLLM(tokenizer, ["\\boxed{13}", "\\boxed{10}", "\\boxed{higher}"])
    )
    assert len(tape.llm_calls) == 3 and tape.metadata.truncated and "turn limit" in tape.steps[-1].info["reason"]


def test_the_one_agent_built_in_agent_refuses_a_multi_agent_environment(tokenizer):
    with pytest.raises(ValueError, match="several agents \\(hider, guesser\\): bind each as a role"):
        asyncio.run(ChatAgent(AgentConfig(), SAMPLING, ChatTokens(tokenizer)).run_episode(game(), 0, None, Tape()))
    with pytest.raises(ValueError, match="not all roles of the run"):
        play(agent(tokenizer, roles={"hider": "policy", "seeker": "policy"}), ScriptedLLM(tokenizer, []))


def test_a_gem_multi_agent_environment_plays_its_agents_at_once(tokenizer):
    multiagent = pytest.importorskip("gem.multiagent", reason="the gem extra (uv sync --extra gem)")

    class Echo(multiagent.MultiAgentEnv):
        """Two agents act at once (GEM's parallel selector); each is rewarded 1 for saying its own name."""

        def __init__(self):
            super().__init__()
            self.possible_agents = ["a", "b"]
            self.agent_selector = multiagent.AgentSelector(self.possible_agents, mode="parallel")

        def reset(self, seed=None):  # gem 0.1.0's MultiAgentEnv.reset(seed) calls a _make_np_random it lacks
            return super().reset(seed=None)

        def observe(self, agent):
            return f"Say {agent}."

        def _process_actions(self, actions):
            rewards = {k: float(v.strip() == k) for k, v in actions.items()}
            for k in actions:
                self.terminations[k] = True
            return ({k: "" for k in actions}, rewards, dict(self.terminations), dict(self.truncations),
                    {k: {} for k in actions})  # fmt: skip

    tape = play(agent(tokenizer, roles={"a": "policy", "b": "policy"}), ScriptedLLM(tokenizer, ["a", "x"]), Echo())
    assert [c.role for c in tape.llm_calls] == ["a", "b"] and [c.turn for c in tape.llm_calls] == [1, 2]
    assert role_rewards(tape) == {"a": 1.0, "b": 0.0}


def test_a_timed_environment_offers_the_agents_of_the_one_it_wraps(tokenizer):
    from orchestrate.loop.rollouts import EnvClock, TimedEnv

    clock = EnvClock()
    replies = ["\\boxed{13}", "\\boxed{13}"]
    tape = play(agent(tokenizer), ScriptedLLM(tokenizer, replies), TimedEnv(game(), clock))
    assert tape.metadata.error is None and [c.role for c in tape.llm_calls] == ["hider", "guesser"]
    assert role_rewards(tape) == {"hider": 0.0, "guesser": 1.0} and clock.busy_s > 0


def test_an_unreadable_guess_uses_a_guess_and_the_guesser_goes_again(tokenizer):
    replies = ["\\boxed{13}", "a number", "\\boxed{13}"]
    tape = play(agent(tokenizer), ScriptedLLM(tokenizer, replies))
    assert [c.role for c in tape.llm_calls] == ["hider", "guesser", "guesser"]
    assert "That guess could not be read. The number is between 1 and 20. 2 guesses left." in (
        tape.llm_calls[2].prompt_text
    )
    assert role_rewards(tape) == {"hider": 0.0, "guesser": 1.0}
