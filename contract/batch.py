"""The training-sample format the learner owns: one JSON object per line.

A batch file holds every sample of one iteration, one per line. A one-turn sample:

    {"prompt_ids": [1, 42, ...], "completion_ids": [7, 8, 2],
     "behaviour_logprobs": [-0.1, -2.3, -0.01], "ref_logprobs": [-0.2, -2.0, -0.02],
     "reward": 1.0, "group_id": "task-17", "temperature": 0.7}

A multi-turn episode is one sample too: `prompt_ids` is the first turn's
prompt, `completion_ids` everything after it (the model's outputs and, between
them, the environment's tokens), and `turns` says where each sampled output
lies in `completion_ids` and what its turn earned:

    {"prompt_ids": [...], "completion_ids": [7, 2, 198, 1, 55, 198, 9, 2],
     "turns": [{"index": 0, "start": 0, "length": 2, "reward": 0.0},
               {"index": 1, "start": 6, "length": 2, "reward": 1.0}],
     "behaviour_logprobs": [-0.1, -0.2, -0.3, -0.05], "reward": 1.0, "group_id": "3:train:17", ...}

Only tokens inside turns are trained on; the log-prob lists hold one value per
such token, in order. An episode whose prompts were re-rendered (a call that
does not extend the previous one) is cut into several samples that share an
`episode_id`; their turns' `index` numbers the turns of the whole episode.

A fork of a tree rollout starts as its parent episode does: its samples hold
the turns it replayed from its parent as context only (the parent's samples
train them) and name its place in the tree, `branch`: the parent's episode id,
the first turn it played itself and the rewards of the turns before it, so
its returns run over the whole episode.

Advantages are not stored: the learner computes them from the rewards (per
turn returns with a discount, then a group or batch baseline), so a batch file
is exactly what the policy did and what it earned; the learner writes the
advantages it used beside its checkpoints. The orchestrator writes these files with
`write_batch` (atomically, through contract.durable: a reader sees the whole file
or no file). Both sides import this module; it imports nothing but Pydantic and
contract.durable (the standard library only).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from contract.durable import atomic_write_text

BATCH_NAME = re.compile(r"^(\d+)\.jsonl$")
Finite = Annotated[float, Field(allow_inf_nan=False)]


class Turn(BaseModel):
    """One sampled output of an episode, inside a sample's completion_ids."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0, description="The turn's number in its episode, from 0.")
    start: int = Field(ge=0, description="Where the output starts in completion_ids.")
    length: int = Field(ge=1, description="Sampled tokens of the output.")
    reward: Finite = Field(description="Reward the environment gave this turn's action.")
    truncated: bool | None = Field(
        default=None,
        description="The output was cut by the sampling limit (its finish reason 'length'); none: not recorded.",
    )
    max_tokens: int | None = Field(
        default=None, ge=1, description="The sampling limit of the call (what overlong shaping measures against)."
    )


class Branch(BaseModel):
    """Where a fork's episode leaves its parent's (a tree rollout, orchestrate.loop.trees): the turns before
    `turn` were replayed from the parent, which trains them; this episode's samples hold them as context only."""

    model_config = ConfigDict(extra="forbid")

    parent_id: str = Field(description="The parent episode's id (its samples' episode_id).")
    turn: int = Field(ge=1, description="The first turn this episode played itself (turn index, from 0).")
    prefix_rewards: list[Finite] = Field(
        description="The rewards of turns 0 .. turn - 1 (the parent's): the episode's returns start there."
    )

    @model_validator(mode="after")
    def _one_reward_per_replayed_turn(self) -> Branch:
        if len(self.prefix_rewards) != self.turn:
            raise ValueError(f"prefix_rewards has {len(self.prefix_rewards)} values for {self.turn} replayed turns")
        return self


class Sample(BaseModel):
    """One completion of one prompt, with what the learner needs to train on it."""

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[int] = Field(
        min_length=1, description="Token ids the policy was conditioned on (whole chat prompt)."
    )
    completion_ids: list[int] = Field(
        min_length=1,
        description="Token ids after the prompt: what the policy sampled (trained on) and, in a "
        "multi-turn episode, the environment's tokens between its outputs (not trained on).",
    )
    behaviour_logprobs: list[Finite] = Field(
        description="Log-prob of each completion token under the policy that sampled it, of the "
        "distribution sampled from: softmax(logits / temperature). vLLM reports these with "
        "`--logprobs-mode processed_logprobs` (its default, raw_logprobs, ignores the temperature). "
        "Sample with top_p = 1 and no top_k: the learner re-computes only the temperature."
    )
    ref_logprobs: list[Finite] | None = Field(
        default=None,
        description="Log-prob of each completion token under the reference model at temperature 1; "
        "null when no KL penalty is used.",
    )
    teacher_logprobs: list[Finite] | None = Field(
        default=None,
        description="Log-prob of each completion token under the teacher at temperature 1 (on-policy "
        "distillation, teacher_coef); null without a teacher.",
    )
    teacher_top_ids: list[list[int]] | None = Field(
        default=None,
        description="Per trained token, the teacher's k most likely tokens at its position, most likely "
        "first (the teacher's top-k, teacher_topk_coef); null without them.",
    )
    teacher_top_logprobs: list[list[Finite]] | None = Field(
        default=None, description="Their log-probs under the teacher at temperature 1, row by row."
    )
    reward: Finite = Field(
        description="Reward of the whole completion (of a multi-turn sample: the sum of its turns')."
    )
    turns: list[Turn] | None = Field(
        default=None,
        description="The sampled outputs inside completion_ids, in order; none: one turn that is the "
        "whole completion and earned `reward`.",
    )
    episode_id: str | None = Field(
        default=None,
        description="Samples of one episode share it (an episode cut where a prompt was "
        "re-rendered); none: the sample is an episode of its own.",
    )
    group_id: str | int = Field(
        description="Samples sharing a group id are attempts at the same prompt; "
        "advantages are normalised within the group."
    )
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature the completion was drawn at.")
    sample_id: str | None = Field(default=None, description="Optional: where the sample came from (e.g. a tape id).")
    policy_version: int | None = Field(
        default=None,
        ge=0,
        description="Optional: the policy version (checkpoint number; 0 = initial) that "
        "generated it, the oldest of its calls'. Its lag in the learner: `lag` below.",
    )
    version_changes: list[tuple[int, int]] | None = Field(
        default=None,
        description="Optional: where newer weights took over, as (index among the sampled tokens, in "
        "behaviour_logprobs' order; the version that sampled it and those after it), in order: a later "
        "turn's call served by a newer version, or new weights swapped in under a call in flight "
        "(--run.in_flight_swaps). None or empty: every sampled token is policy_version's.",
    )

    branch: Branch | None = Field(
        default=None,
        description="Optional: a fork's place in its tree (its parent, the turn it branched at, the replayed "
        "turns' rewards); none: the episode was played from its task.",
    )
    role: str | None = Field(
        default=None,
        min_length=1,
        description="Optional: the role whose calls these are, where several agents act in one episode "
        "(orchestrate's agent.roles). An episode's roles are credited apart: a role's returns run over its own "
        "turns, its advantages are normalised among its group's samples of the same role (`credit_ids`).",
    )

    @model_validator(mode="after")
    def _lengths_match(self) -> Sample:
        if self.turns is not None:
            if not self.turns:
                raise ValueError("turns is empty; leave it out for a one-turn sample")
            end = 0
            for turn in self.turns:
                if turn.start < end:
                    raise ValueError(f"turn {turn.index} starts at {turn.start}, inside the previous turn or before it")
                end = turn.start + turn.length
            if end > len(self.completion_ids):
                raise ValueError(f"turns reach token {end} of {len(self.completion_ids)} completion tokens")
        if self.branch is not None and self.role is not None:
            raise ValueError("a fork's samples carry no role: trees of episodes with several roles are not served")
        if self.branch is not None and any(t.index < self.branch.turn for t in self.all_turns):
            raise ValueError(f"a turn before the branch point (turn {self.branch.turn}) is the parent's to train")
        n = self.n_trained
        if len(self.behaviour_logprobs) != n:
            raise ValueError(f"behaviour_logprobs has {len(self.behaviour_logprobs)} values for {n} sampled tokens")
        if self.ref_logprobs is not None and len(self.ref_logprobs) != n:
            raise ValueError(f"ref_logprobs has {len(self.ref_logprobs)} values for {n} sampled tokens")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise ValueError(f"teacher_logprobs has {len(self.teacher_logprobs)} values for {n} sampled tokens")
        ids, lps = self.teacher_top_ids, self.teacher_top_logprobs
        if (ids is None) != (lps is None):
            raise ValueError("teacher_top_ids and teacher_top_logprobs come together")
        if ids is not None:
            if len(ids) != n or len(lps) != n:
                raise ValueError(f"the teacher's top-k has {len(ids)} and {len(lps)} rows for {n} sampled tokens")
            k = len(ids[0]) if ids else 0
            if not k or any(len(row) != k for row in ids) or any(len(row) != k for row in lps):
                raise ValueError(f"the teacher's top-k rows differ in length (the first has {k}); each holds k > 0")
        return self

    @property
    def all_turns(self) -> list[Turn]:
        """The turns, a one-turn sample's included."""
        if self.turns is not None:
            return self.turns
        return [Turn(index=0, start=0, length=len(self.completion_ids), reward=self.reward)]

    @property
    def n_trained(self) -> int:
        """Tokens trained on: those inside turns."""
        return len(self.completion_ids) if self.turns is None else sum(t.length for t in self.turns)

    def token_versions(self) -> list[int | None]:
        """The policy version that sampled each trained token (None: unknown)."""
        versions, version, changes = [], self.policy_version, iter(self.version_changes or [])
        change = next(changes, None)
        for i in range(self.n_trained):
            while change is not None and change[0] <= i:
                version, change = change[1], next(changes, None)
            versions.append(version)
        return versions

    def trained_positions(self) -> list[int]:
        """Positions in completion_ids of the tokens trained on, in order."""
        if self.turns is None:
            return list(range(len(self.completion_ids)))
        return [t.start + k for t in self.turns for k in range(t.length)]


def credit_ids(samples: list[Sample]) -> tuple[list[str], list[str | int]]:
    """Each sample's (episode, group) as credit is assigned: its episode id (a sample of its own: `#i`) and group
    id, each of a sample with a role joined with that role, so an episode's roles have their own returns and
    their own groups."""
    episodes: list[str] = []
    groups: list[str | int] = []
    for i, sample in enumerate(samples):
        episode = sample.episode_id or f"#{i}"
        role = sample.role
        episodes.append(episode if role is None else f"{episode}/{role}")
        groups.append(sample.group_id if role is None else f"{sample.group_id}/{role}")
    return episodes, groups


def lag(batch_index: int, version: int) -> int:
    """How many versions behind the weights that train it a token of `version` is: batch b trains version
    b - 1 (the policy after b - 1 updates) into version b."""
    return batch_index - 1 - version


class BatchFormatError(ValueError):
    """A batch file that cannot be trained on; the message names the file and line."""


def read_batch(path: str | os.PathLike) -> list[Sample]:
    """Read a batch file; any bad line raises BatchFormatError naming file and line."""
    path = Path(path)
    samples = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                samples.append(Sample.model_validate_json(line))
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"]) or "sample"
                raise BatchFormatError(f"{path}:{lineno}: {where}: {err['msg']}") from None
    if not samples:
        raise BatchFormatError(f"{path}: no samples; a batch file holds one JSON sample per line")
    return samples


def write_batch(path: str | os.PathLike, samples: Iterable[Sample | dict]) -> Path:
    """Write samples atomically: a temp file in the same folder, fsync, rename.

    Dicts are validated as Samples first, so a bad sample fails here, in the
    writer, rather than later in the learner.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [(s if isinstance(s, Sample) else Sample.model_validate(s)).model_dump_json() for s in samples]
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def batch_file(batches_dir: str | os.PathLike, index: int) -> Path:
    """The name the learner looks for: batches/000003.jsonl for batch 3."""
    return Path(batches_dir) / f"{index:06d}.jsonl"


def list_batches(batches_dir: str | os.PathLike) -> dict[int, Path]:
    """Complete batch files in a folder, by number (temp files are ignored)."""
    folder = Path(batches_dir)
    if not folder.is_dir():
        return {}
    found = {}
    for entry in folder.iterdir():
        m = BATCH_NAME.match(entry.name)
        if m:
            found[int(m.group(1))] = entry
    return dict(sorted(found.items()))
