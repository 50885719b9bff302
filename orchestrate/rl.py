"""The RL loop: `uv run -m orchestrate.rl [--preset NAME] [--SECTION.OPTION VALUE ...]`.

Creates (or resumes) a run directory and runs the loop of orchestrate/loop/iteration.py
on it. `--help` lists the common options and `--help-all` every one (orchestrate/loop/command_line.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from contract.cli import OptionError
from contract.rundir import RunDir, RunDirError
from orchestrate.loop.command_line import parse_args
from orchestrate.loop.config import teacher_url, with_program_section
from orchestrate.loop.metrics import repair_metrics
from orchestrate.loop.preflight import PreflightError, check_remote_servers, check_run_dir_path, preflight
from orchestrate.loop.resume import config_differences, not_a_run_config, with_defaults
from orchestrate.loop.run_lock import RunDirInUse, RunLock

# Options that may change when a run is resumed: its length (iterations, and the time budget: a job under a
# time limit resumes with a new one), where its metrics also go (wandb, tensorboard), how long to wait for
# servers and the learner, and where they are: servers and trainer machines elsewhere may move (a run
# started here may resume on trainer machines, --trainer.launch external). A teacher given by URL may move to
# another URL too (`_check_resume`).
RESUMABLE = {"run.iterations", "run.max_minutes", "run.wandb", "run.tensorboard", "trainer.timeout_s",
             "server.startup_timeout_s", "server.policy_urls", "server.reference_url", "server.api_key_file",
             "trainer.launch", "trainer.num_machines", "trainer.main_process_ip", "trainer.main_process_port",
             "trainer.heartbeat_timeout_s"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    if args.print_config:
        print(config.model_dump_json(indent=2))
        return 0
    for flag, module in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        if getattr(config.run, flag):
            import importlib.util

            if importlib.util.find_spec(module) is None:
                print(f"error: --run.{flag}: the '{module}' package is not installed "
                      f"(run with `uv run --with {module} -m orchestrate.rl ...`)", file=sys.stderr)  # fmt: skip
                return 2

    run_dir = RunDir(args.run_dir or Path("runs") / args.preset)
    current = config.model_dump(mode="json")
    # Nothing is written to the run directory until the run can start: its path, its saved config and
    # state (under its lock when it exists), the task data and the models are checked first.
    lock = None
    try:
        check_run_dir_path(run_dir.root)
        if run_dir.root.is_dir():
            lock = RunLock(run_dir.root).acquire()  # an flock on the folder: writes nothing
            _check_resume(run_dir, current)
        models = preflight(config)  # the model folders, checked: resolved once, for the set-up
        check_remote_servers(config, run_dir.root)
        if lock is None:
            try:
                run_dir.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise PreflightError(f"--run-dir: cannot create {run_dir.root} ({exc.strerror or exc})") from None
            lock = RunLock(run_dir.root).acquire()
            _check_resume(run_dir, current)  # another command may have started it meanwhile
    except (OptionError, RunDirError, RunDirInUse, _Refused) as exc:  # OptionError: every check's refusal
        if lock is not None:
            lock.release()  # refused in-process (tests, benches): the directory is free again
        print(f"error: {exc}", file=sys.stderr)
        return 2
    state, resumed = run_dir.load_state(), run_dir.saved_config() is not None
    if resumed and state.completed_iteration >= config.run.iterations:
        lock.release()  # nothing to do: its config (and its iteration count) stays as it is
        print(f"{run_dir.root}: {state.completed_iteration} iterations are done, --iterations "
              f"{config.run.iterations} asks for no more (raise it to go on).")  # fmt: skip
        return 0
    if resumed and run_dir.played_nothing():
        print(f"Starting {run_dir.root} again: it played nothing before it stopped.")
    elif resumed:
        print(f"Resuming {run_dir.root} after iteration {state.completed_iteration}.")
        # records state.json does not count yet are redone, and written once then; a torn tail goes
        repair_metrics(run_dir.metrics_path, state.completed_iteration, state.evaluated)
    run_dir.create()
    run_dir.save_config(current)

    from orchestrate.loop.iteration import Loop
    from orchestrate.loop.samples import SampleError
    from orchestrate.loop.trainer import TrainerError
    from orchestrate.serving.llm import LLMError
    from orchestrate.serving.vllm_server import ServerError

    try:
        return Loop(config, run_dir, models=models)()
    except (TrainerError, ServerError, RunDirError, LLMError, SampleError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nInterrupted. Resume with: uv run -m orchestrate.rl --run-dir {run_dir.root}", file=sys.stderr)
        return 130
    finally:
        lock.release()


class _Refused(ValueError):
    pass


def _check_is_run_config(run_dir: RunDir, saved: dict) -> None:
    """A config.json that is not a run's (a model folder's, anything else's) is not resumed, nor written over.
    One of an earlier version is a run's: its differences are named by the resume check."""
    if why := not_a_run_config(saved):
        raise _Refused(f"--run-dir: {run_dir.config_path} is not a run's config ({why}); pass a new --run-dir")


def _check_resume(run_dir: RunDir, current: dict) -> None:
    """A saved run may be resumed with the same settings only (RESUMABLE aside), unless it played nothing yet
    (a bad option that only its servers refused); its state must be readable. A folder of other files is not
    taken for a run directory."""
    if foreign := run_dir.foreign():
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise _Refused(f"--run-dir: {run_dir.root} holds files of its own ({shown}) and no run (no config.json); "
                       "pass a new or empty directory")  # fmt: skip
    saved = run_dir.saved_config()
    if saved is not None:
        _check_is_run_config(run_dir, with_program_section(saved))
        saved = with_defaults(with_program_section(saved))  # a run of before the program section: moved
        changed = [name for name in config_differences(saved, current) if name not in RESUMABLE]
        if all(teacher_url((c.get("teacher") or {}).get("model")) for c in (saved, current)):
            changed = [name for name in changed if name != "teacher.model"]  # its server moved, as servers may
        if changed and run_dir.played_nothing():
            return  # started, failed before its first episode: it starts again with these settings
        if changed:
            raise _Refused(f"{run_dir.root} was started with other settings ({', '.join('--' + c for c in changed)}); "
                           "resume it with the same options, or pass a new --run-dir")  # fmt: skip
    run_dir.load_state()


if __name__ == "__main__":
    sys.exit(main())
