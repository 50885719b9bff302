"""The shipped agent example in a framework (agents/programs/pydantic_ai_tools.py, the `agents` extra) through
the gateway, as tests/test_gateway.py tests the plain-openai one: a scripted LLM with the embedded model's real
tokenizer, pydantic-ai's OpenAI model over real HTTP. Without the extra these tests fail (the program does not
load), they do not skip: CI installs it."""

from __future__ import annotations

from orchestrate.loop.samples import tape_samples
from orchestrate.serving.recorded import ReplayLLM
from tapes.tape import ToolResultObservation
from tests.programs import ScriptedLLM, answer_of, play
from tests.test_gateway import assert_steps_of_the_tool_example, tool_reply

PROGRAM = "agents.programs.pydantic_ai_tools:play"


def test_the_pydantic_ai_example_is_recorded_token_exactly_and_scored_by_the_environment(tokenizer, agent_for):
    a, b, product = answer_of()
    llm = ScriptedLLM(tokenizer, [tool_reply(a, b), f"The answer is \\boxed{{{product}}}."])
    agent = agent_for(PROGRAM)
    tape = play(agent, llm)
    assert tape.metadata.error is None, tape.metadata.error
    assert tape.metadata.reward == 1.0 and tape.metadata.success is True and tape.metadata.turns == 2
    first, second = tape.llm_calls
    # pydantic-ai writes the history back (its own ids, its own JSON spacing) as the gateway sent it: one sample
    assert second.extends_previous is True and agent.mismatches == 0
    added = tokenizer.decode(second.prompt_token_ids[len(first.prompt_token_ids) + len(first.output_token_ids) :])
    assert added == f"<|im_end|>\n<|im_start|>tool\n{product}<|im_end|>\n<|im_start|>assistant\n"
    # the tool pydantic-ai made of the typed function, its docstring the description; the worked example's call
    assert '"name": "python", "description": "Run Python code; you get back what it prints."' in first.prompt_text
    assert '"code": {"description": "the code to run", "type": "string"}' in first.prompt_text
    assert (
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(123 * 45)"}}\n</tool_call>' in first.prompt_text
    )
    assert_steps_of_the_tool_example(tape, a, b, product)
    (sample,) = tape_samples(tape, require_ref=False)
    assert sample["reward"] == 1.0


def test_a_wrong_call_gets_the_frameworks_error_as_its_result_and_the_prompts_still_extend(tokenizer, agent_for):
    a, b, product = answer_of()
    wrong = '<tool_call>\n{"name": "calc", "arguments": {"x": "1"}}\n</tool_call>'
    llm = ScriptedLLM(tokenizer, [wrong, tool_reply(a, b), f"\\boxed{{{product}}}"])
    agent = agent_for(PROGRAM)
    tape = play(agent, llm)
    assert tape.metadata.error is None and tape.metadata.reward == 1.0
    assert [c.extends_previous for c in tape.llm_calls] == [None, True, True] and agent.mismatches == 0
    results = [s.text for s in tape.steps if isinstance(s, ToolResultObservation)]
    assert "Unknown tool name: 'calc'" in results[0] and results[1] == str(product)


def test_the_call_limit_ends_the_episode_and_the_environment_scores_what_is_left(tokenizer, agent_for):
    a, b, _ = answer_of()
    llm = ScriptedLLM(tokenizer, [tool_reply(a, b)] * 3 + ["never asked"])
    agent = agent_for(PROGRAM)
    tape = play(agent, llm)
    # MAX_TURNS calls, then no answer: a reward from the environment, not an infrastructure failure
    assert tape.metadata.error is None and tape.metadata.success is False
    assert len(tape.llm_calls) == 3 and llm.replies == ["never asked"]
    assert [c.extends_previous for c in tape.llm_calls] == [None, True, True] and agent.mismatches == 0


def test_a_replay_of_the_pydantic_ai_example_asks_the_same_prompts(tokenizer, agent_for):
    a, b, product = answer_of()
    agent = agent_for(PROGRAM)
    tape = play(agent, ScriptedLLM(tokenizer, [tool_reply(a, b), f"\\boxed{{{product}}}"]))
    again = play(agent, ReplayLLM(tape, strict=True))
    assert [c.prompt_token_ids for c in again.llm_calls] == [c.prompt_token_ids for c in tape.llm_calls]
    assert again.metadata.reward == tape.metadata.reward == 1.0
