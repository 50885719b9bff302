"""Counterfactual credit per role (`--rollouts.counterfactual K`, with agent.roles).

For each episode of an iteration and each trained role that first acts after the episode's first call, K forks
at that role's first call (orchestrate.loop.forks.fork_once: the episode replayed up to it, the other roles'
earlier calls answered from its tape, the environment restored; then everything live, that role's calls by its
policy and the other roles' later calls by theirs). The role's sample of the episode and those of its K forks
start from the same state, so they form an advantage group of their own (`counterfactual_group`): the role's
advantage is its return less what its own policy earns from that state, and what the other roles did before it
(the solver's answer a judge reads) no longer counts for or against it, as it does when a role's samples are
grouped per task. The forks' other samples are not trained (their earlier calls are the parent's, their later
ones continue an episode the role changed): a fork's tape names its role (`metadata.counterfactual`). A role
that acts first has no earlier state: its samples keep the task's group. A fork that does not come back to its
branch point is kept on the record, marked dropped, never trained on (as a tree's fork).
"""

from __future__ import annotations

import asyncio

from orchestrate.loop.forks import DIVERGED, fork_once
from orchestrate.loop.progress import progress_bar
from orchestrate.loop.rollouts import RolloutContext
from tapes.tape import Tape


def branch_points(tape: Tape, roles: list[str] | None) -> dict[str, int]:
    """Role -> the index of its first call, for the roles (`roles`; None: every role) whose first call comes
    after the episode's first; none for an episode that failed, was dropped, or is a fork itself."""
    m = tape.metadata
    if m.error or m.dropped or m.parent_id is not None:
        return {}
    first: dict[str, int] = {}
    for i, call in enumerate(tape.llm_calls):
        if call.role is not None:
            first.setdefault(call.role, i)
    return {role: i for role, i in first.items() if i > 0 and (roles is None or role in roles)}


def counterfactual_group(tape: Tape, role: str) -> str:
    """The advantage group of `role`'s samples of `tape` and of its forks at that role's first call."""
    return f"{tape.metadata.group_id}|{tape.metadata.id}@{role}"


async def run_counterfactuals(
    context: RolloutContext, tapes: list[Tape], k: int, roles: list[str] | None, *, desc: str = "counterfactual",
    progress: bool = True,
) -> list[Tape]:  # fmt: skip
    """`k` forks of each of `tapes` at each of its branch points (`branch_points`), all at once; each fork's tape
    names its role (`metadata.counterfactual`) and is in that role's counterfactual group."""
    planned = [(tape, at, role) for tape in tapes for role, at in branch_points(tape, roles).items() for _ in range(k)]
    bar = progress_bar(total=len(planned), desc=desc, unit="fork", disable=not progress or not planned, leave=False)

    async def one(tape: Tape, at: int, role: str) -> Tape:
        fork = await fork_once(tape, context.agent, at, context.llm, context.sampling,
                               policy_version=context.policy_version, group_id=counterfactual_group(tape, role),
                               iteration=context.iteration, wrap_env=context.timed, keep_diverged=True)  # fmt: skip
        fork.metadata.counterfactual = role
        bar.update(1)
        return fork

    try:
        return list(await asyncio.gather(*(one(*plan) for plan in planned)))
    finally:
        bar.close()


def counterfactual_metrics(tapes: list[Tape]) -> dict[str, float]:
    """An iteration's counterfactual figures: the forks played and kept, those that did not come back to their
    branch point (dropped), and the tokens the kept ones generated live."""
    forks = [t for t in tapes if t.metadata.counterfactual]
    kept = [t for t in forks if t.metadata.dropped != DIVERGED]
    return {
        "counterfactual_forks": len(kept),
        "counterfactual_forks_dropped": len(forks) - len(kept),
        "counterfactual_tokens": sum(
            len(c.output_token_ids) for t in kept for c in t.llm_calls[t.metadata.branch_at or 0 :]
        ),  # fmt: skip
    }
