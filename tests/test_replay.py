"""Replay (`python -m orchestrate.replay`): every tape of a real run comes back the same through the
run's agent; a changed agent is reported at the first step that differs."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from agents.agent import Agent
from agents.math_agent import MathAgentConfig, SolveNode, math_agent
from agents.rewards import score_tape
from agents.tasks import Task
from orchestrate.replay import agent_from_run_config, replay_tape
from orchestrate.rollouts import run_rollouts
from tapes.store import read_tapes, write_tapes
from tapes.tape import FinalAnswerAction, LLMCall, ParseFailureStep, SamplingParams

vllm = pytest.mark.vllm  # these use the tapes of the real run made by the `tiny_run` fixture


class ScriptedLLM:
    def __init__(self, outputs):
        self.outputs = list(outputs)

    async def generate(self, messages, sampling):
        text, finish = self.outputs.pop(0)
        return LLMCall(messages=messages, output_text=text, output_token_ids=[1, 2], logprobs=[-0.1, -0.2],
                       prompt_token_ids=[3], finish_reason=finish, sampling=sampling)  # fmt: skip


def test_replay_and_diff_without_servers():
    """The same checks on scripted tapes: identical replays, and each kind of difference named."""
    agent = math_agent(MathAgentConfig(), SamplingParams(temperature=0.7, max_tokens=16))
    tasks = [Task(id="a", question="What is 7 + 5?", answer="12")]
    llm = ScriptedLLM([("so \\boxed{12}", "stop"), ("I think 12", "stop"), ("\\boxed{13}", "stop")])
    tapes = asyncio.run(run_rollouts(agent, tasks, 3, llm, score_tape, iteration=1, policy_version=0, progress=False))
    for tape in tapes:
        replayed, diff = asyncio.run(replay_tape(tape, agent))
        assert diff.identical, diff.report()
        assert replayed.metadata.reward == tape.metadata.reward and replayed.metadata.parent_id == tape.metadata.id

    # a parser that takes the first number it sees: tape 2 (no box) now answers; tape 0 keeps its steps
    class FirstNumber(SolveNode):
        def parse(self, tape, text, finish_reason):
            import re

            m = re.search(r"\d+", text)
            return [FinalAnswerAction(answer=m.group(0))] if m else [ParseFailureStep(error="no number")]

    changed = Agent("math_agent", [FirstNumber(MathAgentConfig())], agent.sampling)
    _, diff = asyncio.run(replay_tape(tapes[1], changed))
    assert diff.first_step.index == 1 and diff.first_step.recorded["kind"] == "parse_failure"
    assert diff.first_step.replayed == {"kind": "final_answer_action", "answer": "12",
                                        "metadata": diff.first_step.replayed["metadata"]}  # fmt: skip
    assert diff.reward is None  # the math reward reads the output text, not the agent's steps
    _, diff = asyncio.run(replay_tape(tapes[0], changed))
    assert diff.first_step.index == 1 and diff.first_step.fields == ["answer", "kind", "reasoning"]
    assert "step 3 (final_answer_action): missing from the replay" in diff.report()  # two steps became one

    # an agent that wants a second call the tape does not have
    class TwoCalls(Agent):
        def next_node(self, tape):
            return self.nodes[0] if len(tape.steps) < 4 else None

    _, diff = asyncio.run(replay_tape(tapes[1], TwoCalls("math_agent", agent.nodes, agent.sampling)))
    assert any("the agent made call #2; the tape recorded 1" in note for note in diff.notes)


@vllm
def test_every_tape_of_a_run_replays_identically(tiny_run):
    agent = agent_from_run_config(tiny_run / "config.json")
    files = sorted((tiny_run / "tapes").glob("*.jsonl"))
    assert [f.name for f in files] == ["eval_000000.jsonl", "eval_000002.jsonl", "iter_000001.jsonl", "iter_000002.jsonl"]
    count = 0
    for path in files:
        for tape in read_tapes(path):
            replayed, diff = asyncio.run(replay_tape(tape, agent))
            assert diff.identical, diff.report()
            assert [s.kind for s in replayed.steps] == [s.kind for s in tape.steps]
            assert replayed.metadata.reward == tape.metadata.reward
            assert replayed.metadata.reward_reason == tape.metadata.reward_reason
            assert [c.output_token_ids for c in replayed.llm_calls] == [c.output_token_ids for c in tape.llm_calls]
            count += 1
    assert count == 24

    out = subprocess.run([sys.executable, "-m", "orchestrate.replay", *map(str, files), "--quiet"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("24 tapes replayed: 24 identical, 0 differ")


class AnswerAnythingNode(SolveNode):
    """A 'new parser': whatever the model wrote is the answer (no \\boxed{} needed)."""

    def parse(self, tape, text, finish_reason):
        return [FinalAnswerAction(answer=text.strip() or "?")]


@vllm
def test_changed_parsing_is_reported_at_the_first_differing_step(tiny_run):
    tape = next(read_tapes(tiny_run / "tapes" / "iter_000001.jsonl"))
    assert isinstance(tape.steps[1], ParseFailureStep)  # the tiny model never writes \boxed{}
    recorded = agent_from_run_config(tiny_run / "config.json")
    changed = Agent("math_agent", [AnswerAnythingNode(recorded.nodes[0].config)], recorded.sampling)

    replayed, diff = asyncio.run(replay_tape(tape, changed))
    assert not diff.identical
    assert diff.first_step.index == 1  # step 2: the task (step 1) is the same
    assert diff.first_step.recorded["kind"] == "parse_failure"
    assert diff.first_step.replayed["kind"] == "final_answer_action"
    assert "kind" in diff.first_step.fields
    report = diff.report()
    assert report.splitlines()[1].startswith("  step 2 (parse_failure) differs in ")
    assert "recorded: {'kind': 'parse_failure'" in report and "replayed: {'kind': 'final_answer_action'" in report

    # a changed prompt is named too (the recorded answer is still used to go on)
    prompting = math_agent(MathAgentConfig(instruction="Answer briefly."), recorded.sampling)
    _, diff = asyncio.run(replay_tape(tape, prompting))
    assert any("call #1 prompt differs" in note and "Answer briefly." in note for note in diff.notes)


@vllm
def test_replay_command_names_the_first_differing_step(tiny_run, tmp_path):
    """A tape whose recorded output now parses differently (here: the output is edited to hold a
    \\boxed{} answer, as if the parser had changed) is reported step by step, exit status 1."""
    (tmp_path / "tapes").mkdir()
    (tmp_path / "config.json").write_text((tiny_run / "config.json").read_text())
    tapes = list(read_tapes(tiny_run / "tapes" / "iter_000001.jsonl"))[:3]
    tapes[1].llm_calls[0].output_text = "so \\boxed{71}"
    tapes[1].llm_calls[0].finish_reason = "stop"
    path = write_tapes(tmp_path / "tapes" / "iter_000001.jsonl", tapes)

    out = subprocess.run([sys.executable, "-m", "orchestrate.replay", str(path)], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert sum("identical" in line and "differs" not in line for line in lines[:-1]) == 2
    i = next(i for i, line in enumerate(lines) if f"tape {tapes[1].metadata.id}: differs" in line)
    assert lines[i + 1].startswith("  step 2 (parse_failure) differs in ")
    assert "reward: recorded -1.0, replayed" in out.stdout
    assert lines[-1] == "3 tapes replayed: 2 identical, 1 differ"

    out = subprocess.run([sys.executable, "-m", "orchestrate.replay", str(path), "--index", "9"],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and "--index 9" in out.stderr
