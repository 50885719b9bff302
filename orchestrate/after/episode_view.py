"""A tape seen as the episode it records, for the commands that show tapes (browse in a web page, show in a
terminal): the environment's observations and the agent's actions turn by turn, each turn with its reward and
the return and advantage the learner trained it with (read from the learner's advantages file of that
iteration, never recomputed here), and the note that says whether and why not a tape was trained on."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from orchestrate.loop.dynamic_sampling import DROPPED_BY
from orchestrate.loop.forks import DIVERGED
from orchestrate.loop.samples import tape_of_sample
from tapes.tape import EnvAction, EnvObservation, Tape, ToolCallAction

TAPE_FILE = re.compile(r"^(iter|eval)_(\d+)\.jsonl$")


INFRA_FAILURE = "infrastructure failure: not trained on"
DYNAMIC_DROP = "not trained on (dynamic sampling dropped its group: every attempt earned the same return)"
FORK_DIVERGED = "not trained on (a fork that did not come back to its branch point)"


def learner_turns(advantages: dict[str, list[dict]], tape_id: str) -> list[dict] | None:
    """The learner's turns ({index, reward, return, advantage}) for one episode, in turn order, from an
    advantages file read with `read_advantages`; None if the episode is not in it. An episode cut into
    several samples (re-rendered prompts, or one per role) has them all (orchestrate.loop.samples.sample_id)."""
    if tape_id in advantages:
        return sorted(advantages[tape_id], key=lambda t: t.get("index", 0))
    parts = [turns for sample, turns in advantages.items() if tape_of_sample(sample) == tape_id]
    if not parts:
        return None
    return sorted((t for turns in parts for t in turns), key=lambda t: t.get("index", 0))


def trained_turns(
    kind: str,
    error: Any,
    tape_id: str,
    advantages: dict[str, list[dict]] | None,
    source: str = "the advantages file",
    dropped: Any = None,
) -> tuple[list[dict] | None, str]:
    """(the learner's turns or None, a note saying whether and why not the tape was trained on).

    `advantages` is the iteration's advantages file (None: not written); `source` names it in the note;
    `dropped` the tape's metadata.dropped (set by dynamic sampling on the tapes left out of the batch)."""
    if dropped == DIVERGED:
        return None, FORK_DIVERGED
    if error:
        return None, INFRA_FAILURE
    if dropped == DROPPED_BY:
        return None, DYNAMIC_DROP
    if kind != "rollout":
        return None, "not trained on (evaluation)"
    if advantages is None:
        return None, f"not trained on (no {source}: iteration not trained yet)"
    turns = learner_turns(advantages, tape_id)
    if turns is None:
        return None, f"not trained on (not in {source})"
    return turns, "trained"


def tree_rows(members: list[dict]) -> list[dict]:
    """A group's tapes (summaries with `id`, `parent_id`, `branch_at`, `index`) in tree order: each root, then
    its forks below it (by branch point, then position), depth first, each with its `depth` (0: a root; a
    tape whose parent is not in the group counts as a root). A group without forks keeps its order."""
    ids = {m["id"] for m in members}
    children: dict[str | None, list[dict]] = {}
    for m in members:
        parent = m.get("parent_id") if m.get("parent_id") in ids else None
        children.setdefault(parent, []).append(m)
    rows: list[dict] = []

    def visit(m: dict, depth: int) -> None:
        rows.append({**m, "depth": depth})
        for child in sorted(children.get(m["id"], []), key=lambda c: (c.get("branch_at") or 0, c["index"])):
            visit(child, depth + 1)

    for root in children.get(None, []):
        visit(root, 0)
    return rows


def episode_view(tape: Tape, learned: list[dict] | None) -> dict:
    """The episode as a conversation: the environment's first observation, then per turn the agent's action
    (its LLM call's index in tape.llm_calls), the environment's answer with the turn's reward and end flags,
    and the learner's reward, return and advantage for the turn (`learned`, None if not trained on)."""
    first, turns = _read_steps(tape)
    _add_unreferenced_calls(tape, turns)
    ordered = [turns[n] for n in sorted(turns)]
    _add_learner(ordered, learned)
    return {"first_observation": first, "turns": ordered, "end": _episode_end(tape, ordered)}


def _turn_of(turns: dict[int, dict], number: int) -> dict:
    """Turn `number` of the conversation, empty until its steps are read."""
    if number not in turns:
        turns[number] = {"turn": number, "call": None, "action": None, "steps": [], "reward": None,
                         "observation": None, "info": {}, "terminated": False, "truncated": False,
                         "format_error": False, "learner": None, "tool": None, "tool_call": None}  # fmt: skip
    return turns[number]


def _read_steps(tape: Tape) -> tuple[dict | None, dict[int, dict]]:
    """The first observation and the turns by number, from the tape's steps in order."""
    call_index = {call.id: i for i, call in enumerate(tape.llm_calls)}
    first: dict | None = None
    turns: dict[int, dict] = {}
    for step in tape.steps:
        if isinstance(step, EnvObservation) and step.turn == 0 and first is None:
            first = {"text": step.text, "info": step.info}
        elif isinstance(step, EnvObservation):  # a tool's result included
            t = _turn_of(turns, max(1, step.turn))
            t.update(observation=step.text, reward=step.reward, info=step.info, terminated=step.terminated,
                     truncated=step.truncated, format_error=bool(step.info.get("format_error")))  # fmt: skip
        elif isinstance(step, EnvAction):
            t = _turn_of(turns, step.turn)
            t["action"] = step.text
            t["call"] = call_index.get(step.metadata.prompt_id)
            if isinstance(step, ToolCallAction):  # the turn called a tool: which, and with what
                t["tool"], t["tool_call"] = step.tool, step.call
        else:
            first = _other_step(tape, step, turns, first, call_index.get(step.metadata.prompt_id))
    return first, turns


def _other_step(tape: Tape, step, turns: dict[int, dict], first: dict | None, i: int | None) -> dict | None:
    """A custom step: shown within the turn of the call `i` that made it (before any turn: with the first
    observation, which it returns)."""
    number = tape.llm_calls[i].turn if i is not None else max(turns, default=0)
    if not number:
        first = first or {"text": "", "info": {}}
        first.setdefault("steps", []).append(step.model_dump(exclude={"metadata"}))
        return first
    t = _turn_of(turns, number)
    t["steps"].append(step.model_dump(exclude={"metadata"}))
    if t["call"] is None and i is not None:
        t["call"] = i
    return first


def _add_unreferenced_calls(tape: Tape, turns: dict[int, dict]) -> None:
    """A call no step points at still shows, in its turn."""
    for i, call in enumerate(tape.llm_calls):
        if i not in {t["call"] for t in turns.values()}:
            t = _turn_of(turns, call.turn)
            if t["call"] is None:
                t["call"] = i


def _add_learner(ordered: list[dict], learned: list[dict] | None) -> None:
    """The learner's reward, return and advantage (and PPO's value) on the turns it trained."""
    by_index = {c.get("index"): c for c in learned or []}
    for t in ordered:
        c = by_index.get(t["turn"] - 1)
        if c is not None:
            t["learner"] = {k: c.get(k) for k in ("reward", "return", "advantage")}
            if "value" in c:  # PPO's critic before the turn's first token
                t["learner"]["value"] = c["value"]


def _episode_end(tape: Tape, ordered: list[dict]) -> dict:
    m, last = tape.metadata, ordered[-1] if ordered else {}
    return {
        "terminated": bool(m.terminated or last.get("terminated")),
        "truncated": bool(m.truncated or last.get("truncated")),
        "reason": str((last.get("info") or {}).get("reason") or m.reward_reason or ""),
        "success": m.success,
    }


def load_tokenizer(folder: Path):
    """A decoder for token ids from a model folder: `tokenizers` on tokenizer.json (fast to load), else
    transformers; None if the folder has neither."""
    try:
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(folder / "tokenizer.json"))
        if (folder / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(folder)
    except Exception:  # a broken folder: the caller tries the next one, else shows token ids
        return None
    return None
