"""Multi-turn episodes at unit speed: a scripted environment, a scripted LLM, a real chat template.

Checks the protocol (reset / step until terminated or truncated), the tape's steps, token-exact
chaining of prompts, discounted returns and advantages worked out by hand, and that an episode is
one training sample whose environment tokens are not trained on.
"""

import asyncio
import json

import pytest
import torch

from agents.agent import AgentConfig, ChatAgent, Example, turn_rewards
from agents.chat import ChatTokens
from contract.batch import Sample
from finetune.estimators import discounted_returns, turn_advantages
from finetune.microbatch import micro_batches
from orchestrate.loop.samples import tape_samples
from tapes.tape import EnvAction, EnvObservation, SamplingParams, Tape
from tests.scripted import scripted_call


class ScriptedEnv:
    """Answers each action with the next scripted (observation, reward, terminated); records the actions."""

    def __init__(self, script):
        self.script = list(script)
        self.actions = []
        self.test_size = None

    def reset(self, seed=None):
        self.seed = seed
        return f"start {seed}", {"seed": seed}

    def step(self, action):
        self.actions.append(action)
        obs, reward, terminated = self.script[len(self.actions) - 1]
        return obs, reward, terminated, False, {"success": terminated and reward > 0}


class ScriptedLLM:
    """Answers each prompt with the next scripted text, ending in the end-of-turn token (as vLLM samples it)."""

    def __init__(self, tokenizer, texts, finish="stop"):
        self.tokenizer, self.texts, self.finish = tokenizer, list(texts), finish
        self.prompts = []

    async def complete_ids(self, prompt_ids, sampling, *, messages=None, prompt_text=""):
        self.prompts.append(list(prompt_ids))
        text = self.texts[len(self.prompts) - 1]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.finish == "stop":
            ids = ids + [self.tokenizer.eos_token_id]
        return scripted_call(
            text, ids, prompt_ids, sampling, messages=messages, prompt_text=prompt_text, finish=self.finish
        )


def play(tokenizer, script, texts, max_turns=8, finish="stop", max_context=None, examples=()):
    env = ScriptedEnv(script)
    llm = ScriptedLLM(tokenizer, texts, finish)
    agent = ChatAgent(
        AgentConfig(max_turns=max_turns, examples=list(examples)),
        SamplingParams(temperature=1.0, max_tokens=16),
        ChatTokens(tokenizer),
        max_context,
    )
    tape = asyncio.run(agent.run_episode(env, 7, llm, Tape()))
    return tape, env, llm


def test_episode_runs_until_terminated_and_records_every_turn(tokenizer):
    script = [("higher", 0.0, False), ("lower", 0.0, False), ("correct", 1.0, True)]
    tape, env, llm = play(tokenizer, script, ["\\boxed{5}", "\\boxed{8}", "\\boxed{7}"])
    assert env.seed == 7 and env.actions == ["\\boxed{5}", "\\boxed{8}", "\\boxed{7}"]
    kinds = [type(s).__name__ for s in tape.steps]
    assert kinds == [
        "EnvObservation",
        "EnvAction",
        "EnvObservation",
        "EnvAction",
        "EnvObservation",
        "EnvAction",
        "EnvObservation",
    ]
    assert [s.reward for s in tape.steps if isinstance(s, EnvObservation)] == [None, 0.0, 0.0, 1.0]
    assert tape.steps[-1].terminated and not tape.steps[-1].truncated
    m = tape.metadata
    assert (m.turns, m.reward, m.success, m.terminated, m.truncated) == (3, 1.0, True, True, False)
    assert [c.turn for c in tape.llm_calls] == [1, 2, 3]
    assert turn_rewards(tape) == [0.0, 0.0, 1.0]
    # every action step points to its call
    assert [s.metadata.prompt_id for s in tape.steps if isinstance(s, EnvAction)] == [c.id for c in tape.llm_calls]


def test_prompts_chain_token_exactly_and_match_the_chat_template(tokenizer):
    script = [("too low", 0.0, False), ("too high", 0.0, False), ("yes", 1.0, True)]
    texts = ["I guess \\boxed{5}", "Then \\boxed{9}", "\\boxed{7}"]
    example = Example(question="Guess a number.", solution="\\boxed{3}")
    tape, _, llm = play(tokenizer, script, texts, examples=[example])
    calls = tape.llm_calls
    assert calls[0].extends_previous is None and all(c.extends_previous for c in calls[1:])
    for before, after in zip(calls, calls[1:]):
        assert (
            after.prompt_token_ids[: len(before.prompt_token_ids) + len(before.output_token_ids)]
            == before.prompt_token_ids + before.output_token_ids
        )
    # For this (ChatML) template the chained ids are what the template gives for the whole conversation.
    messages = [
        {"role": "user", "content": "Guess a number."},
        {"role": "assistant", "content": "\\boxed{3}"},
        {"role": "user", "content": "start 7"},
        {"role": "assistant", "content": texts[0]},
        {"role": "user", "content": "too low"},
        {"role": "assistant", "content": texts[1]},
        {"role": "user", "content": "too high"},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert calls[2].prompt_token_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert calls[2].prompt_text == rendered


def test_stop_string_gets_the_whole_end_of_turn(tokenizer):
    chat = ChatTokens(tokenizer)
    sampled_eos = chat.continuation(tokenizer("a")["input_ids"] + [tokenizer.eos_token_id], "obs")[0]
    stopped = chat.continuation(tokenizer("a")["input_ids"], "obs")[0]
    assert stopped == tokenizer.eos_token + sampled_eos  # "<|im_end|>" appended only when not sampled


# An assistant turn that is the last message gets an empty think block, as Qwen3's template writes it (once a
# user message follows, the turn is rendered without it): the template is not a prefix of itself.
THINK_WHEN_LAST = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_renders_the_last_assistant_turn_otherwise_still_gives_a_delta(embedded_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)  # its own copy: the template is changed
    tokenizer.chat_template = THINK_WHEN_LAST
    chat = ChatTokens(tokenizer)
    assert chat.turn_end == "<|im_end|>\n"
    assert chat.user_delta("too low") == "<|im_start|>user\ntoo low<|im_end|>\n<|im_start|>assistant\n"
    # what follows an assistant's content must still render the same: a template that changes it is refused
    tokenizer.chat_template = THINK_WHEN_LAST.replace("<|im_end|>\n{% endfor", "{% if loop.last %}!{% endif %}"
                                                      "<|im_end|>\n{% endfor")  # fmt: skip
    with pytest.raises(ValueError, match="renders an assistant turn's end differently"):
        ChatTokens(tokenizer).user_delta("too low")
    # a template that writes an assistant turn with tool calls as its calls alone, without its content (Llama 3.1,
    # Mistral): the conversation renders the same with the tool's result added, and that is the delta
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}<call>"
        "{{ m.tool_calls[0].function.name }}</call>{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    calls = [{"id": "c1", "type": "function", "function": {"name": "python", "arguments": "{}"}}]
    delta = ChatTokens(tokenizer).messages_delta([{"role": "tool", "content": "42"}], calls)
    assert delta == "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_output_cut_by_max_tokens_ends_the_episode_truncated(tokenizer):
    tape, env, _ = play(tokenizer, [("x", 0.0, False)] * 3, ["a long answer", "b"], finish="length")
    assert env.actions == []  # the environment is not asked about a cut output
    assert tape.metadata.truncated and tape.metadata.turns == 1 and tape.metadata.reward == -1.0
    assert not tape.metadata.success


def test_turn_limit_and_full_context_truncate(tokenizer):
    tape, env, _ = play(tokenizer, [("again", 0.0, False)] * 5, ["\\boxed{1}"] * 5, max_turns=2)
    assert tape.metadata.turns == 2 and tape.metadata.truncated and not tape.metadata.terminated
    assert "turn limit" in tape.metadata.reward_reason
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "start 7"}], add_generation_prompt=True, tokenize=False
    )
    first = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    tape, _, _ = play(tokenizer, [("again", 0.0, False)] * 5, ["\\boxed{1}"] * 5, max_context=first + 16 + 5)
    assert tape.metadata.turns == 1 and tape.metadata.truncated and "context full" in tape.metadata.reward_reason


def test_returns_for_gamma_09_by_hand():
    # rewards 0, 0, 1 over three turns: G_2 = 1, G_1 = 0.9, G_0 = 0.81
    assert discounted_returns([0.0, 0.0, 1.0], 0.9) == pytest.approx([0.81, 0.9, 1.0])
    # -0.1, 0, 0.5: G_2 = 0.5, G_1 = 0 + 0.45 = 0.45, G_0 = -0.1 + 0.405 = 0.305
    assert discounted_returns([-0.1, 0.0, 0.5], 0.9) == pytest.approx([0.305, 0.45, 0.5])
    returns, adv = turn_advantages([[(0, -0.1), (1, 0.0), (2, 0.5)]], ["e"], ["g"], "none", gamma=0.9)
    assert returns == [pytest.approx([0.305, 0.45, 0.5])] and adv == returns


def test_one_turn_and_five_turn_episodes_weigh_the_same_in_their_group():
    one = [(0, 1.0)]
    five = [(0, 0.0), (1, 0.0), (2, 0.0), (3, 0.0), (4, 1.0)]
    returns, adv = turn_advantages([one, five, [(0, 0.0)]], ["a", "b", "c"], ["g", "g", "g"], "group", gamma=0.9)
    # episode scores G_0: 1, 0.9^4 = 0.6561, 0: mean 0.55203, sample std over three episodes (not over turns)
    scores = torch.tensor([1.0, 0.6561, 0.0], dtype=torch.float64)
    expected = ((scores - scores.mean()) / (scores.std() + 1e-6)).tolist()
    assert adv[0] == [pytest.approx(expected[0], abs=1e-5)]
    assert adv[1] == [pytest.approx(expected[1], abs=1e-5)] * 5  # every turn of an episode gets its advantage
    assert adv[2] == [pytest.approx(expected[2], abs=1e-5)]
    # had the 5 turns counted as 5 members, the mean would be pulled towards the long episode:
    assert sum(a[0] for a in adv) == pytest.approx(0.0, abs=1e-5)


def test_batch_baseline_normalises_turn_returns_over_the_batch():
    returns, adv = turn_advantages([[(0, 0.0), (1, 1.0)], [(0, 0.0)]], ["a", "b"], ["g1", "g2"], "batch", gamma=0.5)
    flat = torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64)  # G of a: 0.5, 1; of b: 0
    expected = ((flat - flat.mean()) / (flat.std() + 1e-6)).tolist()
    assert returns == [[0.5, 1.0], [0.0]]
    assert adv[0] == pytest.approx(expected[:2], abs=1e-6) and adv[1] == pytest.approx(expected[2:], abs=1e-6)


def test_an_episode_is_one_sample_with_environment_tokens_masked(tokenizer):
    script = [("too low", 0.0, False), ("yes", 1.0, True)]
    tape, _, _ = play(tokenizer, script, ["\\boxed{5}", "\\boxed{7}"])
    tape.metadata.group_id = "g"
    (raw,) = tape_samples(tape, require_ref=False)
    sample = Sample.model_validate(raw)
    first, second = tape.llm_calls
    assert sample.prompt_ids == first.prompt_token_ids
    assert sample.prompt_ids + sample.completion_ids == second.prompt_token_ids + second.output_token_ids
    assert [(t.index, t.reward) for t in sample.turns] == [(0, 0.0), (1, 1.0)]
    trained = [sample.completion_ids[k] for k in sample.trained_positions()]
    assert trained == first.output_token_ids + second.output_token_ids
    assert sample.behaviour_logprobs == first.logprobs + second.logprobs
    # the trainer predicts exactly the sampled tokens, from the right positions
    for layout in ("padded", "packed", "shared_prefix"):
        (mb,) = micro_batches(
            [sample.prompt_ids], [sample.completion_ids], 4096, layout, trained=[sample.trained_positions()]
        )
        assert mb.targets.tolist() == trained
        flat = mb.input_ids[mb.rows, mb.cols + 1].tolist()  # the token after each predicting position
        assert flat == trained, layout


def test_a_sample_keeps_where_versions_changed_across_turns_and_inside_a_call(tokenizer):
    """The first call changed from version 1 to 2 at its token 2 (new weights under it), the second was served
    by version 3: the sample's changes count sampled tokens (the environment's tokens between are not)."""
    from tapes.tape import VersionChange

    tape, _, _ = play(tokenizer, [("too low", 0.0, False), ("yes", 1.0, True)], ["\\boxed{5}", "\\boxed{7}"])
    first, second = tape.llm_calls
    n = len(first.output_token_ids)
    first.policy_version, first.version_changes = 1, [VersionChange(token=2, version=2)]
    second.policy_version = 3
    (raw,) = tape_samples(tape, require_ref=False)
    sample = Sample.model_validate(json.loads(json.dumps(raw)))  # as the learner reads it from the batch file
    assert sample.policy_version == 1 and sample.version_changes == [(2, 2), (n, 3)]
    assert sample.token_versions() == [1, 1] + [2] * (n - 2) + [3] * len(second.output_token_ids)


def test_a_re_rendered_prompt_cuts_the_episode_into_samples_of_one_episode(tokenizer):
    script = [("too low", 0.0, False), ("yes", 1.0, True)]
    tape, _, _ = play(tokenizer, script, ["\\boxed{5}", "\\boxed{7}"])
    second = tape.llm_calls[1]
    second.prompt_token_ids = second.prompt_token_ids[:-1] + [second.prompt_token_ids[-1] + 1]  # drift at the end
    second.prompt_token_ids = [9] + second.prompt_token_ids  # and a different start
    samples = tape_samples(tape, require_ref=False)
    assert len(samples) == 2 and {s["episode_id"] for s in samples} == {tape.metadata.id}
    returns, adv = turn_advantages(
        [[(t["index"], t["reward"]) for t in s["turns"]] for s in samples],
        [s["episode_id"] for s in samples],
        ["g", "g"],
        "none",
        gamma=0.9,
    )
    assert returns == [[pytest.approx(0.9)], [1.0]]  # one episode's returns across its two samples


def test_infrastructure_failure_is_left_out_of_training(tokenizer):
    tape, _, _ = play(tokenizer, [("yes", 1.0, True)], ["\\boxed{7}"])
    tape.metadata.error = "RuntimeError: sandbox could not start"
    assert tape_samples(tape, require_ref=False) == []


def test_a_tape_whose_prompt_filled_the_context_is_not_trained_on_and_the_run_says_why(tmp_path):
    """No call was made (the prompt + max_tokens did not fit): no sample, and a batch of only such tapes is
    refused naming the reason, not with 'no reward'."""
    from orchestrate.loop.samples import SampleError, write_samples
    from tapes.tape import Tape

    tape = Tape(steps=[])
    tape.metadata.reward_reason = "context full: 179 prompt tokens + 400 new > max_model_len 512"
    assert tape.metadata.reward is None and tape_samples(tape, require_ref=False) == []
    with pytest.raises(
        SampleError,
        match=r"no episode of 1 can be trained on; the agent made no LLM call \(context full: 179 prompt tokens",
    ):
        write_samples(tmp_path / "batch.jsonl", [tape], require_ref=False)
    assert not (tmp_path / "batch.jsonl").exists()
