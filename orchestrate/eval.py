"""Evaluate a policy: `uv run -m orchestrate.eval TARGET [--n 8 --temperature 1.0] [--tasks 0:200]`.

    uv run -m orchestrate.eval runs/embedded                           # its newest checkpoint, the held-out set
    uv run -m orchestrate.eval runs/embedded --version 10 --n 8 --temperature 1.0
    uv run -m orchestrate.eval smollm2 --env.id math:gsm8k --tasks 0:200
    uv run -m orchestrate.eval http://127.0.0.1:8000 --key-file KEY --config runs/embedded/config.json
    uv run -m orchestrate.eval --compare runs/embedded@0 runs/embedded --n 4 --temperature 1.0
    uv run -m orchestrate.eval runs/embedded --versions all --step 5    # a learning curve, one server

TARGET is a run directory (its newest checkpoint with weights on disk; `--version N` or RUN@N for version N,
0 the initial model), a model folder (a checkpoint RUN/checkpoints/N is version N of its run), a model by
name (smollm2, a hub id), or the URL of a policy server that runs (orchestrate.serve; used as it serves now).
The environment and the agent (built-in or `--agent.program`) are the run's (its config.json: the target's
run, or `--config`), else the preset's, with `--env.*` / `--agent.*` overrides; the tasks are a slice of a
split (`--tasks N` the first N, `A:B`; default the run's eval.tasks, else the whole test split).

Each task is played `--n` times at `--temperature` (all in flight on one vLLM server started for the target,
with the run's server settings; the loop's held-out evaluation plays with the same code,
orchestrate.loop.evaluation). Reported: mean reward, pass@k for k = 1, 2, 4, ... n (the unbiased
estimator), maj@k where the environment reports comparable answers, each with a 95% interval over tasks
(orchestrate.loop.eval_stats), and a per-task table with the failures first. Written to OUT (default
RUN/evals/LABEL for a run, else runs/evals/NAME-LABEL): tapes/eval_VVVVVV.jsonl (browse, replay and fork
them), eval.json (settings, figures, per task), summary.md, pass_at_k.png, config.json, logs/. Finished
tasks are appended as they end: the same command after a kill plays only the rest.

`--versions all|N,A-B [--step K]` evaluates versions of one run in turn on one server (each next version's
weights reloaded into it, a LoRA run's adapter loaded), each into OUT/vN, and writes their curve against the
minute each version came in the run (curve.json, curve.md, curve.png).

`--compare A B` evaluates A then B on the same tasks and seeds (OUT/a, OUT/b, resumable each) and reports
the paired difference B - A of each figure with its 95% interval and the tasks that flipped (compare.json,
compare.md, compare.png).

An evaluation of a run whose loop is running reads the run's checkpoints and writes only its own folder,
under its own lock. Exit status 0 when written; 1 when a server failed (what finished is kept); 2 for bad
input, one line naming the option, checked before anything starts.

The command reads in order: parse (`build_parser`, `main`), resolve (orchestrate.loop.eval_settings: every
option checked into Settings), evaluate (`evaluate`, here: one target into its folder), report
(orchestrate.loop.eval_report: the headline, the curve, the comparison).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from contract.cli import OptionError, StrictParser, add_options, refuse_repeated
from contract.durable import atomic_write_json, atomic_write_text
from orchestrate.loop.command_line import presets, split_env_options
from orchestrate.loop.config import EnvSection, ProgramSection, RLConfig, ServerSection
from orchestrate.loop.eval_report import headline, write_comparison, write_curve
from orchestrate.loop.eval_settings import Settings, Target, folders_of, resolve
from orchestrate.loop.policy import Policy
from orchestrate.loop.rollouts import RolloutContext

SERVER_OPTIONS = ("max_model_len", "kv_cache_gib", "dtype", "gpu_memory_utilization", "enforce_eager", "cpus", "gpus",
                  "startup_timeout_s", "extra_args")  # fmt: skip


# -- the command line ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = StrictParser(
        prog="uv run -m orchestrate.eval",
        description="Evaluate a checkpoint, a run, a model or a server: pass@k, maj@k, mean reward with 95% "
        "intervals, per-task results, tapes; --compare A B for a paired comparison.",
        epilog="Options --env.*, --agent.*, --program.* and --server.* override the run's config (or the preset's).",
    )
    parser.add_argument("target", nargs="?", help="RUN, RUN@N, a model folder, a model name, or a server's URL")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="evaluate A and B on the same tasks: B - A")
    parser.add_argument("--version", type=int, help="of a run: this version (0: the initial model)")
    parser.add_argument(
        "--versions",
        help="of a run: these versions one after another on one server, and their "
        "learning curve: all (those with weights on disk), or N,M and ranges A-B (B included)",
    )
    parser.add_argument(
        "--step", type=int, help="with --versions: the versions that are multiples of STEP, and the newest"
    )
    parser.add_argument("--config", help="the run config.json whose environment and agent to use [default: the target's run's]")  # fmt: skip
    parser.add_argument("--preset", help=f"this preset's environment and agent ({', '.join(presets())}) [default: the target's run's config, else embedded]")  # fmt: skip
    parser.add_argument("--split", default="test", choices=("test", "train"), help="the split [default: test]")
    parser.add_argument("--tasks", help="N (the first N) or A:B (tasks A to B-1) [default: eval.tasks, else all; 500 of a split without an end]")  # fmt: skip
    parser.add_argument("--n", type=int, default=1, help="samples per task [default: 1]")
    parser.add_argument("--temperature", type=float, help="[default: eval.temperature with --n 1, else rollouts.temperature]")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, help="new tokens per LLM call [default: eval.max_tokens]")
    parser.add_argument("--k", help="pass@k for these k, comma-separated [default: 1, 2, 4, ... n]")
    parser.add_argument("--key-file", help="a server's API key file [default: $VLLM_API_KEY]")  # fmt: skip
    parser.add_argument("--max-concurrency", type=int, help="episodes' calls in flight [default: rollouts.max_concurrency]")  # fmt: skip
    parser.add_argument("--role", help="several agents in an episode (agent.roles): this role's figures (its reward; success: above 0) [default: the episode's]")  # fmt: skip
    parser.add_argument("--out", help="output folder [default: RUN/evals/LABEL, else runs/evals/NAME-LABEL]")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_options(parser, EnvSection, "env.", defaults=False)
    from agents.agent import AgentConfig

    add_options(parser, AgentConfig, "agent.", defaults=False)
    add_options(parser, ProgramSection, "program.", defaults=False)
    add_options(parser, ServerSection, "server.", defaults=False, only=SERVER_OPTIONS, note="the target's server: ")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # parse, then resolve: every option checked before anything starts
        refuse_repeated(argv)
        argv, env_options = split_env_options(argv)
        args = parser.parse_args(argv)
        s = resolve(args, env_options)
    except OptionError as exc:  # any refusal of the input: one line, exit 2
        parser.exit(2, f"error: {str(exc).splitlines()[0]}\n")
    from orchestrate.loop.run_lock import RunDirInUse
    from orchestrate.loop.setup import interrupting_signals
    from orchestrate.serving.llm import LLMError
    from orchestrate.serving.vllm_server import ServerError

    folders = folders_of(s)  # evaluate: each target into its folder
    records = []
    one = OneServer(s, s.out / "logs") if s.sweep else None
    try:
        with interrupting_signals():
            for target, folder in zip(s.targets, folders):
                records.append(evaluate(s, target, folder, progress=not args.no_progress, serve=one))
                print(f"{target.text}: {headline(records[-1], s.ks)}  ({folder / 'summary.md'})", flush=True)
    except KeyboardInterrupt:
        print("\nInterrupted. What finished is kept; run the same command again to play the rest.", file=sys.stderr)
        return 130
    except RunDirInUse as exc:
        print(f"error: --out: {exc}", file=sys.stderr)
        return 2
    except (LLMError, ServerError) as exc:
        print(f"error: {str(exc).splitlines()[0]}\nWhat finished is kept; run the same command again to play the "
              "rest.", file=sys.stderr)  # fmt: skip
        return 1
    finally:
        if one is not None:
            one.close()
    if s.sweep:  # report what the evaluations make together
        write_curve(s, records)
    elif len(records) == 2:
        write_comparison(s, folders)
    return 0


# -- one evaluation -------------------------------------------------------------------------------------


def evaluate(s: Settings, target: Target, folder: Path, progress: bool, serve=None) -> dict:
    """Evaluate one target into `folder` (resuming what it holds); its eval.json record. `serve(policy)`: a
    context giving the policy's PolicyServer (default: one started for it and stopped after)."""
    from agents.env_spec import EnvSpec
    from orchestrate.loop.eval_report import markdown, plot
    from orchestrate.loop.eval_stats import summarize
    from orchestrate.loop.evaluation import Appender, finished, play_tasks, tape_file, task_results
    from orchestrate.loop.run_lock import RunLock
    from orchestrate.loop.setup import PolicyServer, build_agent
    from tapes.tape import SamplingParams

    folder.mkdir(parents=True, exist_ok=True)
    lock = RunLock(folder, "an evaluation").acquire()
    try:
        atomic_write_json(folder / "config.json", s.config.model_dump(mode="json"))
        path = tape_file(folder, target.policy.version)
        done = finished(path, s.n, trim=True)
        todo = [seed for seed in s.seeds if seed not in done]
        spec = EnvSpec.from_config(s.config, s.split)
        sampling = SamplingParams(temperature=s.temperature, max_tokens=s.max_tokens)
        started = time.perf_counter()
        print(f"{target.text}: {target.policy.note}; {len(s.seeds)} tasks of {s.config.env.id} ({s.split}) x {s.n} "
              f"at temperature {s.temperature:g}" + (f"; {len(done)} done before, {len(todo)} to play" if done else ""),
              flush=True)  # fmt: skip
        if todo:

            def own_server(policy):
                return PolicyServer(policy, s.config, folder / "logs", s.key_file)

            appender = Appender(path)
            try:
                with (
                    build_agent(s.config, _tokenizer(target.policy, s.config)) as agent,
                    (serve or own_server)(target.policy) as served,
                ):

                    async def play():
                        async with served.client(s.max_concurrency) as client:
                            context = RolloutContext(agent, spec, client, 0, target.policy.version, sampling)
                            await play_tasks(context, todo, s.n, done=appender, progress=progress,
                                             desc=f"eval {target.text}")  # fmt: skip

                    asyncio.run(play())
            finally:
                appender.close()
        seconds = time.perf_counter() - started
        done = finished(path, s.n)
        tapes = [t for seed in s.seeds for t in done.get(seed, [])]
        in_order = "".join(t.model_dump_json() + "\n" for t in tapes)
        if path.read_text(encoding="utf-8") != in_order:  # appended as tasks ended: kept in task order
            atomic_write_text(path, in_order)
        summary = summarize(task_results(tapes, s.role), s.ks)
        record = {"settings": s.record(target), "policy": target.policy.note, "config": s.config_source,
                  "tapes": str(path), "seconds": round(seconds, 3), "role": s.role, **summary}  # fmt: skip
        atomic_write_json(folder / "eval.json", record)
        role = f", role {s.role}" if s.role else ""
        atomic_write_text(folder / "summary.md", markdown(summary, f"{target.text} ({target.policy.note}{role})"))
        plot(summary, folder / "pass_at_k.png")
        return record
    finally:
        lock.release()


def _tokenizer(policy: Policy, config: RLConfig):
    """The served model's tokenizer when it is a folder here that has one, else the run's policy's."""
    from transformers import AutoTokenizer

    from orchestrate.loop.setup import load_tokenizer

    if not policy.url and (policy.model / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(policy.model)
    return load_tokenizer(config)


class OneServer:
    """--versions: one server for all the versions, started for the first that has tasks to play and switched
    to each next one (PolicyServer.switch: its weights reloaded, or its adapter loaded), stopped at the end."""

    def __init__(self, s: Settings, logs: Path):
        self.s, self.logs, self.served = s, logs, None

    @contextmanager
    def __call__(self, policy: Policy):
        from orchestrate.loop.setup import PolicyServer

        if self.served is None:
            self.served = PolicyServer(policy, self.s.config, self.logs, self.s.key_file, switches=True).start()
        elif self.served.policy != policy:
            self.served.switch(policy)
        yield self.served

    def close(self) -> None:
        if self.served is not None:
            self.served.stop()


if __name__ == "__main__":
    sys.exit(main())
