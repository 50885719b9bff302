"""Agents and nodes, in the spirit of TapeAgents.

A `Node` does one thing: build a prompt from the tape, and turn the LLM's
output into typed steps. An `Agent` runs nodes in turn, records each LLM call
whole on the tape, and stops when a node produces a final step (or after its
last node). Multi-step agents are agents with several nodes, or a node that
runs again (override `Agent.next_node`); an environment adds observations
between agent turns with `tape.append`.
"""

from __future__ import annotations

from typing import Any

from agents.llm import LLM
from tapes.tape import Action, ParseFailureStep, SamplingParams, Step, Tape


class Node:
    """One LLM call: prompt from tape, steps from output."""

    name: str = "node"

    def prompt(self, tape: Tape) -> list[dict[str, Any]]:
        raise NotImplementedError

    def parse(self, tape: Tape, text: str, finish_reason: str | None) -> list[Step]:
        raise NotImplementedError


def is_final(step: Step) -> bool:
    """Steps after which the agent stops: an answer, or output it could not parse."""
    return isinstance(step, (Action, ParseFailureStep))


class Agent:
    def __init__(self, name: str, nodes: list[Node], sampling: SamplingParams, max_calls: int = 8):
        if not nodes:
            raise ValueError("an agent needs at least one node")
        self.name = name
        self.nodes = nodes
        self.sampling = sampling
        self.max_calls = max_calls

    def next_node(self, tape: Tape) -> Node | None:
        """The node after the one that wrote the last step; the first if none did; None after the last."""
        if tape.steps and is_final(tape.steps[-1]):
            return None
        names = [node.name for node in self.nodes]
        last = next((s.metadata.node for s in reversed(tape.steps) if s.metadata.node in names), None)
        index = 0 if last is None else names.index(last) + 1
        return self.nodes[index] if index < len(self.nodes) else None

    async def run(self, tape: Tape, llm: LLM, sampling: SamplingParams | None = None) -> Tape:
        """Continue `tape` until the agent stops; returns the same tape, extended."""
        tape.metadata.author = self.name
        for _ in range(self.max_calls):
            node = self.next_node(tape)
            if node is None:
                break
            call = await llm.generate(node.prompt(tape), sampling or self.sampling)
            steps = node.parse(tape, call.output_text, call.finish_reason)
            for step in steps:
                step.metadata.node = node.name
                step.metadata.agent = self.name
                tape.append(step, llm_call=call)
        return tape
