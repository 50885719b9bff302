"""Tapes written before episodes, read as episodes: the one upgrade step of the tape format.

Until environments and multi-turn episodes came (2026-11-22), the math agent wrote a `task` step (the
question and its data), then from its one LLM call either a `reasoning_thought` and a
`final_answer_action` (the text before the last \\boxed{} and the box's content) or a `parse_failure`
(no box: the error and the raw output); the tape's reward was on its metadata only. Those kinds are no
longer classes: `Tape.model_validate` passes every tape dict through `upgrade` first, which rewrites them
as the steps an episode has today, so the browser, `show`, metrics and offline training read one shape:

- `task` -> `env_observation` of turn 0 (the question as text, its data as info);
- the steps of one LLM call -> one `env_action` of the next turn, whose text is the call's whole output
  (the steps' own fields are kept, whole, in the action's `metadata.other["legacy_steps"]`), answered by
  an `env_observation` that carries the tape's reward on the last turn (0 before it), the reward's reason,
  `format_error` for a `parse_failure`, and `terminated` (the old agent stopped after its answer).

A tape is written back in the new shape; nothing of the old one is lost. Tapes of today pass through
untouched (one scan of the step kinds).
"""

from __future__ import annotations

from typing import Any

LEGACY_KINDS = frozenset({"task", "reasoning_thought", "final_answer_action", "parse_failure"})
_ANSWER_KINDS = LEGACY_KINDS - {"task"}


def is_legacy(data: Any) -> bool:
    """Whether a tape dict holds a step of the old kinds."""
    steps = data.get("steps") if isinstance(data, dict) else None
    return isinstance(steps, list) and any(isinstance(s, dict) and s.get("kind") in LEGACY_KINDS for s in steps)


def upgrade(data: Any) -> Any:
    """The tape dict in today's shape (a new dict); anything else, or a tape of today, as it came."""
    if not is_legacy(data):
        return data
    calls = {c.get("id"): c for c in data.get("llm_calls") or [] if isinstance(c, dict)}
    meta = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    steps: list[Any] = []
    actions: dict[str, dict] = {}  # prompt_id -> the action its steps became
    for step in data["steps"]:
        kind = step.get("kind") if isinstance(step, dict) else None
        if kind == "task":
            steps.append({"kind": "env_observation", "metadata": step.get("metadata", {}), "turn": 0,
                          "text": step.get("text", ""), "info": step.get("data", {})})  # fmt: skip
        elif kind in _ANSWER_KINDS:
            _absorb(step, steps, actions, calls)
        else:
            steps.append(step)
    _answer_actions(steps, meta)
    upgraded_calls = [dict(c) for c in data.get("llm_calls") or []]
    turns = {a["metadata"].get("prompt_id"): a["turn"] for a in actions.values()}
    for call in upgraded_calls:
        if isinstance(call, dict) and "turn" not in call and call.get("id") in turns:
            call["turn"] = turns[call["id"]]
    new_meta = dict(meta)
    new_meta.setdefault("turns", len(actions))
    new_meta.setdefault("terminated", True)
    return {**data, "metadata": new_meta, "steps": steps, "llm_calls": upgraded_calls}


def _absorb(step: dict, steps: list, actions: dict[str, dict], calls: dict) -> None:
    """A step of an LLM call's answer: the first opens the call's action, each is kept whole on it."""
    metadata = dict(step.get("metadata") or {})
    prompt_id = metadata.get("prompt_id", "")
    kept = {k: v for k, v in step.items() if k != "metadata"}
    action = actions.get(prompt_id) if prompt_id else None
    if action is None:
        call = calls.get(prompt_id) or {}
        text = call.get("output_text") or step.get("output") or step.get("reasoning") or step.get("answer") or ""
        metadata["other"] = {**(metadata.get("other") or {}), "legacy_steps": []}
        action = {"kind": "env_action", "metadata": metadata, "text": text, "turn": len(actions) + 1}
        actions[prompt_id or f"#{len(actions)}"] = action
        steps.append(action)
    action["metadata"]["other"]["legacy_steps"].append(kept)


def _answer_actions(steps: list, meta: dict) -> None:
    """After each upgraded action the environment's answer: the reward on the last turn, ending the episode."""
    positions = [i for i, s in enumerate(steps) if isinstance(s, dict) and s.get("kind") == "env_action"]
    for n, i in enumerate(reversed(positions)):
        action, last = steps[i], n == 0
        failed = any(s.get("kind") == "parse_failure" for s in action["metadata"]["other"]["legacy_steps"])
        reason = (meta.get("reward_reason") or "") if last else ""
        info: dict[str, Any] = {"reason": reason} if reason else {}
        if failed:
            info["format_error"] = True
        reward = meta.get("reward") if last else 0.0
        steps.insert(i + 1, {"kind": "env_observation", "metadata": {}, "turn": action["turn"], "text": reason,
                             "reward": reward, "terminated": last, "info": info})  # fmt: skip
