"""Forks: an episode played again from its tape up to one of its LLM calls, then sampled live from there.

A fork of tape T at call K replays T's environment from its seed (`context.env`) with T's agent: its first K
LLM calls are answered from the tape (orchestrate.serving.recorded.ForkLLM, strictly: the agent must render
the recorded prompts token for token) and tools that a replay answers from the tape (search) answer them from
T's replayed part; every later call is sampled live. So a stateful environment (a game, a sandbox) is back
exactly where T was at call K, and the fork continues from there. `orchestrate.after.fork` forks a saved tape
on the command line; the loop's tree rollouts (orchestrate.loop.trees) branch its episodes with it.

A fork's tape names its parent (`metadata.parent_id`) and branch point (`metadata.branch_at` K); its first K
calls are the parent's as recorded (policy version, log-probs), the later ones new.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from agents.agent import summarize
from agents.env_spec import EnvSpec
from orchestrate.serving.llm import LLMError
from orchestrate.serving.recorded import ForkDiverged, ForkLLM
from tapes.tape import SamplingParams, Tape, TapeMetadata

DIVERGED = "fork_diverged"  # metadata.dropped of a fork that did not come back to its branch point


def fork_sampling(
    tape: Tape, run_sampling: SamplingParams, temperature: float | None = None, max_tokens: int | None = None
) -> SamplingParams:
    """The sampling the tape was played with (its first call's temperature and top_p, the largest max_tokens
    its calls had: a program may ask for fewer; the run's when it made no call), with the fork's changes. No
    stop strings (the agent adds its environment's, the gateway its tools') and no per-request seed."""
    calls = tape.llm_calls
    if calls:
        first = calls[0].sampling
        base = SamplingParams(temperature=first.temperature, top_p=first.top_p,
                              max_tokens=max(c.sampling.max_tokens for c in calls))  # fmt: skip
    else:
        base = SamplingParams(temperature=run_sampling.temperature, top_p=run_sampling.top_p,
                              max_tokens=run_sampling.max_tokens)  # fmt: skip
    changes = {"temperature": temperature, "max_tokens": max_tokens}
    return base.model_copy(update={k: v for k, v in changes.items() if v is not None})


def replayed_part(tape: Tape, at: int) -> Tape:
    """The tape up to where call `at` + 1 acted (its first `at` calls and what answered them): what a fork at
    `at` replays, and where its tools' recorded results come from."""
    ids = [c.id for c in tape.llm_calls[at:]]
    cut = next((i for i, s in enumerate(tape.steps) if s.metadata.prompt_id and s.metadata.prompt_id in ids),
               len(tape.steps))  # fmt: skip
    return tape.model_copy(update={"steps": tape.steps[:cut], "llm_calls": tape.llm_calls[:at]})


async def fork_once(
    tape: Tape,
    agent: Any,
    at: int,
    live: Any,
    sampling: SamplingParams | None,
    *,
    policy_version: int = 0,
    group_id: str | None = None,
    iteration: int | None = None,
    wrap_env: Any = None,
    keep_diverged: bool = False,
) -> Tape:
    """One continuation of `tape` after its first `at` calls (answered from it), the later calls by `live` (an
    LLM: a VLLMClient). Its group is `group_id` (default ID@K: the forks of one call) and its iteration
    `iteration` (default the parent's); `wrap_env(env)` wraps the environment (the loop times it).
    ForkDiverged when the agent does not come back to call `at` (a replayed prompt differs, or the episode
    ends sooner), or with `keep_diverged` the fork's tape marked `metadata.dropped` DIVERGED (its error says
    why: never trained on); LLMError when the live LLM fails; an environment or agent failure after the branch
    point is kept on the tape (`metadata.error`), as a rollout keeps it."""
    spec, seed = EnvSpec.of(tape)
    fork = Tape(
        metadata=TapeMetadata(parent_id=tape.metadata.id, branch_at=at, task_id=tape.metadata.task_id,
                              group_id=group_id or f"{tape.metadata.id}@{at}",
                              iteration=tape.metadata.iteration if iteration is None else iteration,
                              policy_version=policy_version),
        context=copy.deepcopy(tape.context),
    )  # fmt: skip
    llm = ForkLLM(tape, at, live)
    diverged: ForkDiverged | None = None
    try:
        env = spec.make(recorded=replayed_part(tape, at), live_after=True)
        await agent.run_episode(env if wrap_env is None else wrap_env(env), seed, llm, fork, sampling)
    except ForkDiverged as exc:  # a replayed prompt differs
        diverged = exc
        summarize(fork)
    except LLMError:
        raise
    except Exception as exc:  # the environment or agent failed: on the record, as a rollout keeps it
        fork.metadata.error = f"{type(exc).__name__}: {exc}"
        summarize(fork)
    if diverged is None and llm.replayed < at:
        why = fork.metadata.error or fork.metadata.reward_reason
        diverged = ForkDiverged(f"fork at call {at}: the episode ended after {llm.replayed} call"
                                f"{'' if llm.replayed == 1 else 's'}, before the branch point"
                                + (f" ({why})" if why else ""))  # fmt: skip
    if diverged is not None:
        if not keep_diverged:
            raise diverged
        fork.metadata.error, fork.metadata.dropped = str(diverged), DIVERGED
    return fork


async def fork_tape(
    tape: Tape, agent: Any, at: int, n: int, live: Any, sampling: SamplingParams, policy_version: int = 0
) -> list[Tape]:
    """`n` continuations of `tape` after its first `at` calls, played concurrently (`fork_once`), one group
    (ID@K); the first ForkDiverged or LLMError raises."""
    return list(await asyncio.gather(*(fork_once(tape, agent, at, live, sampling, policy_version=policy_version)
                                       for _ in range(n))))  # fmt: skip
