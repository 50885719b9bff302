"""Compare two tapes step by step: is a replayed tape the recorded one?

Step ids are fresh on every run, so they are not compared; everything else
of a step is (its kind, its fields, the node and agent that made it, the
LLM call it came from). Then the reward and its reason.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, Field

from tapes.tape import Step, Tape


class StepDifference(BaseModel):
    index: int = Field(description="0-based position of the step on the tape")
    recorded: dict | None = Field(None, description="the recorded step (None: the replay has an extra step)")
    replayed: dict | None = Field(None, description="the replayed step (None: the replay stopped earlier)")
    fields: list[str] = Field(default_factory=list, description="top-level fields that differ")


class TapeDiff(BaseModel):
    tape_id: str
    steps: list[StepDifference] = Field(default_factory=list)
    reward: tuple[float | None, float | None] | None = None
    reward_reason: tuple[str, str] | None = None
    notes: list[str] = Field(default_factory=list, description="other differences (prompts, errors)")
    how: list[str] = Field(default_factory=list, description="how the replay got its results (tools re-run, ...)")

    @property
    def identical(self) -> bool:
        return not (self.steps or self.reward or self.reward_reason or self.notes)

    def report(self) -> str:
        """Human-readable, one difference per line block, the first differing step first."""
        how = f" ({'; '.join(self.how)})" if self.how else ""
        if self.identical:
            return f"tape {self.tape_id}: identical{how}"
        lines = [f"tape {self.tape_id}: differs{how}"]
        for d in self.steps:
            kind = (d.recorded or d.replayed or {}).get("kind", "?")
            if d.recorded is None:
                lines.append(f"  step {d.index + 1} ({kind}): only in the replay: {_brief(d.replayed)}")
            elif d.replayed is None:
                lines.append(f"  step {d.index + 1} ({kind}): missing from the replay (recorded {_brief(d.recorded)})")
            else:
                lines.append(f"  step {d.index + 1} ({kind}) differs in {', '.join(d.fields)}:")
                lines.append(f"    recorded: {_brief(d.recorded)}")
                lines.append(f"    replayed: {_brief(d.replayed)}")
        if self.reward:
            lines.append(f"  reward: recorded {self.reward[0]}, replayed {self.reward[1]}")
        if self.reward_reason:
            lines.append(f"  reward reason: recorded {self.reward_reason[0]!r}, replayed {self.reward_reason[1]!r}")
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)


def _same(a, b) -> bool:
    """Equal, a NaN equal to a NaN (a NaN reward recorded and replayed is no difference)."""
    return a == b or json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _comparable(step: Step) -> dict:
    data = step.model_dump(mode="json")
    data["metadata"].pop("id", None)
    return data


def _brief(data: dict | None, width: int = 160) -> str:
    if data is None:
        return "-"
    shown = {k: v for k, v in data.items() if k != "metadata"}
    text = repr(shown)
    return text if len(text) <= width else text[: width - 3] + "..."


def diff_tapes(recorded: Tape, replayed: Tape) -> TapeDiff:
    out = TapeDiff(tape_id=recorded.metadata.id)
    n = max(len(recorded.steps), len(replayed.steps))
    for i in range(n):
        a = _comparable(recorded.steps[i]) if i < len(recorded.steps) else None
        b = _comparable(replayed.steps[i]) if i < len(replayed.steps) else None
        if _same(a, b):
            continue
        fields = sorted(k for k in set(a or {}) | set(b or {}) if not _same((a or {}).get(k), (b or {}).get(k)))
        out.steps.append(StepDifference(index=i, recorded=a, replayed=b, fields=fields))
    if not _same(recorded.metadata.reward, replayed.metadata.reward):
        out.reward = (recorded.metadata.reward, replayed.metadata.reward)
    if recorded.metadata.reward_reason != replayed.metadata.reward_reason:
        out.reward_reason = (recorded.metadata.reward_reason, replayed.metadata.reward_reason)
    if recorded.metadata.error != replayed.metadata.error:
        out.notes.append(f"agent error: recorded {recorded.metadata.error!r}, replayed {replayed.metadata.error!r}")
    return out
