"""Dynamic sampling (DAPO, arXiv:2503.14476 section 3.2): keep only groups that carry a learning signal.

Under a group-relative estimator (`--train.estimator group` or `rloo`) a group whose attempts all earn
the same return gets advantage 0 everywhere: it costs a training step and teaches nothing. With
`--rollouts.dynamic_sampling` such groups are dropped from the batch and the batch is filled with
groups of extra tasks, in rounds, until it holds `tasks_per_iteration` groups with signal or
`max_extra_tasks` extra tasks were drawn.

- Signal: a group has it when the returns G_0 of its episodes (what the estimators compare: each
  turn's reward plus the overlong shaping when it is on, discounted by train.gamma; infrastructure
  failures left out) spread by more than SPREAD_TOLERANCE. A group with fewer than two such episodes
  has none.
- Seeds: with dynamic sampling iteration i owns the n + M consecutive train episode numbers from
  (i - 1)(n + M) (n tasks_per_iteration, M max_extra_tasks): the first n are its tasks, the other M
  its extra tasks, drawn in that order as rounds need them. So they are the same on a resumed run,
  never another iteration's, and never held-out episodes (those are the test split). Off, the stride
  is n, as it always was.
- Rounds: each round draws as many extra tasks as groups are still missing (no group generated is
  surplus), at most the ones left of the M.
- The batch: the first n groups with signal in the order they were generated (first the iteration's
  own tasks, then the rounds'). If none has signal after the bound, the batch is the iteration's
  first n groups, as without dynamic sampling (every advantage 0; the trainer steps as it does on any
  such batch), and only the extra groups are dropped.
- Tapes: every tape generated is saved; those of a group left out of the batch carry
  `metadata.dropped = "dynamic_sampling"` (a field of tapes.tape.TapeMetadata), and the batch is written from the tapes without it, so a resumed run writes the same batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from finetune.estimators import episode_returns
from orchestrate.loop.samples import tape_samples
from tapes.tape import Tape

DROPPED_BY = "dynamic_sampling"
# Returns spreading by at most this much are equal: float noise of sums of equal rewards (an absolute
# bound; rewards are O(1)). The group estimator then gives 0 or, normalised by std + 1e-6, under 1e-3.
SPREAD_TOLERANCE = 1e-9


def iteration_seeds(iteration: int, rollouts) -> tuple[list[int], list[int]]:
    """(the iteration's train episode seeds, its extra seeds in the order rounds draw them), from the
    rollouts section (RolloutSection): without dynamic sampling the extra seeds are none."""
    n = rollouts.tasks_per_iteration
    m = rollouts.max_extra_tasks if rollouts.dynamic_sampling else 0
    start = (iteration - 1) * (n + m)
    return list(range(start, start + n)), list(range(start + n, start + n + m))


def dropped(tape: Tape) -> bool:
    """Whether the tape was left out of its iteration's batch by dynamic sampling."""
    return tape.metadata.dropped == DROPPED_BY


def mark_dropped(tape: Tape) -> None:
    """Left out by dynamic sampling; a tape already left out (a fork that did not come back) keeps its reason."""
    if tape.metadata.dropped is None:
        tape.metadata.dropped = DROPPED_BY


def groups_of(tapes: list[Tape]) -> dict[str, list[Tape]]:
    """Tapes by group id, in the order the groups first appear."""
    out: dict[str, list[Tape]] = {}
    for tape in tapes:
        out.setdefault(tape.metadata.group_id, []).append(tape)
    return out


def episode_scores(tapes: list[Tape], train) -> list[float]:
    """G_0 of every trained episode of `tapes` as the learner computes it (train: its TrainConfig):
    the turns' rewards, shaped, discounted by train.gamma. Infrastructure failures have none."""
    turns, ids, branches = [], [], []
    for tape in tapes:
        for sample in tape_samples(tape, require_ref=False):
            turns.append(
                [
                    (t["index"], train.shaped_reward(t["reward"], t["length"], t.get("max_tokens")))
                    for t in sample["turns"]
                ]
            )
            ids.append(sample["episode_id"])
            branches.append(sample["branch"])
    return [r[min(r)] for r in episode_returns(turns, ids, train.gamma, branches).values() if r]


def has_signal(group: list[Tape], train) -> bool:
    """Whether a group's returns differ (a group-relative estimator gives it some advantage that is not 0)."""
    scores = episode_scores(group, train)
    return len(scores) >= 2 and max(scores) - min(scores) > SPREAD_TOLERANCE


@dataclass
class Selection:
    tapes: list[Tape]  # every tape generated, in order; those left out of the batch marked dropped
    rounds: int = 0  # rounds of extra tasks
    extra_tasks: int = 0  # extra seeds drawn
    kept: list[str] = field(default_factory=list)  # group ids with signal in the batch

    @property
    def batch(self) -> list[Tape]:
        return [t for t in self.tapes if not dropped(t)]


def sample_dynamically(
    rollout: Callable[[list[int]], list[Tape]], seeds: list[int], extra: list[int], train
) -> Selection:
    """The iteration's tapes with dynamic sampling: `rollout(seeds)` plays every attempt at each seed (one
    group per seed); groups without signal are dropped and extra seeds, in order, played in rounds of as
    many as groups are missing, until len(seeds) groups with signal or no extra seed is left."""
    need = len(seeds)
    tapes = rollout(seeds)
    first = list(groups_of(tapes))
    kept = [g for g, members in groups_of(tapes).items() if has_signal(members, train)]
    rounds = drawn = 0
    while len(kept) < need and drawn < len(extra):
        more = extra[drawn : drawn + need - len(kept)]
        drawn += len(more)
        rounds += 1
        new = rollout(more)
        tapes += new
        kept += [g for g, members in groups_of(new).items() if has_signal(members, train)]
    batch = set(kept) if kept else set(first)  # no signal at all: the batch the loop writes without it
    for tape in tapes:
        if tape.metadata.group_id not in batch:
            mark_dropped(tape)
    return Selection(tapes, rounds, drawn, kept)


def dynamic_metrics(tapes: list[Tape], tasks_per_iteration: int, train) -> dict[str, int]:
    """An iteration's figures, from its saved tapes (so a resumed run records the same):
    dynamic_extra_tasks (extra seeds drawn), dynamic_dropped_groups (groups left out of the batch),
    dynamic_kept_groups (groups with signal in the batch; 0 when none had any and the batch is the first
    tasks_per_iteration groups, every advantage 0)."""
    groups = groups_of(tapes)
    in_batch = {g: members for g, members in groups.items() if not any(dropped(t) for t in members)}
    return {
        "dynamic_extra_tasks": max(0, len(groups) - tasks_per_iteration),
        "dynamic_dropped_groups": len(groups) - len(in_batch),
        "dynamic_kept_groups": sum(has_signal(members, train) for members in in_batch.values()),
    }
