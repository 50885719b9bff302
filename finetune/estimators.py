"""Advantage estimators: from the rewards of a batch's turns to one advantage per turn.

The learner first turns each episode's per-turn rewards into returns (discount gamma:
G_t = r_t + gamma G_{t+1}), then the chosen estimator (`--train.estimator NAME`, set by `--train.algorithm`) turns the returns
into advantages; the loss (finetune.losses, `--train.loss`) then trains on them, so any
estimator combines with any loss (PPO's critic excepted: its advantages are GAE on the critic's
values, finetune.critic.gae).

An estimator is a function `(Episodes) -> {episode: {turn index: advantage}}` registered with
`register_estimator(name, needs=..., paper=..., group_relative=...)`. `needs` names the columns it
reads beyond the returns (as PipelineRL's estimators declare theirs): `group` (the group ids: it
compares attempts at the same prompt), `tokens` (each turn's count of trained tokens) and `tree` (each
fork's parent episode and branch turn, from tree rollouts: orchestrate.loop.trees). A fork's returns run
over its whole episode: the turns it replayed from its parent (their rewards come with its samples,
contract.batch.Branch; its parent trains them) and its own, so its G_0 is the whole episode's.
`group_relative` declares that an episode's advantage depends on its own group's returns only and
is 0 when they are all equal: such groups can be dropped before training without changing anything
(DAPO's dynamic sampling, `--rollouts.dynamic_sampling`, is offered with these estimators only).
The config's `--help` lists every registered name with its one-line description and paper.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from finetune.lazy import lazy_import

if TYPE_CHECKING:
    import torch
    from torch import Tensor
else:
    torch = lazy_import("torch")  # the config reads the registry below; torch loads when an estimator runs

Column = str  # "group", "tokens" or "tree"
COLUMNS = ("group", "tokens", "tree")


@dataclass
class Episodes:
    """What an estimator gets: per episode (by id), its turns' returns and the columns it asked for."""

    returns: dict[str, dict[int, float]]  # episode -> turn index -> G_t
    group: dict[str, str | int]  # episode -> its group id
    tokens: dict[str, dict[int, int]] | None  # episode -> turn index -> trained tokens (None unless needed)
    normalize_std: bool  # divide by the std (false: Dr. GRPO's mean-only baseline)
    eps: float  # added to the std before dividing
    tree: dict[str, tuple[str, int]] | None = None  # a fork -> (its parent, the first turn it played itself)
    own: dict[str, set[int]] | None = None  # episode -> the turns its samples train (a fork's replayed ones are not)

    def trained(self) -> list[tuple[str, int]]:
        """(episode, turn) of every turn the batch trains, in order: a fork's replayed turns are its parent's
        (counted there once), so statistics over turns leave them out."""
        return [(e, t) for e, r in self.returns.items() for t in r if self.own is None or t in self.own.get(e, ())]

    def per_turn(self, keys: list[tuple[str, int]], values: list[float]) -> dict[str, dict[int, float]]:
        """Advantages of the given turns; every other turn (a fork's replayed ones) gets 0."""
        out: dict[str, dict[int, float]] = {e: {t: 0.0 for t in r} for e, r in self.returns.items()}
        for (e, t), a in zip(keys, values):
            out[e][t] = a
        return out

    def first(self) -> dict[str, float]:
        """Each episode's score: its return from the first turn, G_0 (0 for an episode with no turns)."""
        return {e: (r[min(r)] if r else 0.0) for e, r in self.returns.items()}

    def every_turn(self, per_episode: dict[str, float]) -> dict[str, dict[int, float]]:
        """One value per episode given to each of its turns."""
        return {e: {t: per_episode[e] for t in r} for e, r in self.returns.items()}


@dataclass(frozen=True)
class EstimatorSpec:
    name: str
    fn: Callable[[Episodes], dict[str, dict[int, float]]]
    needs: tuple[Column, ...]
    paper: str  # where it comes from: an arXiv id, or a reference when there is none
    doc: str  # the first line of the function's docstring, for --help
    group_relative: bool = False  # advantages from the own group's returns only, 0 when they are all equal


ESTIMATORS: dict[str, EstimatorSpec] = {}


def register_estimator(name: str, needs: Sequence[Column] = (), paper: str = "", group_relative: bool = False):
    """Register `fn(episodes) -> {episode: {turn index: advantage}}` as `--train.estimator NAME`;
    `group_relative`: the advantages of a group whose returns G_0 are all equal are all 0."""

    def wrap(fn):
        if name in ESTIMATORS:
            raise ValueError(f"estimator {name!r} is registered twice")
        unknown = set(needs) - set(COLUMNS)
        if unknown:
            raise ValueError(f"estimator {name!r} needs unknown columns {sorted(unknown)}: one of {COLUMNS}")
        if group_relative and "group" not in needs:
            raise ValueError(f"estimator {name!r} is group_relative: it needs the column 'group'")
        doc = (fn.__doc__ or "").strip().splitlines()[0]
        ESTIMATORS[name] = EstimatorSpec(name, fn, tuple(needs), paper, doc, group_relative)
        return fn

    return wrap


# ---- the shared arithmetic --------------------------------------------------------------------


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """G_t = r_t + gamma * G_{t+1} for each turn t of one episode (G after the last turn is 0: a truncated
    episode is not bootstrapped)."""
    out, g = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        g = float(rewards[t]) + gamma * g
        out[t] = g
    return out


def group_advantages(rewards: Tensor, group_ids: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """(reward - group mean) / (group std + eps), one value per sample.

    The std is the sample std (n - 1 in the denominator, as in DeepSeek's and
    TRL's GRPO). `normalize_std=False` keeps only the mean baseline
    (Dr. GRPO). A group whose rewards are all equal (a single sample
    included) gets advantage exactly 0, so it contributes no policy gradient.
    """
    rewards = rewards.double()  # group means of floats are exact enough in fp64
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, rewards) / count
    centered = rewards - mean[group]
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group, centered**2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    adv = centered / (std[group] + eps) if normalize_std else centered
    lo = torch.full((n_groups,), float("inf"), dtype=torch.float64).scatter_reduce(0, group, rewards, "amin")
    hi = torch.full((n_groups,), float("-inf"), dtype=torch.float64).scatter_reduce(0, group, rewards, "amax")
    constant = (lo == hi)[group]
    return torch.where(constant, torch.zeros_like(adv), adv).float()


def _group_index(x: Episodes) -> Tensor:
    index: dict[str | int, int] = {}
    return torch.tensor([index.setdefault(x.group[e], len(index)) for e in x.returns])


def _whiten(values: Tensor, counts: Tensor, normalize_std: bool, eps: float) -> Tensor:
    """(v - mean) / (std + eps) with each value counted `counts` times; all 0 when the values are all equal."""
    if len(values) == 0 or float(values.max() - values.min()) == 0.0:
        return torch.zeros_like(values)
    n = counts.sum()
    mean = (values * counts).sum() / n
    std = ((((values - mean) ** 2) * counts).sum() / (n - 1).clamp(min=1)).sqrt()
    return (values - mean) / (std + eps) if normalize_std else values - mean


# ---- the estimators ---------------------------------------------------------------------------


@register_estimator(
    "group",
    needs=("group",),
    paper="arXiv:2402.03300 (GRPO); mean only: arXiv:2503.20783 (Dr. GRPO)",
    group_relative=True,
)
def group_baseline(x: Episodes) -> dict[str, dict[int, float]]:
    """GRPO: an episode's return G_0 minus its group's mean, over the group's std, the same for all its turns."""
    # one member per episode however many turns it has; normalize_std false: Dr. GRPO
    first = x.first()
    adv = group_advantages(
        torch.tensor([first[e] for e in x.returns], dtype=torch.float64), _group_index(x), x.normalize_std, x.eps
    ).double()
    return x.every_turn(dict(zip(x.returns, adv.tolist())))


@register_estimator("batch", paper="arXiv:2510.01051 (GEM's ReBN)")
def batch_baseline(x: Episodes) -> dict[str, dict[int, float]]:
    """ReBN: each turn's return G_t normalised over all turns of the batch (per-turn rewards, gamma < 1)."""
    keys = x.trained()
    flat = torch.tensor([x.returns[e][t] for e, t in keys], dtype=torch.float64)
    return x.per_turn(keys, _whiten(flat, torch.ones_like(flat), x.normalize_std, x.eps).tolist())


@register_estimator("none", paper="Williams 1992 (REINFORCE)")
def no_baseline(x: Episodes) -> dict[str, dict[int, float]]:
    """The returns themselves (with reinforce on reward-filtered samples: rejection-sampling fine-tuning)."""
    return {e: dict(r) for e, r in x.returns.items()}


@register_estimator("zero", paper="arXiv:2306.13649 (GKD); on-policy distillation")
def zero(x: Episodes) -> dict[str, dict[int, float]]:
    """No reward advantage (0 on every turn): pure on-policy distillation, the teacher's term (teacher_coef) alone."""
    return {e: {t: 0.0 for t in r} for e, r in x.returns.items()}


@register_estimator("rloo", needs=("group",), paper="arXiv:2402.14740 (RLOO)", group_relative=True)
def leave_one_out(x: Episodes) -> dict[str, dict[int, float]]:
    """RLOO: an episode's G_0 minus the mean of the other episodes of its group (no std; a lone episode: 0)."""
    # A_i = r_i - (sum - r_i) / (n - 1) = n / (n - 1) * (r_i - mean); normalize_std does not apply
    first = x.first()
    sums: dict[str | int, float] = {}
    counts: dict[str | int, int] = {}
    for e, g in first.items():
        sums[x.group[e]] = sums.get(x.group[e], 0.0) + g
        counts[x.group[e]] = counts.get(x.group[e], 0) + 1
    adv = {}
    for e, g in first.items():
        n = counts[x.group[e]]
        adv[e] = 0.0 if n < 2 else g - (sums[x.group[e]] - g) / (n - 1)
    return x.every_turn(adv)


@register_estimator("reinforce_pp", needs=("tokens",), paper="arXiv:2501.03262 (REINFORCE++)")
def reinforce_pp(x: Episodes) -> dict[str, dict[int, float]]:
    """REINFORCE++: each turn's return against the whole batch's, mean and std taken over all trained tokens."""
    # global batch normalisation over tokens (a turn of 10 tokens counts 10 times), not over turns as in batch
    assert x.tokens is not None
    keys = x.trained()
    flat = torch.tensor([x.returns[e][t] for e, t in keys], dtype=torch.float64)
    counts = torch.tensor([x.tokens[e][t] for e, t in keys], dtype=torch.float64)
    return x.per_turn(keys, _whiten(flat, counts, x.normalize_std, x.eps).tolist())


@register_estimator(
    "tree", needs=("group", "tree"),
    paper="arXiv:2509.21240 (Tree-GRPO); prefix credit as the subtree's mean: arXiv:2508.17445 (TreePO)",
)  # fmt: skip
def tree_baseline(x: Episodes) -> dict[str, dict[int, float]]:
    """Trees: each segment's mean return over the episodes below it minus that over its branch point's."""
    # A segment is a run of an episode's turns between branch points: from its start (0, or a fork's first
    # own turn) or a turn where one of its forks branched off, to the next such turn. The episodes "below"
    # turn t of episode e are e and its forks (with their own forks) that branched after t: they share
    # turns 0..t. A segment starting at turn b gets mean(G_b over the episodes below its turn b) minus
    # mean(G_b over the episodes below turn b - 1 of the episode that played it: its siblings at the branch
    # point and itself); a root's first segment against every episode of its group (the task). Summed along
    # a path they telescope to G_0 - the task's mean: without forks this is GRPO. Over the std of the
    # group's G_0 with normalize_std; a group whose G_0 are all equal gets 0.
    tree = {e: link for e, link in (x.tree or {}).items() if e in x.returns and link[0] in x.returns}
    children: dict[str, list[tuple[str, int]]] = {}
    for e, (parent, turn) in tree.items():
        children.setdefault(parent, []).append((e, turn))

    def below_all(e: str) -> list[str]:
        return [e] + [d for f, _ in children.get(e, []) for d in below_all(f)]

    def below(e: str, t: int) -> list[str]:
        return [e] + [d for f, k in children.get(e, []) if k > t for d in below_all(f)]

    def g(e: str, t: int) -> float:  # an episode that ended before turn t earns nothing from it
        return x.returns[e].get(t, 0.0)

    def mean_g(episodes: list[str], t: int) -> float:
        return sum(g(e, t) for e in episodes) / len(episodes)

    groups: dict[str | int, list[str]] = {}
    for e in x.returns:
        groups.setdefault(x.group[e], []).append(e)
    first = x.first()
    out: dict[str, dict[int, float]] = {}
    for members in groups.values():
        scores = torch.tensor([first[e] for e in members], dtype=torch.float64)
        flat = len(members) < 2 or float(scores.max() - scores.min()) == 0.0
        std = float(scores.std()) if len(members) > 1 else 0.0
        scale = 1.0 / (std + x.eps) if x.normalize_std else 1.0
        for e in members:
            parent, start = tree.get(e, (None, min(x.returns[e], default=0)))
            cuts = sorted({start, *(k for _, k in children.get(e, []) if k > start)})
            out[e] = {}
            for b, end in zip(cuts, cuts[1:] + [None]):
                if flat:
                    a = 0.0
                else:
                    if b > start:
                        siblings = below(e, b - 1)
                    elif parent is not None:
                        siblings = below(parent, b - 1)
                    else:
                        siblings = members
                    a = (mean_g(below(e, b), b) - mean_g(siblings, b)) * scale
                for t in x.returns[e]:
                    if t >= b and (end is None or t < end):
                        out[e][t] = a
            for t in x.returns[e]:  # the replayed turns before its start: its parent's, not trained here
                out[e].setdefault(t, 0.0)
    return out


# ---- from samples' turns to advantages --------------------------------------------------------


def episode_returns(
    turns: Sequence[Sequence[tuple[int, float]]],
    episode_ids: Sequence[str],
    gamma: float = 1.0,
    branches: Sequence | None = None,
) -> dict[str, dict[int, float]]:
    """Each episode's returns by turn index, G_t, from its samples' turns ((index in the episode, reward)):
    samples sharing an episode id are parts of one episode, its returns run over all of its turns, a fork's
    (`branches[i]`: a contract.batch.Branch or its dict) over the turns it replayed too. An estimator's score
    of an episode is its G_0 (Episodes.first)."""
    episodes: dict[str, dict[int, float]] = {}
    forks: dict[str, tuple[str, int, list[float]]] = {}
    for i, (sample_turns, episode) in enumerate(zip(turns, episode_ids)):
        rewards = episodes.setdefault(episode, {})
        for index, reward in sample_turns:
            rewards[index] = float(reward)
        branch = _branch(branches[i]) if branches is not None else None
        if branch is not None:
            forks[episode] = branch

    def fill(episode: str) -> None:
        """A fork's replayed turns: its parent's rewards when the parent is in the batch (shaped, as the
        parent's own turns are), else those its Branch recorded."""
        parent, turn, prefix = forks.pop(episode)
        if parent in forks:
            fill(parent)
        given = episodes.get(parent, {})
        for index in range(turn):
            if index in given:
                episodes[episode].setdefault(index, given[index])
            elif index < len(prefix):
                episodes[episode].setdefault(index, float(prefix[index]))

    while forks:
        fill(next(iter(forks)))
    returns_of: dict[str, dict[int, float]] = {}
    for episode, rewards in episodes.items():
        order = sorted(rewards)
        returns_of[episode] = dict(zip(order, discounted_returns([rewards[t] for t in order], gamma)))
    return returns_of


def _branch(branch) -> tuple[str, int, list[float]] | None:
    """(parent, first own turn, replayed turns' rewards) of a Branch or its dict; none for none."""
    if branch is None:
        return None
    if isinstance(branch, dict):
        return branch["parent_id"], int(branch["turn"]), list(branch["prefix_rewards"])
    return branch.parent_id, branch.turn, list(branch.prefix_rewards)


def turn_advantages(
    turns: Sequence[Sequence[tuple[int, float]]],
    episode_ids: Sequence[str],
    group_ids: Sequence[str | int],
    baseline: str,
    gamma: float = 1.0,
    normalize_std: bool = True,
    eps: float = 1e-6,
    lengths: Sequence[Sequence[int]] | None = None,
    branches: Sequence | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """Per-turn returns and advantages of every sample: (returns, advantages), each a list per sample
    holding one value per turn of that sample.

    `turns[i]` lists sample i's turns as (index in the episode, reward); `lengths[i]` their trained tokens
    (needed by estimators that declare `tokens`); `branches[i]` its fork's place in a tree (None: played
    from its task). Samples sharing an episode id are parts of one episode: its returns run over all of its
    turns. `baseline` names the estimator (ESTIMATORS).
    """
    if baseline not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {baseline!r}: one of {', '.join(ESTIMATORS)}")
    spec = ESTIMATORS[baseline]
    if "tokens" in spec.needs and lengths is None:
        raise ValueError(f"estimator {baseline!r} needs the turns' token counts (lengths)")
    group: dict[str, str | int] = {}
    tokens: dict[str, dict[int, int]] = {}
    for i, (sample_turns, episode, g) in enumerate(zip(turns, episode_ids, group_ids)):
        group.setdefault(episode, g)
        for k, (index, _) in enumerate(sample_turns):
            if lengths is not None:
                tokens.setdefault(episode, {})[index] = int(lengths[i][k])
    returns_of = episode_returns(turns, episode_ids, gamma, branches)
    tree = {}
    for i, episode in enumerate(episode_ids):
        branch = _branch(branches[i]) if branches is not None else None
        if branch is not None:
            tree[episode] = (branch[0], branch[1])
    own: dict[str, set[int]] = {}
    for sample_turns, episode in zip(turns, episode_ids):
        own.setdefault(episode, set()).update(index for index, _ in sample_turns)
    x = Episodes(returns_of, group, tokens if lengths is not None else None, normalize_std, eps, tree, own)
    adv_of = spec.fn(x)
    returns = [[returns_of[e][index] for index, _ in st] for st, e in zip(turns, episode_ids)]
    advantages = [[float(adv_of[e][index]) for index, _ in st] for st, e in zip(turns, episode_ids)]
    return returns, advantages


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13), scaled by `penalty`: 0 up to
    max_tokens - buffer tokens, then falling linearly to -penalty at max_tokens (and below past it)."""
    if buffer <= 0:
        return 0.0
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * min(1.0, (length - start) / buffer)
