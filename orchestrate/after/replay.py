"""Replay saved episodes against their environment: `uv run -m orchestrate.after.replay FILE [--index N]`.

Each tape is played again from its environment's seed (`context.env`: id,
options, split, run seed, episode seed) by the run's agent, with an LLM that
answers from the calls the tape recorded (`orchestrate.serving.recorded.ReplayLLM`): the
environment computes its observations and rewards anew, the agent renders
its prompts anew, and the result is compared with the recorded tape step by
step (`tapes.diff`) and prompt by prompt (token ids). Tool calls: the python
tool runs the code again in the sandbox; searches are answered from the
results the tape recorded (the corpus may have changed or be elsewhere), and
the report says which (`TapeDiff.how`). This is how a change to an agent,
its prompts or an environment is checked against old tapes.
Exit status 0 when every tape came back the same, 1 when one differs, 2 for
bad input.

Each file's agent is built from its own run's config (`RUN/config.json` of
RUN/tapes/FILE or RUN/tapes/forks/FILE, or `--config` for files of one run), as
the run built it.
"""

from __future__ import annotations

import asyncio
import sys
from contextlib import ExitStack
from pathlib import Path

from agents.agent import Agent, summarize
from agents.env_spec import EnvSpec
from agents.program import played_by_program
from contract.cli import StrictParser
from contract.rundir import tape_file_config
from orchestrate.loop.forks import fork_sampling
from orchestrate.loop.setup import agent_from_run_config
from orchestrate.serving.llm import LLMError
from orchestrate.serving.recorded import ReplayLLM
from tapes.diff import TapeDiff, diff_tapes
from tapes.store import TapeFileError, line_offsets, read_tape_at, read_tapes
from tapes.tape import Tape, TapeMetadata, ToolCallAction


async def replay_tape(tape: Tape, agent: Agent) -> tuple[Tape, TapeDiff]:
    """Play `tape`'s episode again against a fresh environment with the recorded LLM outputs;
    (replayed tape, differences)."""
    spec, seed = EnvSpec.of(tape)
    fresh = Tape(
        metadata=TapeMetadata(
            id=tape.metadata.id, parent_id=tape.metadata.id, task_id=tape.metadata.task_id,
            group_id=tape.metadata.group_id, iteration=tape.metadata.iteration,
            policy_version=tape.metadata.policy_version,
        ),
        context=tape.context,
    )  # fmt: skip
    # a fork's first branch_at calls are its parent's, at the parent's sampling; its own at the fork's
    inherited = min(tape.metadata.branch_at or 0, max(0, len(tape.llm_calls) - 1))
    llm = ReplayLLM(tape, strict=False, inherited=inherited)
    # the run's sampling (rollout, eval or the fork's); a program's calls may each ask for fewer tokens and their
    # own stops, so its run's is the largest max_tokens its own calls had, as a fork of it takes (fork_sampling)
    sampling = tape.llm_calls[inherited].sampling if tape.llm_calls else None
    if sampling is not None and played_by_program(tape):
        sampling = fork_sampling(tape.model_copy(update={"llm_calls": tape.llm_calls[inherited:]}), sampling)
    notes = []
    env = None
    try:
        env = spec.make(recorded=tape)  # tools that are not run again (search) answer from this tape
        await agent.run_episode(env, seed, llm, fresh, sampling)
    except LLMError as exc:
        notes.append(str(exc))
        summarize(fresh)
    except Exception as exc:  # the environment or agent failed on this tape: on the record, as a rollout does
        fresh.metadata.error = f"{type(exc).__name__}: {exc}"
        summarize(fresh)
    if llm.position < len(llm.calls) and not notes:
        notes.append(f"replay: the agent made {llm.position} calls; the tape recorded {len(llm.calls)}")
    for recorded, replayed in zip(tape.llm_calls, fresh.llm_calls):
        if (recorded.turn, recorded.extends_previous) != (replayed.turn, replayed.extends_previous):
            notes.append(
                f"call {recorded.id}: recorded turn {recorded.turn} extends_previous "
                f"{recorded.extends_previous}, replayed {replayed.turn} {replayed.extends_previous}"
            )
    diff = diff_tapes(tape, fresh)
    diff.notes = [p for _, p in llm.mismatches] + notes + diff.notes
    calls: dict[str, int] = {}
    for step in fresh.steps:
        if isinstance(step, ToolCallAction):
            calls[step.tool] = calls.get(step.tool, 0) + 1
    tools = {t.name: t for t in getattr(env, "tools", [])}
    diff.how = [
        tools[name].replay_note(n) for name, n in sorted(calls.items()) if hasattr(tools.get(name), "replay_note")
    ]
    return fresh, diff


def main(argv: list[str] | None = None) -> int:
    parser = StrictParser(
        prog="orchestrate.after.replay", allow_abbrev=False, description=__doc__.splitlines()[0].split(": ")[0]
    )
    parser.add_argument("files", nargs="+", help="tape files (JSON lines), e.g. RUN/tapes/iter_000001.jsonl")
    parser.add_argument("--index", type=int, help="replay only this tape of the file (from 0)")
    parser.add_argument("--config", help="the run's config.json (default: RUN/config.json beside the tapes/ folder)")
    parser.add_argument("--quiet", action="store_true", help="print only tapes that differ and the summary")
    args = parser.parse_args(argv)

    paths = [Path(f) for f in args.files]
    for path in paths:
        if not path.is_file():
            parser.error(f"files: {path} is not a file")
    runs = {tape_file_config(path) for path in paths}
    if args.config:
        found = sorted(str(p) for p in runs if p.is_file())
        if len(found) > 1:
            parser.error(f"--config: the files are of {len(found)} runs ({', '.join(found)}); pass one run's files "
                         "with --config, or leave it out: each file is replayed with its own run's config")  # fmt: skip
    configs = {path: Path(args.config) if args.config else tape_file_config(path) for path in paths}
    for path, config_path in configs.items():
        if not config_path.is_file():
            parser.error(f"--config: {config_path} not found for {path}; pass the run's config.json")
    with ExitStack() as stack:
        agents: dict[Path, Agent] = {}
        for config_path in dict.fromkeys(configs.values()):
            try:
                agents[config_path] = stack.enter_context(agent_from_run_config(config_path))
            except Exception as exc:  # noqa: BLE001 - any way it is not one: its first line
                parser.error(f"--config {config_path}: not a run config ({str(exc).splitlines()[0]})")
        return _replay_files(paths, {path: agents[configs[path]] for path in paths}, args, parser)


def _replay_files(paths: list[Path], agents: dict[Path, Agent], args, parser) -> int:
    from orchestrate.loop.trees import diverged

    total = differ = skipped = 0
    for path in paths:
        agent = agents[path]
        try:
            if args.index is not None:
                offsets = line_offsets(path)
                if not 0 <= args.index < len(offsets):
                    parser.error(f"--index {args.index}: {path} holds {len(offsets)} tapes")
                tapes = [read_tape_at(path, offsets[args.index], args.index + 1)]
            else:
                tapes = read_tapes(path)
            for number, tape in enumerate(tapes, start=args.index + 1 if args.index is not None else 1):
                if diverged(tape):  # a fork that never came back to its branch point: its record is the failure
                    skipped += 1
                    if not args.quiet:
                        print(f"{path.name}: tape {number} skipped: a fork that did not come back to its branch "
                              f"point ({tape.metadata.error})")  # fmt: skip
                    continue
                try:
                    _, diff = asyncio.run(replay_tape(tape, agent))
                except Exception as exc:  # a tape without what replay needs (task, answer, calls)
                    print(f"error: {path}:{number}: cannot replay this tape ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''})", file=sys.stderr)  # fmt: skip
                    return 2
                total += 1
                differ += not diff.identical
                if not (args.quiet and diff.identical):
                    print(f"{path.name}: {diff.report()}")
        except TapeFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if total == 0 and not skipped:
        print(f"error: {', '.join(map(str, paths))}: no tapes to replay (empty file?)", file=sys.stderr)
        return 2
    forks = f"; {skipped} diverged forks skipped (never trained)" if skipped else ""
    print(f"{total} tapes replayed: {total - differ} identical, {differ} differ{forks}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
