"""A vLLM server for a run, on this machine, for an orchestrator elsewhere to use by URL.

    export VLLM_API_KEY=...        # or: --key-file FILE (never the key itself on a command line)
    uv run -m orchestrate.serve --run-dir DIR [--role policy|reference|teacher] [--port 8000] [--print]

then, on the orchestrator's machine:

    uv run -m orchestrate.rl --run-dir DIR --server.policy_urls http://THIS-HOST:8000 [...]

(a reference server: --server.reference_url; a teacher's, started with --teacher.model MODEL: --teacher.model URL)

The command line is the one orchestrate/serving/vllm_server.py builds for the servers
the orchestrator starts itself (same model folder, dtype, context length,
log-prob mode, dev routes for weight reloads, API-key middleware), so a
server here behaves as a local one; it only listens on --host (default all
addresses) and a fixed --port. The run's options come from DIR/config.json
when the run exists (a --preset given is not used then), placed on this
machine as given here (--server.gpus, --server.reference_gpus, --server.cpus)
and with the teacher given here (--teacher.model); else from the same
options as `orchestrate.rl` (--preset, --model.policy, --server.*). The run
directory must be on a filesystem this machine shares with the orchestrator's, at the same path:
new weights are reloaded from DIR/checkpoints/N by path. --print prints the
command (its environment first, the key left out) instead of running it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from contract.cli import OptionError, given, refuse_repeated
from orchestrate.loop.command_line import parse_args
from orchestrate.loop.config import RLConfig
from orchestrate.loop.config_checks import gpu_slices
from orchestrate.serving.auth import KEY_ENV, read_api_key
from orchestrate.serving.launch import own_server
from orchestrate.serving.processes import format_cpus, parse_cpus
from orchestrate.serving.vllm_server import VLLMServer


def build_server(config: RLConfig, role: str, host: str, port: int, run_dir: Path,
                 teacher: Path | None = None) -> VLLMServer:  # fmt: skip
    """The server an orchestrator would start for `role`, listening on host:port (the model is resolved,
    and the policy's untied copy built, here; the teacher's folder is `teacher` when the checks resolved it)."""
    from orchestrate.serving.models import resolve_model, untied_copy

    policy = resolve_model(config.model.policy)
    if role == "policy":
        model = untied_copy(policy)  # as the orchestrator's own policy servers: reloads swap the head too
    elif role == "teacher":
        from orchestrate.loop.policy import teacher_folder

        model = teacher or teacher_folder(config.teacher.model)
    else:
        model = resolve_model(config.model.reference) if config.model.reference else policy
    s = config.server
    devices = s.gpus if role == "policy" else s.reference_gpus
    gpus = gpu_slices(devices, 1, s.tensor_parallel_size * s.data_parallel_size)[0] if devices else None
    cpus = parse_cpus(s.cpus) if s.cpus else None
    return own_server(model, s, run_dir / "logs" / f"{role}-{port}.log", role=role, host=host, port=port,
                      gpu_ids=gpus, cpus=cpus, seed=config.run.seed,
                      lora_rank=config.train.lora.rank if role == "policy" else 0)  # fmt: skip


def run_config(args, config: RLConfig) -> tuple[Path, RLConfig]:
    """The run directory and the settings to serve: a run that exists serves its own, a preset named or not
    (one job script starts a run's servers and, resubmitted, resumes it), placed on this machine's cores/GPUs
    as given here, and serving the teacher given here (a run that names its teacher by URL); else `config`,
    from the command line."""
    from orchestrate.loop.policy import read_run_config

    run_dir = Path(args.run_dir or Path("runs") / args.preset).resolve()
    saved = run_dir / "config.json"
    if not saved.is_file():
        return run_dir, config
    placement = {k: getattr(config.server, k) for k in ("gpus", "reference_gpus", "cpus")}
    teacher = config.teacher.model if "teacher.model" in given(args) else None
    config = read_run_config(saved, option="--run-dir")
    config.server = config.server.model_copy(update=placement)
    if teacher is not None:
        config.teacher = config.teacher.model_copy(update={"model": teacher})
    return run_dir, config


def check_served(config: RLConfig, role: str) -> Path | None:
    """vLLM and the model folders `role` needs, checked as the run checks them; the teacher's folder (role
    teacher), else None."""
    from orchestrate.loop.preflight import PreflightError, check_model, check_teacher, check_vllm

    check_vllm()
    policy = check_model(config.model.policy, "--model.policy")
    if role == "reference" and config.model.reference:
        check_model(config.model.reference, "--model.reference")
    if role != "teacher":
        return None
    if not config.teacher.model or config.teacher.url:
        raise PreflightError("--role teacher: give the teacher's model (--teacher.model MODEL)")
    return check_teacher(config.teacher.model, policy, config.model.policy)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--role", choices=("policy", "reference", "teacher"), default="policy")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--key-file", default=None)
    parser.add_argument("--print", action="store_true", dest="print_only")
    parser.add_argument("-h", "--help", action="store_true")
    argv = sys.argv[1:] if argv is None else argv
    try:
        refuse_repeated(argv)
        ours, rest = parser.parse_known_args(argv)
        if ours.help:
            print(__doc__.strip())
            print("\nOptions: --role policy|reference|teacher, --host H (default 0.0.0.0), --port P (default 8000), "
                  "--key-file FILE (default: $VLLM_API_KEY), --print; and those of `uv run -m orchestrate.rl --help-all` "
              "(what decides the server: --run-dir, --preset, --model.*, --server.*, --teacher.model, --train.lora.rank, "
              "--run.seed).")  # fmt: skip
            return 0
        if not 0 < ours.port < 65536:
            raise OptionError(f"--port: {ours.port} is not a port (1-65535)")
        args, config = parse_args(rest, resume=False)  # the rl options: exits 2 naming a bad one
        run_dir, config = run_config(args, config)
        teacher = check_served(config, ours.role)
        server = build_server(config, ours.role, ours.host, ours.port, run_dir, teacher=teacher)
        command = server.command()
        if ours.print_only:
            env = server.environment(base={})  # what we add to the environment
            settings = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items() if k != KEY_ENV)
            print(f"# the API key goes in ${KEY_ENV} (export it, never on the command line)")
            pin = f"taskset -c {format_cpus(server.cpus)} " if server.cpus else ""
            print(f"{settings} {pin}{shlex.join(command)}")
            return 0
        key = read_api_key(ours.key_file, option="--key-file")
    except OptionError as exc:  # any refusal of the input: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        return 2
    env = server.environment()
    env[KEY_ENV] = key
    print(f"serving {ours.role} ({server.model}) on http://{ours.host}:{ours.port}", file=sys.stderr, flush=True)
    if server.cpus:  # --server.cpus: this process and vLLM's, as for a server the orchestrator starts
        os.sched_setaffinity(0, server.cpus)
    os.execvpe(command[0], command, env)  # vLLM in place of this process: stopping it stops the server


if __name__ == "__main__":
    sys.exit(main())
