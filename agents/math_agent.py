"""The math agent: task -> reasoning thought -> final answer (the last \\boxed{} value).

One node. The prompt is an optional system message, optional worked examples
as earlier chat turns (the untrained embedded model needs one to produce a
`\\boxed{}` answer at all, see DESIGN.md), then the question. The output's
text before the last box becomes a `ReasoningThought`, the box's content a
`FinalAnswerAction`; output with no box becomes a `ParseFailureStep`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from agents.agent import Agent, Node
from agents.rewards import last_boxed
from tapes.tape import FinalAnswerAction, ParseFailureStep, ReasoningThought, SamplingParams, Step, Tape, TaskStep

DEFAULT_INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."


class Example(BaseModel):
    question: str
    solution: str = Field(description="a worked solution ending in \\boxed{answer}")


class MathAgentConfig(BaseModel):
    system_prompt: str | None = Field(None, description="system message; None keeps the chat template's default")
    instruction: str = Field(DEFAULT_INSTRUCTION, description="added after each question")
    examples: list[Example] = Field(default_factory=list, description="worked examples, as earlier chat turns")


class SolveNode(Node):
    name = "solve"

    def __init__(self, config: MathAgentConfig):
        self.config = config

    def _user(self, question: str) -> dict[str, str]:
        text = f"{question}\n{self.config.instruction}" if self.config.instruction else question
        return {"role": "user", "content": text}

    def prompt(self, tape: Tape) -> list[dict[str, Any]]:
        task = tape.last(TaskStep)
        if task is None:
            raise ValueError("the math agent needs a tape that starts with a task step")
        messages: list[dict[str, Any]] = []
        if self.config.system_prompt:
            messages.append({"role": "system", "content": self.config.system_prompt})
        for example in self.config.examples:
            messages += [self._user(example.question), {"role": "assistant", "content": example.solution}]
        messages.append(self._user(task.text))
        return messages

    def parse(self, tape: Tape, text: str, finish_reason: str | None) -> list[Step]:
        answer = last_boxed(text)
        if answer is None or not answer:
            reason = "output cut by the token limit" if finish_reason == "length" else "no \\boxed{} answer"
            return [ParseFailureStep(error=reason, output=text)]
        reasoning = text[: text.rfind("\\boxed")].strip()
        return [ReasoningThought(reasoning=reasoning), FinalAnswerAction(answer=answer)]


def math_agent(config: MathAgentConfig | None = None, sampling: SamplingParams | None = None) -> Agent:
    return Agent("math_agent", [SolveNode(config or MathAgentConfig())], sampling or SamplingParams())
