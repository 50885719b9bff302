"""One tape in the terminal: `uv run -m tapes.show FILE [--index N] [--tokens]`.

Prints the tape's metadata, reward and reason, its steps in order, and each
LLM call with its prompt and output. `--tokens` adds one line per output
token with its log-prob (and reference log-prob and KL where annotated).
Colours are used when the output is a terminal (`--no-color` turns them off).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from tapes.store import TapeFileError, line_offsets, read_tape_at
from tapes.tape import Tape

BOLD, DIM, RED, GREEN, RESET = "\033[1m", "\033[2m", "\033[31m", "\033[32m", "\033[0m"

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


def render(tape: Tape, *, tokens: bool = False, color: bool = False, tokenizer=None) -> str:
    def c(code: str, text: str) -> str:
        return f"{code}{text}{RESET}" if color else text

    tape = Tape.model_validate(_printable(tape.model_dump()))  # every string of the tape, control characters escaped
    m = tape.metadata
    reward = "none" if m.reward is None else f"{m.reward:+g}"
    reward_code = GREEN if (m.reward or 0) > 0 else RED if (m.reward or 0) < 0 else ""
    lines = [
        c(BOLD, f"tape {m.id}") + f"  task {m.task_id}  group {m.group_id}  iteration {m.iteration}  "
        f"policy version {m.policy_version}",
        "reward " + c(reward_code, reward) + (f": {m.reward_reason}" if m.reward_reason else ""),
    ]
    if m.error:
        lines.append(c(RED, f"agent error: {m.error}"))
    call_number = {call.id: i + 1 for i, call in enumerate(tape.llm_calls)}
    lines.append(c(BOLD, "\nsteps"))
    for i, step in enumerate(tape.steps, start=1):
        origin = f"  (call {call_number.get(step.metadata.prompt_id, '?')})" if step.metadata.prompt_id else ""
        lines.append(c(BOLD, f"{i}. {step.kind}") + c(DIM, origin))
        for key, value in step.model_dump(exclude={"metadata", "kind"}).items():
            text = value if isinstance(value, str) else repr(value)
            lines.append(f"   {key}: " + text.replace("\n", "\n   "))
    for i, call in enumerate(tape.llm_calls, start=1):
        lines.append(c(BOLD, f"\ncall {i}") + c(DIM, f"  {call.model}  T={call.sampling.temperature}  "
                     f"finish {call.finish_reason}  {len(call.prompt_token_ids)} prompt + "
                     f"{len(call.output_token_ids)} output tokens"))
        for message in call.messages:
            lines.append(c(DIM, f"[{message.get('role')}] ") + str(message.get("content", "")))
        lines.append(c(BOLD, "[output] ") + call.output_text)
        if tokens:
            ref = call.ref_logprobs or []
            for j, (tid, lp) in enumerate(zip(call.output_token_ids, call.logprobs)):
                text = strip_controls(repr(tokenizer.decode([tid]))) if tokenizer is not None else ""
                extra = ""
                if j < len(ref):
                    r = ref[j] - lp
                    extra = f"  ref {ref[j]:8.4f}  kl {math.exp(r) - r - 1:.4f}"
                lines.append(f"   {j:4d}  {tid:6d} {text:16s} logprob {lp:8.4f}{extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tapes.show", allow_abbrev=False, description="Print one tape of a tape file.")
    parser.add_argument("file", help="a tape file (JSON lines, e.g. RUN/tapes/iter_000001.jsonl)")
    parser.add_argument("--index", type=int, default=0, help="which tape of the file, from 0 [default: 0]")
    parser.add_argument("--tokens", action="store_true", help="list output tokens with their log-probs")
    parser.add_argument("--tokenizer", help="tokenizer folder to show token texts with --tokens")
    parser.add_argument("--no-color", action="store_true", help="no terminal colours")
    args = parser.parse_args(argv)
    path = Path(args.file)
    if not path.is_file():
        parser.error(f"file {path}: no such file")
    offsets = line_offsets(path)
    if not 0 <= args.index < len(offsets):
        parser.error(f"--index {args.index}: {path} holds {len(offsets)} tapes (0..{len(offsets) - 1})")
    try:
        tape = read_tape_at(path, offsets[args.index], args.index + 1)
    except TapeFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokenizer = None
    if args.tokenizer:
        from tapes.browse import _load_tokenizer

        tokenizer = _load_tokenizer(Path(args.tokenizer))
        if tokenizer is None:
            parser.error(f"--tokenizer {args.tokenizer}: no tokenizer.json or tokenizer_config.json there")
    color = sys.stdout.isatty() and not args.no_color
    print(render(tape, tokens=args.tokens, color=color, tokenizer=tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
