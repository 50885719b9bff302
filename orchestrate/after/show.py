"""One tape in the terminal: `uv run -m orchestrate.after.show FILE [--index N] [--tokens]`.

Prints the episode as a conversation: its metadata, the environment's first
observation, then turn by turn the agent's action (from which LLM call), the
turn's reward and, when the tape file lies in a run directory
(RUN/tapes/iter_NNNNNN.jsonl), the return and advantage the learner trained
the turn with (read from RUN/advantages/NNNNNN.jsonl, never recomputed), the
environment's answer, and how the episode ended. The first call's prompt is
printed before its output; `--tokens` adds one line per output token with its
log-prob (and reference log-prob and KL where annotated); `--steps` adds the
steps as recorded. A tape of a tree (tree rollouts, or forks written beside their parent) ends with its
group's tree: each tape under its parent, where it branched, its reward.
Colours are used when the output is a terminal (`--no-color` turns them off).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from agents.tool_format import written
from contract.cli import StrictParser
from contract.kl import k3
from contract.rundir import RunDir, advantages_file, read_advantages
from orchestrate.after.episode_view import TAPE_FILE, episode_view, load_tokenizer, trained_turns, tree_rows
from orchestrate.loop.forks import DIVERGED
from tapes.store import TapeFileError, line_offsets, read_tape_at
from tapes.tape import Tape

BOLD, DIM, RED, GREEN, YELLOW, RESET = "\033[1m", "\033[2m", "\033[31m", "\033[32m", "\033[33m", "\033[0m"

# Terminal control characters (C0 but newline and tab, DEL, C1) and bidirectional overrides: model output
# is untrusted, and an escape sequence in it could move the cursor, retitle or recolour the terminal, or
# make text read otherwise than it is. They are shown escaped instead.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def strip_controls(text: str) -> str:
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256 else f"\\u{ord(m.group()):04x}",
                        text)  # fmt: skip


def _printable(value):
    if isinstance(value, str):
        return strip_controls(value)
    if isinstance(value, dict):
        return {_printable(k): _printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable(v) for v in value]
    return value


def _num(x) -> str:
    return "none" if x is None else f"{x:+g}" if isinstance(x, (int, float)) else str(x)


class _Ink:
    """Colours when the output is a terminal, plain text otherwise."""

    def __init__(self, color: bool):
        self.color = color

    def __call__(self, code: str, text: str) -> str:
        return f"{code}{text}{RESET}" if self.color else text

    def signed(self, x) -> str:
        code = GREEN if (x or 0) > 0 else RED if (x or 0) < 0 else ""
        return self(code, _num(x))


def render(
    tape: Tape,
    *,
    tokens: bool = False,
    color: bool = False,
    tokenizer=None,
    steps: bool = False,
    learned: list[dict] | None = None,
    learner_note: str = "",
    tree: list[dict] | None = None,
) -> str:
    """The tape as text. `learned`: the learner's turns for this tape ({index, reward, return, advantage}, from
    the advantages file), None if it was not trained on (`learner_note` says why; empty: unknown). `tree`: its
    group's tapes in tree order (`tree_of`), printed at the end when the group holds forks."""
    c = _Ink(color)
    tape = Tape.model_validate(_printable(tape.model_dump()))  # every string of the tape, control characters escaped
    episode = episode_view(tape, learned)
    lines = _header(tape, episode, c, learned, learner_note)
    lines += _first_observation(episode["first_observation"], c)
    for turn in episode["turns"]:
        call = tape.llm_calls[turn["call"]] if turn["call"] is not None else None
        lines += _agent_turn(turn, call, c)
        if tokens and call is not None:
            lines += _token_lines(call, tokenizer)
        lines.append(_learner_line(turn, c, learner_note))
        lines += _answer(turn, c)
    lines += _ending(episode["end"], tape, c)
    if steps:
        lines += _steps(tape, c)
    if tree and any(row["depth"] for row in tree):
        lines += _tree(tree, tape.metadata.id, c)
    return "\n".join(lines)


def tree_of(path: Path, tape: Tape) -> list[dict]:
    """The tapes of `tape`'s group in its file (index, id, parent, branch point, reward, success, dropped), in
    tree order (episode_view.tree_rows)."""
    from tapes.store import read_tapes

    group = tape.metadata.group_id or tape.metadata.id
    members = [{"index": i, "id": t.metadata.id, "parent_id": t.metadata.parent_id, "branch_at": t.metadata.branch_at,
                "reward": t.metadata.reward, "success": t.metadata.success, "dropped": t.metadata.dropped,
                "calls": len(t.llm_calls)}
               for i, t in enumerate(read_tapes(path)) if (t.metadata.group_id or t.metadata.id) == group]  # fmt: skip
    return tree_rows(members)


def _tree(rows: list[dict], current: str, c: _Ink) -> list[str]:
    """The group's tree, one line per tape, indented under its parent, this tape marked."""
    forks = sum(1 for row in rows if row["depth"])
    lines = [c(BOLD, f"\n[tree] {len(rows) - forks} roots, {forks} forks (this tape marked >)")]
    for row in rows:
        where = f"fork at call {row['branch_at']}, " if row["depth"] else ""
        line = (f"{'>' if row['id'] == current else ' '} {'    ' * row['depth']}#{row['index']} {where}reward "
                f"{_num(row['reward'])}{', success' if row['success'] else ''}, {row['calls']} calls")  # fmt: skip
        if row["dropped"] == DIVERGED:
            line += " (did not come back to its branch point: not trained)"
        lines.append(c(DIM, line) if row["dropped"] else line)
    return lines


def _end_text(end: dict) -> str:
    return "terminated" if end["terminated"] else "truncated" if end["truncated"] else "no end recorded"


def _success(tape: Tape) -> str:
    return {True: "yes", False: "no"}.get(tape.metadata.success, "unknown")


def _header(tape: Tape, episode: dict, c: _Ink, learned: list[dict] | None, learner_note: str) -> list[str]:
    """Who played what, how it scored and ended, and whether the learner trained on it."""
    m = tape.metadata
    env = (tape.context or {}).get("env") if isinstance(tape.context, dict) else None
    n = len(episode["turns"])
    lines = [
        c(BOLD, f"tape {m.id}")
        + (f"  env {env.get('id')}" if isinstance(env, dict) and env.get("id") else "")
        + f"  task {m.task_id}  group {m.group_id}  iteration {m.iteration}  policy version {m.policy_version}",
        "reward "
        + c.signed(m.reward)
        + (f": {m.reward_reason}" if m.reward_reason else "")
        + f"  ({n} turn{'' if n == 1 else 's'}, success {_success(tape)}, {_end_text(episode['end'])})",
    ]
    if m.branch_at is not None:
        lines.append(f"fork of tape {m.parent_id}: its first {m.branch_at} LLM calls replayed, the rest sampled live")
    if m.error:
        lines.append(c(RED, f"agent error: {m.error}"))
    if learned is not None:
        lines.append("learner: trained (returns and advantages from its advantages file)")
    elif learner_note:
        lines.append(c(RED if m.error else DIM, f"learner: {learner_note}"))
    return lines


def _first_observation(first: dict | None, c: _Ink) -> list[str]:
    if first is None:
        return []
    lines = [c(BOLD, "\n[environment] reset"), "   " + first["text"].replace("\n", "\n   ")]
    for step in first.get("steps", []):
        lines.append(_step_line(step, c))
    return lines


def _agent_turn(turn: dict, call, c: _Ink) -> list[str]:
    """The turn's heading (which call, how it finished), its prompt where it starts a conversation or is
    re-rendered, the output and the steps recorded with it."""
    who = f"[{call.role}]" if call is not None and call.role else "[agent]"
    head = c(BOLD, f"\n{who} turn {turn['turn']}" + (f" ({turn['tool']} call)" if turn.get("tool") else ""))
    if call is not None:
        role = f" ({call.role})" if call.role else ""
        head += c(DIM, f"  call {turn['call'] + 1}{role}: {call.model}  T={call.sampling.temperature}  "
                  f"finish {call.finish_reason}  {len(call.prompt_token_ids)} prompt + "
                  f"{len(call.output_token_ids)} output tokens")  # fmt: skip
        if call.extends_previous is False:
            head += "  " + c(YELLOW, "WARNING: prompt re-rendered (does not extend the previous call)")
    lines = [head]
    if call is not None and (turn["call"] == 0 or call.extends_previous is False):
        lines.append(c(DIM, f"   prompt of call {turn['call'] + 1}:"))
        for message in call.messages:
            lines.append(c(DIM, f"   [{message.get('role')}] ") + written(message).replace("\n", "\n   "))
        lines.append(c(DIM, "   output:"))
    text = call.output_text if call is not None else (turn["action"] or "")
    lines.append("   " + text.replace("\n", "\n   "))
    for step in turn["steps"]:
        lines.append(_step_line(step, c))
    return lines


def _token_lines(call, tokenizer) -> list[str]:
    """One line per output token: its id, text, log-prob (and reference log-prob and KL where annotated)."""
    ref = call.ref_logprobs or []
    lines = []
    for j, (tid, lp) in enumerate(zip(call.output_token_ids, call.logprobs)):
        token = strip_controls(repr(tokenizer.decode([tid]))) if tokenizer is not None else ""
        extra = f"  ref {ref[j]:8.4f}  kl {k3(lp, ref[j]):.4f}" if j < len(ref) else ""
        lines.append(f"   {j:4d}  {tid:6d} {token:16s} logprob {lp:8.4f}{extra}")
    return lines


def _learner_line(turn: dict, c: _Ink, learner_note: str) -> str:
    """The turn's reward, and the return and advantage the learner trained it with (or why there are none)."""
    learner = turn["learner"]
    line = f"   turn {turn['turn']}: reward " + c.signed(turn["reward"])
    if learner is not None:
        line += f"  return {_num(learner['return'])}  advantage " + c.signed(learner["advantage"])
        if learner.get("value") is not None:  # PPO's critic, before the turn
            line += f"  value {_num(learner['value'])}"
    elif learner_note:  # no note: the file is not in a run directory, the learner's numbers are unknown
        line += c(DIM, f"  ({learner_note})")
    return line


def _answer(turn: dict, c: _Ink) -> list[str]:
    """The environment's (or the tool's) answer to the turn, flagged when it went wrong."""
    if turn["observation"] is None:
        return []
    flag = "  " + c(RED, "format error") if turn["format_error"] else ""
    info = turn.get("info") or {}
    if turn.get("tool"):
        flag += (
            "  " + c(RED, "timed out" if info.get("timed_out") else "tool error")
            if (info.get("timed_out") or info.get("tool_error"))
            else ""
        )
        head = c(BOLD, f"[{turn['tool']} tool] result of turn {turn['turn']}") + flag
    else:
        head = c(BOLD, f"[environment] answer to turn {turn['turn']}") + flag
    return [head, "   " + turn["observation"].replace("\n", "\n   ")]


def _ending(end: dict, tape: Tape, c: _Ink) -> list[str]:
    if not (end["terminated"] or end["truncated"]):
        return []
    return [
        c(BOLD, f"\nend: {_end_text(end)}")
        + (f" ({end['reason']})" if end["reason"] else "")
        + f", success {_success(tape)}"
    ]


def _steps(tape: Tape, c: _Ink) -> list[str]:
    """Every step as recorded, with the call it came from (`--steps`)."""
    call_number = {call.id: i + 1 for i, call in enumerate(tape.llm_calls)}
    lines = [c(BOLD, "\nsteps")]
    for i, step in enumerate(tape.steps, start=1):
        origin = f"  (call {call_number.get(step.metadata.prompt_id, '?')})" if step.metadata.prompt_id else ""
        lines.append(c(BOLD, f"{i}. {step.kind}") + c(DIM, origin))
        for key, value in step.model_dump(exclude={"metadata", "kind"}).items():
            text = value if isinstance(value, str) else repr(value)
            lines.append(f"   {key}: " + text.replace("\n", "\n   "))
    return lines


def _step_line(step: dict, c: _Ink) -> str:
    """A step recorded with a turn: an agent program's message as its role and text, others field by field."""
    if step["kind"] == "program_message":
        return c(DIM, f"   [program, {step['role']}] ") + step["text"].replace("\n", "\n   ")
    return c(DIM, f"   {step['kind']}: ") + _fields(step)


def _fields(step: dict) -> str:
    return "; ".join(f"{k} {v if isinstance(v, str) else repr(v)}" for k, v in step.items() if k != "kind")


def trained_turns_of(path: Path, tape: Tape) -> tuple[list[dict] | None, str]:
    """The learner's turns for a tape of RUN/tapes/iter_NNNNNN.jsonl (from RUN/advantages/NNNNNN.jsonl) and a
    note; (None, "") when the file is not in a run directory's tapes/ folder."""
    match = TAPE_FILE.match(path.name)
    root = path.resolve().parent.parent
    if match is None or path.resolve().parent != RunDir(root).tapes:
        return None, ""
    iteration = int(match.group(2))
    adv = advantages_file(root, iteration)
    advantages = read_advantages(root, iteration) if adv.is_file() else None
    kind = "rollout" if match.group(1) == "iter" else "eval"
    dropped = tape.metadata.dropped
    return trained_turns(kind, tape.metadata.error, tape.metadata.id, advantages, f"{adv.parent.name}/{adv.name}",
                      dropped)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = StrictParser(
        prog="orchestrate.after.show", allow_abbrev=False, description="Print one tape of a tape file."
    )
    parser.add_argument("file", help="a tape file (JSON lines, e.g. RUN/tapes/iter_000001.jsonl)")
    parser.add_argument("--index", type=int, default=0, help="which tape of the file, from 0 [default: 0]")
    parser.add_argument("--tokens", action="store_true", help="list output tokens with their log-probs")
    parser.add_argument("--steps", action="store_true", help="also list the steps as recorded")
    parser.add_argument("--tokenizer", help="tokenizer folder to show token texts with --tokens")
    parser.add_argument("--no-color", action="store_true", help="no terminal colours")
    args = parser.parse_args(argv)
    path = Path(args.file)
    if path.is_dir():
        parser.error(f"file {path}: a folder; pass a tape file (e.g. {path / 'tapes' / 'iter_000001.jsonl'})")
    if not path.is_file():
        parser.error(f"file {path}: no such file")
    offsets = line_offsets(path)
    if not offsets:
        parser.error(f"file {path}: holds no tapes (an empty file)")
    if not 0 <= args.index < len(offsets):
        parser.error(f"--index {args.index}: {path} holds {len(offsets)} tapes (0..{len(offsets) - 1})")
    try:
        tape = read_tape_at(path, offsets[args.index], args.index + 1)
        if not tape.steps and not tape.llm_calls and not tape.metadata.error:
            raise TapeFileError(f"{path}:{args.index + 1}: not a tape of an episode (no steps, LLM calls or error)")
        learned, note = trained_turns_of(path, tape)
    except TapeFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # an unreadable advantages file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokenizer = None
    if args.tokenizer:
        tokenizer = load_tokenizer(Path(args.tokenizer))
        if tokenizer is None:
            parser.error(f"--tokenizer {args.tokenizer}: no tokenizer.json or tokenizer_config.json there")
    color = sys.stdout.isatty() and not args.no_color
    try:
        tree = tree_of(path, tape)
    except TapeFileError:
        tree = None  # another line of the file is torn: the tape itself is shown
    print(
        render(
            tape,
            tokens=args.tokens,
            color=color,
            tokenizer=tokenizer,
            steps=args.steps,
            learned=learned,
            learner_note=note,
            tree=tree,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
