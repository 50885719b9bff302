"""The algorithms by the names users know: each one registration of a loss, an advantage estimator, an
aggregation and the settings that make it the paper's recipe.

    --train.algorithm grpo | dr_grpo | dapo | gspo | rloo | reinforce_pp | reinforce | ppo

A loss (finetune.losses: grpo, reinforce, gspo, ppo) is how tokens are weighted by their advantages; an
estimator (finetune.estimators: group, batch, none, rloo, reinforce_pp) is how returns become advantages;
an algorithm names a combination of the two and the options its paper sets. Choosing one sets those
options; any of them given too (`--train.algorithm dapo --train.grpo.clip_eps_high 0.3`) is taken as given.
The resolved options are what a run saves (config.json, train_config.json), so a run resumes as it ran.

An algorithm may set options beyond the learner's, applied by the RL loop's config: `rollouts` (DAPO's
dynamic sampling) and `overlong_fraction` (DAPO's soft overlong buffer, a fraction of the sampling limit,
rollouts.max_tokens, which becomes train.overlong_buffer; the learner alone is given the buffer).

Adding one is one `register_algorithm(...)` call; `--help` lists them, bench/compare_algorithms.py runs them
side by side, docs/training.md describes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Algorithm:
    name: str
    loss: str  # a registered loss (finetune.losses.LOSSES): it names the options section, train.LOSS.*
    estimator: str  # a registered advantage estimator (finetune.estimators.ESTIMATORS); ppo: saved, not trained with
    aggregation: str  # "token": one mean over a step's tokens; "sequence": the mean of each sequence's mean
    paper: str
    doc: str
    train: dict[str, Any] = field(default_factory=dict)  # more train options, dotted within train
    rollouts: dict[str, Any] = field(default_factory=dict)  # rollouts options (applied by the RL loop)
    overlong_fraction: float = 0.0  # DAPO's soft overlong buffer, as a fraction of the sampling limit

    def settings(self) -> dict[str, Any]:
        """The train options it sets, dotted within train (`grpo.clip_eps_high`)."""
        return {"loss": self.loss, "estimator": self.estimator, "aggregation": self.aggregation, **self.train}


ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    if algorithm.name in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm.name!r} is registered twice")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def _set_default(data: dict, dotted: str, value: Any) -> None:
    """data[a][b] = value for "a.b" unless given (sections copied, never the caller's changed)."""
    *path, leaf = dotted.split(".")
    for part in path:
        if data.get(part) is None:
            data[part] = {}
        if not isinstance(data[part], dict):
            return  # a section given as an object: taken as given
        data[part] = dict(data[part])
        data = data[part]
    data.setdefault(leaf, value)


def with_algorithm(train: dict) -> dict:
    """Train options with the chosen algorithm's settings filled in where not given (before validation)."""
    algorithm = ALGORITHMS.get(train.get("algorithm", "grpo"))
    if algorithm is None:
        return train  # refused by the config's validation, with the names
    train = dict(train)
    for dotted, value in algorithm.settings().items():
        _set_default(train, dotted, value)
    return train


def listing() -> str:
    return "; ".join(f"{a.name} ({a.doc}, {a.paper})" for a in ALGORITHMS.values())


# GRPO's clipped token ratio with the group baseline (std-normalised), token mean: what verl and TRL run as
# GRPO by default; the paper's own mean of each sequence's token mean is --train.aggregation sequence.
register_algorithm(Algorithm("grpo", "grpo", "group", "token", "arXiv:2402.03300",
                             "clipped ratio, group baseline / std, token mean"))  # fmt: skip
# Dr. GRPO: no std division and no per-sequence length normaliser (one normaliser for a step's tokens).
register_algorithm(Algorithm("dr_grpo", "grpo", "group", "token", "arXiv:2503.20783",
                             "GRPO without the std division", train={"normalize_std": False}))  # fmt: skip
# DAPO: clip-higher 0.28, token mean, overlong shaping (the paper's buffer is 4096 of 20480 tokens: a
# fifth of the limit), dynamic sampling of groups with signal.
register_algorithm(Algorithm(
    "dapo", "grpo", "group", "token", "arXiv:2503.14476",
    "clip-higher, token mean, overlong shaping, dynamic sampling",
    train={"grpo.clip_eps_high": 0.28}, rollouts={"dynamic_sampling": True}, overlong_fraction=0.2,
))  # fmt: skip
# GSPO: the sequence-level ratio, averaged over sequences as the paper does; its clip range is the
# defaults of train.gspo (3e-4 / 4e-4).
register_algorithm(Algorithm("gspo", "gspo", "group", "sequence", "arXiv:2507.18071",
                             "sequence-level ratio and clip"))  # fmt: skip
# RLOO: the leave-one-out baseline, trained with plain REINFORCE (no ratio, no clip).
register_algorithm(Algorithm("rloo", "reinforce", "rloo", "token", "arXiv:2402.14740",
                             "leave-one-out baseline, REINFORCE"))  # fmt: skip
# REINFORCE++: PPO's clipped surrogate with the baseline over the whole batch.
register_algorithm(Algorithm("reinforce_pp", "grpo", "reinforce_pp", "token", "arXiv:2501.03262",
                             "clipped ratio, batch baseline"))  # fmt: skip
# Williams' REINFORCE: log-prob x return, no baseline, no ratio.
register_algorithm(Algorithm("reinforce", "reinforce", "none", "token", "Williams 1992",
                             "log-prob x return, no baseline"))  # fmt: skip
# PPO: a critic (train.ppo.critic) and token-level GAE advantages. Its estimator is saved like every
# algorithm's (the learner reads train.estimator whatever the loss), but the critic's advantages take the
# estimator's place (finetune.critic): another estimator trains PPO the same (tests/test_ppo.py).
register_algorithm(Algorithm("ppo", "ppo", "group", "token", "arXiv:1707.06347", "critic, GAE, clipped ratio"))
