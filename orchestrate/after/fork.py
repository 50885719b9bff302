"""Fork a saved episode at one of its LLM calls: `uv run -m orchestrate.after.fork FILE --index N --at K [--n 4]`.

    uv run -m orchestrate.after.fork runs/embedded/tapes/iter_000003.jsonl --index 5 --at 2 --n 4
    uv run -m orchestrate.after.fork RUN/tapes/eval_000004.jsonl --index 0 --at 0 --n 8 --temperature 1.0 --model smollm2

Tape N of FILE (from 0) is played again from its environment's seed (`context.env`) by the run's agent,
built from `config.json` as the run built it (the built-in agent or an agent program). Its first K LLM calls
are answered from the tape (`orchestrate.serving.recorded.ForkLLM`), strictly: the agent must render the recorded
prompts token for token, else the fork stops, naming the call. Every call after them is sampled live by the
policy as it is now: the run's newest checkpoint whose weights are on disk (a LoRA run: its newest adapter),
served by a vLLM server started for this command with the run's server settings; or `--model MODEL`; or a
server that runs, `--url URL` (as it serves now). The tape's own sampling is kept (temperature, top_p,
max_tokens) unless `--temperature` or `--max-tokens` change it. This is done n times, concurrently.

The n continuations are written as tapes to RUN/tapes/forks/ID_atK.jsonl (`--out` to choose): each a fresh
id with `metadata.parent_id` the parent tape's id and `metadata.branch_at` K, the n of them one group
(`group_id` ID@K); the replayed calls as the tape recorded them (policy version, log-probs), the live ones
new, with the served version as their policy version. Tools that a replay answers from the tape (search)
answer the replayed calls from it and the live ones anew.

Exit status 0 when the forks are written; 1 when the agent did not come back to call K (a replayed prompt
differs, or the episode ended sooner) or the server failed: nothing is written; 2 for bad input, one line
naming the option, checked before anything starts.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agents.env_spec import EnvSpec
from contract.cli import OptionError, StrictParser
from contract.rundir import FORKS_DIR, RunDir, tape_file_config
from orchestrate.loop.forks import fork_sampling, fork_tape
from orchestrate.loop.policy import Policy, given_policy, read_run_config, run_policy
from orchestrate.loop.preflight import remote_policy
from orchestrate.loop.setup import PolicyServer
from orchestrate.serving.llm import LLMError
from tapes.tape import SamplingParams, Tape

# -- the command's lines ----------------------------------------------------------------------------


def summary_line(number: int, fork: Tape) -> str:
    m = fork.metadata
    live = len(fork.llm_calls) - (m.branch_at or 0)
    line = f"fork {number}: "
    line += f"reward {m.reward:g}" if m.reward is not None else "no reward"
    line += ", success" if m.success else ""
    line += f", {len(fork.llm_calls)} calls ({m.branch_at} replayed, {live} live)"
    if m.error:
        return line + f", error: {m.error.splitlines()[0]}"
    end = "terminated" if m.terminated else "truncated" if m.truncated else "not ended"
    return line + f", {end}" + (f" ({m.reward_reason})" if m.reward_reason and not m.terminated else "")


# -- the command ------------------------------------------------------------------------------------


class ForkError(OptionError):
    """Bad input: one line naming the option, exit 2."""


def default_out(path: Path, tape: Tape, at: int) -> Path:
    """FOLDER/forks/ID_atK.jsonl beside the tape file (beside it when it is in forks/ already); -2, -3 ... when
    taken (a fork at the same call with other settings)."""
    folder = path.parent if path.parent.name == FORKS_DIR else path.parent / FORKS_DIR
    stem = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', tape.metadata.id)[:80]}_at{at}"
    out, n = folder / f"{stem}.jsonl", 1
    while out.exists():
        n += 1
        out = folder / f"{stem}-{n}.jsonl"
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = StrictParser(prog="orchestrate.after.fork", allow_abbrev=False,
                                     description=__doc__.splitlines()[0].split(": ")[0])  # fmt: skip
    parser.add_argument("file", help="a tape file (JSON lines), e.g. RUN/tapes/iter_000003.jsonl")
    parser.add_argument("--index", type=int, required=True, help="the tape of the file to fork (from 0)")
    parser.add_argument("--at", type=int, required=True, metavar="K",
                        help="replay the tape's first K LLM calls, then sample live (0 to its number of calls - 1)")  # fmt: skip
    parser.add_argument("--n", type=int, default=4, help="how many continuations [default: 4]")
    parser.add_argument("--temperature", type=float, help="the live calls' temperature [default: the tape's]")
    parser.add_argument("--max-tokens", type=int, help="the live calls' max_tokens [default: the tape's]")
    parser.add_argument("--model", help="sample with this model (a folder, a hub id or smollm2) [default: the "
                        "run's newest checkpoint]")  # fmt: skip
    parser.add_argument("--url", help="sample with the policy server at this URL (orchestrate.serve), as it serves now")
    parser.add_argument("--key-file", help="with --url: the server's API key [default: $VLLM_API_KEY]")
    parser.add_argument("--config", help="the run's config.json (default: RUN/config.json above the tapes/ folder)")
    parser.add_argument("--out", help="the forks' tape file [default: FOLDER/forks/ID_atK.jsonl beside FILE]")
    return parser


@dataclass
class Inputs:
    """The command line, checked."""

    path: Path
    tape: Tape
    at: int
    n: int
    config: Any  # RLConfig
    config_path: Path
    out: Path
    policy: Policy
    key_file: str | None = None  # --url: the server's API key


def resolve(args: argparse.Namespace) -> Inputs:
    """Every option checked before anything starts; ForkError names the first bad one."""
    from tapes.store import TapeFileError, line_offsets, read_tape_at

    if args.n < 1:
        raise ForkError(f"--n {args.n}: fork at least once (--n 1 or more)")
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ForkError(f"--temperature {args.temperature}: expected a number >= 0")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ForkError(f"--max-tokens {args.max_tokens}: expected a positive integer")
    if args.model and args.url:
        raise ForkError("--url: give the policy once: --model MODEL starts a server, --url URL uses one that runs")
    if args.key_file and not args.url:
        raise ForkError("--key-file: it is the key of the server of --url; pass --url too")
    path = Path(args.file)
    if not path.is_file():
        raise ForkError(f"file: {path} is not a file")
    try:
        offsets = line_offsets(path)
        if not 0 <= args.index < len(offsets):
            raise ForkError(f"--index {args.index}: {path} holds {len(offsets)} tapes (0 to {len(offsets) - 1})")
        tape = read_tape_at(path, offsets[args.index], args.index + 1)
    except TapeFileError as exc:
        raise ForkError(f"file: {str(exc).splitlines()[0]}") from None
    try:
        EnvSpec.of(tape)
    except ValueError as exc:
        raise ForkError(f"--index {args.index}: {exc}") from None
    calls = len(tape.llm_calls)
    if calls == 0:
        raise ForkError(f"--index {args.index}: tape {args.index} of {path.name} made no LLM call: nothing to fork")
    if args.at == calls:  # every call answered from the tape: n copies, nothing sampled
        raise ForkError(f"--at {args.at}: tape {args.index} of {path.name} made {calls} LLM calls, all of which would "
                        f"be replayed and none sampled live; fork at 0 to {calls - 1} (to play it again as recorded: "
                        "orchestrate.after.replay)")  # fmt: skip
    if not 0 <= args.at < calls:
        raise ForkError(f"--at {args.at}: tape {args.index} of {path.name} made {calls} LLM calls: 0 to {calls - 1}")
    config_path = Path(args.config) if args.config else tape_file_config(path)
    config = read_run_config(config_path)
    out = Path(args.out) if args.out else default_out(path, tape, args.at)
    if args.out and out.exists():
        raise ForkError(f"--out: {out} exists; tape files are written once, pass a new name")
    if out.resolve() == path.resolve():
        raise ForkError(f"--out: {out} is the tape file itself")
    if args.n > MAX_FORKS:
        raise ForkError(f"--n {args.n}: at most {MAX_FORKS} continuations of one tape in one command")
    if args.max_tokens is not None and args.max_tokens >= config.server.max_model_len:
        raise ForkError(f"--max-tokens {args.max_tokens}: does not fit the run's --server.max_model_len "
                        f"{config.server.max_model_len} (prompt + completion)")  # fmt: skip
    if args.url:
        policy = remote_policy(args.url, args.key_file)
    elif args.model:
        policy = given_policy(args.model)
    else:
        policy = run_policy(RunDir(config_path.parent), config)
    return Inputs(path, tape, args.at, args.n, config, config_path, out, policy, args.key_file)


MAX_FORKS = 1024  # continuations of one tape in one command (eval's samples per task have the same bound)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        given = resolve(args)
    except OptionError as exc:  # any refusal of the input: one line, exit 2
        parser.error(str(exc).splitlines()[0])
    try:
        from orchestrate.loop.setup import agent_from_run_config

        agent = agent_from_run_config(given.config_path)
    except Exception as exc:  # noqa: BLE001 - e.g. an agent program that no longer imports
        parser.error(f"--config {given.config_path}: cannot build the run's agent ({str(exc).splitlines()[0]})")
    sampling = fork_sampling(given.tape, agent.sampling, args.temperature, args.max_tokens)
    policy = given.policy
    print(f"policy: {policy.note}; temperature {sampling.temperature:g}, max_tokens {sampling.max_tokens}",
          flush=True)  # fmt: skip
    from orchestrate.serving.vllm_server import ServerError

    served = PolicyServer(policy, given.config, given.config_path.parent / "logs", given.key_file, "fork-policy")
    try:
        if served.log_path is not None:
            print(f"starting a vLLM server for it (log: {served.log_path})", file=sys.stderr, flush=True)
        with served:
            forks = asyncio.run(_fork(given, agent, served, sampling))
    except (LLMError, ServerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        agent.close()
    from orchestrate.loop.samples import save_tapes

    given.out.parent.mkdir(parents=True, exist_ok=True)
    save_tapes(given.out, forks)
    for number, fork in enumerate(forks, start=1):
        print(summary_line(number, fork))
    print(f"{len(forks)} forks of tape {given.tape.metadata.id} ({given.path.name}, index {args.index}) at call "
          f"{given.at}: {given.out}")  # fmt: skip
    return 0


async def _fork(given: Inputs, agent, served: PolicyServer, sampling: SamplingParams) -> list[Tape]:
    async with served.client() as client:
        return await fork_tape(given.tape, agent, given.at, given.n, client, sampling, served.policy.version)


if __name__ == "__main__":
    sys.exit(main())
