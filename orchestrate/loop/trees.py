"""Tree rollouts: each task's attempts are roots that branch where it matters, instead of chains.

With `--tree.width W` (orchestrate.loop.config.TreeSection) an iteration plays, per task:
  1. the roots: `rollouts.attempts` episodes from the task, as chains are played (orchestrate.loop.rollouts);
  2. `tree.depth` levels of branching: on each episode of the level before (the roots first), `tree.points`
     branch points are chosen among its own calls after the first (a fork's: after its branch point), and at
     each one W - 1 forks are played (orchestrate.loop.forks.fork_once): the environment restored by replaying
     the episode's recorded calls up to that call (answered from the tape, nothing regenerated; the prompts
     hit the server's prefix cache), then sampled live with the policy being served (each call carries its
     version, so trees run under run.async_level > 0 as chains do), at `tree.temperature` when given (the
     roots' otherwise). The episode's own continuation is the W-th sibling at its branch point.
Branch points: `turn` picks them uniformly over the eligible calls (Tree-GRPO, arXiv:2509.21240); `entropy`
picks the calls whose first FIRST_TOKENS sampled tokens are the most surprising (mean -log p: a one-sample
estimate of the entropy there) compared with the call before, i.e. where the model's uncertainty rises after an
observation (ARPO, arXiv:2507.19849). With `tree.token_budget` no fork starts once the task's generated
tokens (the roots' and the forks' live calls) plus the forks already planned (each estimated as what its
parent generated after the branch point) would pass it, so a tree and a chain can be compared at the same
number of generated tokens.

Every tape of a task is in its group (the task's group id): roots and forks alike; a fork names its parent
(`metadata.parent_id`) and branch point (`metadata.branch_at`, the calls replayed), which the learner reads as
the tree (orchestrate.loop.samples: a fork's replayed calls are its parent's, trained once, there; the `tree`
estimator gives credit by subtree, finetune.estimators). A fork that does not come back to its branch point
(its replayed prompt differs, or the episode ends sooner) is kept on the record, marked `metadata.dropped`
"fork_diverged" with its error, counted (`tree_forks_dropped`) and never trained on.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

from orchestrate.loop.forks import DIVERGED, fork_once, fork_sampling
from orchestrate.loop.progress import progress_bar
from orchestrate.loop.rollouts import RolloutContext, group_id, play
from tapes.tape import SamplingParams, Tape

FIRST_TOKENS = 8  # branch_by entropy: the sampled tokens at the start of a call that measure its uncertainty


def generated_tokens(tape: Tape) -> int:
    """Tokens the tape's own calls sampled (a fork's: those after its branch point; the replayed ones are its
    parent's)."""
    return sum(len(c.output_token_ids) for c in tape.llm_calls[tape.metadata.branch_at or 0 :])


def eligible_points(tape: Tape) -> list[int]:
    """Calls a fork of `tape` can branch at: its own calls after its first (a root's 1..n-1, a fork's after its
    branch point), so that every fork replays at least one call and samples at least one; none for an
    episode that failed or was dropped."""
    if tape.metadata.error or tape.metadata.dropped:
        return []
    return list(range((tape.metadata.branch_at or 0) + 1, len(tape.llm_calls)))


def surprisal(tape: Tape, call: int) -> float:
    """Mean -log p of the first FIRST_TOKENS tokens call `call` sampled (0 when it sampled none)."""
    logprobs = tape.llm_calls[call].logprobs[:FIRST_TOKENS]
    return -sum(logprobs) / len(logprobs) if logprobs else 0.0


def choose_points(tape: Tape, points: int, branch_by: str, rng: random.Random) -> list[int]:
    """Up to `points` branch points of `tape`, in call order: uniformly at random (turn), or the calls whose
    surprisal rises most over the call before (entropy; ties to the earlier call)."""
    calls = eligible_points(tape)
    if len(calls) <= points:
        return calls
    if branch_by == "turn":
        return sorted(rng.sample(calls, points))
    rise = {k: surprisal(tape, k) - surprisal(tape, k - 1) for k in calls}
    return sorted(sorted(calls, key=lambda k: (-rise[k], k))[:points])


class Budget:
    """A task's generated tokens against tree.token_budget (none: unbounded)."""

    def __init__(self, limit: int | None):
        self.limit, self.spent = limit, 0

    def allows(self, planned: int) -> bool:
        return self.limit is None or self.spent + planned <= self.limit


def plan_forks(frontier: Sequence[Tape], tree, budget: Budget, rng: random.Random) -> list[tuple[Tape, int]]:
    """(parent, branch point) of every fork of one level, width - 1 per point, in order, while the budget
    allows (each fork estimated as what its parent generated after the point)."""
    planned, cost = [], 0
    for tape in frontier:
        for at in choose_points(tape, tree.points, tree.branch_by, rng):
            estimate = sum(len(c.output_token_ids) for c in tape.llm_calls[at:])
            for _ in range(tree.width - 1):
                if not budget.allows(cost + estimate):
                    return planned
                planned.append((tape, at))
                cost += estimate
    return planned


async def grow_tree(context: RolloutContext, seed: int, attempts: int, tree, *, on_episode=None) -> list[Tape]:
    """One task's tree: its roots, then each level's forks; every tape in the order played (roots first)."""
    c = context
    group = group_id(c.iteration, c.spec, seed)
    rng = random.Random(f"tree|{group}")  # the same branch points for the same tapes
    budget = Budget(tree.token_budget)

    async def root() -> Tape:
        tape = await play(c, seed, c.new_tape(seed))
        if on_episode:
            on_episode()
        return tape

    async def fork(parent: Tape, at: int) -> Tape:
        fork_at = c.sampling  # the parent's sampling (max_tokens, top_p; a parent has calls) at the forks' temperature
        if tree.temperature is not None:
            fork_at = fork_sampling(parent, c.sampling or SamplingParams(), temperature=tree.temperature)
        tape = await fork_once(parent, c.agent, at, c.llm, fork_at, policy_version=c.policy_version, group_id=group,
                               iteration=c.iteration, keep_diverged=True, wrap_env=c.timed)  # fmt: skip
        if on_episode:
            on_episode()
        return tape

    tapes = list(await asyncio.gather(*(root() for _ in range(attempts))))
    budget.spent = sum(generated_tokens(t) for t in tapes)
    frontier = tapes
    for _ in range(tree.depth):
        planned = plan_forks(frontier, tree, budget, rng)
        if not planned:
            break
        frontier = list(await asyncio.gather(*(fork(parent, at) for parent, at in planned)))
        tapes += frontier
        budget.spent += sum(generated_tokens(t) for t in frontier)
    return tapes


async def run_tree_rollouts(
    context: RolloutContext, seeds: list[int], attempts: int, tree, *, desc: str = "rollouts", progress: bool = True
) -> list[Tape]:
    """Every task's tree (`grow_tree`), all tasks at once; the tapes grouped by task, in order."""
    bar = progress_bar(
        total=len(seeds) * tree.max_episodes(attempts), desc=desc, unit="episode", disable=not progress, leave=False
    )
    try:
        trees = await asyncio.gather(*(
            grow_tree(context, seed, attempts, tree, on_episode=lambda: bar.update(1)) for seed in seeds
        ))  # fmt: skip
    finally:
        bar.close()
    return [tape for tapes in trees for tape in tapes]


def diverged(tape: Tape) -> bool:
    """A fork that did not come back to its branch point: kept on the record, never trained on."""
    return tape.metadata.dropped == DIVERGED


def tree_metrics(tapes: list[Tape]) -> dict[str, float]:
    """An iteration's tree figures, from its saved tapes: tree_forks (forks played and kept), tree_forks_dropped
    (forks that did not come back to their branch point), tree_depth_max (levels of the deepest branch),
    tree_roots_unforked (roots with a call to branch at that no fork branched from: every such root is forked
    unless tree.token_budget was spent first, by the roots alone when a whole task has none)."""
    forks = [t for t in tapes if t.metadata.parent_id is not None and not diverged(t)]
    by_id = {t.metadata.id: t for t in tapes}
    parents = {t.metadata.parent_id for t in tapes if t.metadata.parent_id is not None}
    roots = [t for t in tapes if t.metadata.parent_id is None]

    def depth(tape: Tape) -> int:
        d = 0
        while tape.metadata.parent_id in by_id:
            tape, d = by_id[tape.metadata.parent_id], d + 1
        return d

    return {
        "tree_forks": len(forks),
        "tree_forks_dropped": sum(diverged(t) for t in tapes),
        "tree_depth_max": max((depth(t) for t in forks), default=0),
        # a root dynamic sampling left out later is counted as it was played (eligible_points reads the drop)
        "tree_roots_unforked": sum(
            len(t.llm_calls) > 1 and not t.metadata.error and t.metadata.id not in parents for t in roots
        ),  # fmt: skip
    }
