"""A CLI agent harness as a command, one run per episode: Codex, mini-swe-agent, Claude Code, a script of yours.

    uv run -m orchestrate.rl --agent.command "codex exec --skip-git-repo-check {prompt}" --env.id code

The command runs in a fresh workspace of its own (the environment's task files written there where it has
them: `agents.envs.base.HasWorkspace`), in a new session (its process group), with the episode's gateway as
its model server:

    OPENAI_BASE_URL, OPENAI_API_BASE    the episode's OpenAI base URL (".../v1")
    ANTHROPIC_BASE_URL                  the same without "/v1" (Anthropic's clients add it)
    OPENAI_API_KEY, ANTHROPIC_API_KEY, ANTHROPIC_AUTH_TOKEN    the run's key
    TAPELOOP_MODEL, OPENAI_MODEL, ANTHROPIC_MODEL              the model name to send (with roles: the first's)
    TAPELOOP_ROLES                      the run's roles (--agent.roles), comma-separated: each a model name

and the placeholders `{prompt}`, `{model}`, `{base_url}`, `{workspace}` in the command replaced (each quoted
for the shell); with no `{prompt}` the task's prompt comes on standard input. Limits: wall time (the whole
group is killed at it, and at the episode's end: children it left behind go with it), address space per
process (`memory_mb`), and output: the last `max_output_chars` of what it printed (stdout and stderr) are
kept on the tape, the rest counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 2**20
VIEW = Path("/tmp/tapeloop-workspace")  # where a harness sees its workspace, the same in every episode (fixed_view)
TERM_GRACE_S = 1.0  # between SIGTERM and SIGKILL for the group


class HarnessError(ValueError):
    """A harness command that cannot run at all (not found, not executable): one line, a setup error."""


@dataclass
class HarnessResult:
    """How one run of a harness ended."""

    exit_code: int | None  # None: killed at its time limit
    output: str  # the last max_output_chars of its stdout and stderr
    dropped_chars: int  # what it printed before those
    timed_out: bool
    seconds: float

    def describe(self) -> str:
        how = "ran past its time limit and was killed" if self.timed_out else f"exited with status {self.exit_code}"
        return f"the harness {how} after {self.seconds:.1f} s"


def harness_argv(command: str, values: dict[str, str]) -> list[str]:
    """The command's words, placeholders replaced (each value one word whatever it holds)."""
    words = shlex.split(command)
    if not words:
        raise HarnessError("--agent.command: empty")
    out = []
    for word in words:
        for name, value in values.items():
            word = word.replace("{" + name + "}", value)
        out.append(word)
    return out


def check_command(command: str) -> None:
    """Refused in one line before a run starts: a command that is empty or whose program is not found."""
    import shutil

    program = harness_argv(command, {})[0]
    if "/" in program:
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise HarnessError(f"--agent.command: {program!r} is not an executable file")
    elif shutil.which(program) is None:
        raise HarnessError(f"--agent.command: {program!r} is not found on PATH")


def harness_environment(base_url: str, key: str, model: str, workspace: Path, roles: list[str] | None = None
                        ) -> dict[str, str]:  # fmt: skip
    """The harness's environment: this process's, its model server the episode's gateway, its home and
    working directory the workspace (as the harness sees it)."""
    env = dict(os.environ)
    for name in ("OPENAI_ORGANIZATION", "OPENAI_PROJECT", "ANTHROPIC_CUSTOM_HEADERS"):
        env.pop(name, None)
    root = base_url.removesuffix("/v1")
    env.update(OPENAI_BASE_URL=base_url, OPENAI_API_BASE=base_url, OPENAI_API_KEY=key, ANTHROPIC_BASE_URL=root,
               ANTHROPIC_API_KEY=key, ANTHROPIC_AUTH_TOKEN=key, TAPELOOP_MODEL=model, OPENAI_MODEL=model,
               ANTHROPIC_MODEL=model, HOME=str(workspace / ".home"), PWD=str(workspace))  # fmt: skip
    if roles:
        env["TAPELOOP_ROLES"] = ",".join(roles)
    else:
        env.pop("TAPELOOP_ROLES", None)
    return env


def fixed_view(workspace: Path, network: str = "host") -> list[str] | None:
    """The words that run a command with `workspace` seen at VIEW (bubblewrap, where installed; VIEW itself an
    empty folder outside): the rest of the machine as it is, a process namespace of its own (whatever the
    harness starts ends with it). A harness that writes its folder into its prompt (Codex does) then asks the same in every
    episode and in a replay. None without bubblewrap: the harness sees the real folder."""
    import shutil

    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None
    VIEW.mkdir(exist_ok=True)  # the mount point, empty outside every harness's namespace
    unshare = ["--unshare-pid"] + (["--unshare-net"] if network == "gateway" else [])
    return [bwrap, "--dev-bind", "/", "/", "--bind", str(workspace), str(VIEW), "--proc", "/proc", *unshare,
            "--die-with-parent", "--chdir", str(VIEW), "--"]  # fmt: skip


def through_gateway_only(base_url: str, unix_path: str) -> list[str]:
    """The words that run a command, inside a network namespace of its own, with the gateway's port on its
    loopback forwarded to the gateway's unix socket (agents/gateway_forward.py): the gateway's URL works there,
    nothing else does."""
    from urllib.parse import urlsplit

    port = urlsplit(base_url).port
    return [sys.executable, str(Path(__file__).with_name("gateway_forward.py")), str(port), unix_path, "--"]


async def run_harness(
    argv: list[str],
    *,
    workspace: Path,
    env: dict[str, str],
    stdin: str | None,
    time_limit_s: float,
    memory_mb: int | None = None,
    max_output_chars: int = 20_000,
) -> HarnessResult:
    """Run `argv` in `workspace` until it exits or `time_limit_s` passes; its whole process group is ended
    either way (and if this coroutine is cancelled)."""

    def limits() -> None:  # in the child, before exec
        if memory_mb:
            resource.setrlimit(resource.RLIMIT_AS, (memory_mb * MIB, memory_mb * MIB))

    start = time.monotonic()
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, cwd=workspace, env=env, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            preexec_fn=limits if memory_mb else None,
        )  # fmt: skip
    except (FileNotFoundError, PermissionError) as exc:
        raise HarnessError(f"--agent.command: {argv[0]!r} cannot be run ({exc.strerror})") from None
    kept = bytearray()
    dropped = 0

    async def read() -> None:
        nonlocal dropped
        while chunk := await process.stdout.read(65536):
            kept.extend(chunk)
            if len(kept) > 4 * max_output_chars:  # bytes; the characters are cut once decoded
                dropped += len(kept) - 4 * max_output_chars
                del kept[: len(kept) - 4 * max_output_chars]

    async def feed() -> None:
        if stdin is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                process.stdin.write(stdin.encode())
                await process.stdin.drain()
            process.stdin.close()

    timed_out = False
    reader = asyncio.ensure_future(read())
    try:
        await feed()
        # the harness's own exit: its returncode (wait() also waits for its output to close, which children it
        # left behind may hold open)
        deadline = time.monotonic() + time_limit_s
        while process.returncode is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        timed_out = process.returncode is None
    finally:
        await end_group(process)
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(reader, 5)
    text = kept.decode(errors="replace")
    cut = max(0, len(text) - max_output_chars)
    return HarnessResult(None if timed_out else process.returncode, text[cut:], dropped + cut, timed_out,
                         time.monotonic() - start)  # fmt: skip


async def end_group(process: asyncio.subprocess.Process) -> None:
    """SIGTERM the harness's process group, SIGKILL what is left after a grace: children it left behind
    (in its group) go with it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        if sig == signal.SIGTERM:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), TERM_GRACE_S)
    with contextlib.suppress(ProcessLookupError, TimeoutError):
        await asyncio.wait_for(process.wait(), 5)  # a child that left the group may hold its output open


class HarnessFailed(RuntimeError):
    """A harness run that leaves nothing to train on (killed at its limit, or failed before any model call)."""


@dataclass
class HarnessProgram:
    """An agent program that runs a harness command for each episode (`--agent.command`; the ProgramAgent
    plays it as it plays any program). The reward: a reward function of the tape and the workspace where
    one is given (`--program.reward MODULE:FUNCTION`, `def reward(tape, workspace) -> float`); else the
    environment's scoring of the workspace where it has one (HasWorkspace: the code environment runs its
    tests on the solution file left there); else the last reply, sent to the environment as any program's."""

    command: str
    time_limit_s: float = 600.0
    memory_mb: int | None = 8192
    max_output_chars: int = 20_000
    reward: Any = None  # a function of (tape, workspace) or of (tape)
    keep_workspace: bool = False  # for debugging: the folder is left where it is
    fixed_path: bool = True  # the harness sees its workspace at VIEW where bubblewrap is installed (fixed_view)
    network: str = "host"  # host: the machine's network; gateway: a namespace whose one way out is the gateway

    @property
    def name(self) -> str:
        return f"command: {self.command}"

    async def __call__(self, task: Any, client: Any) -> Any:
        import inspect
        import shutil
        import tempfile

        workspace = Path(tempfile.mkdtemp(prefix="tapeloop-harness-"))
        try:
            write_files(workspace, task.files)
            (workspace / ".home").mkdir()
            view = fixed_view(workspace, self.network) if self.fixed_path or self.network == "gateway" else None
            if self.network == "gateway":
                if view is None or not task.gateway_socket:
                    raise HarnessError("--program.network gateway: needs bubblewrap (apt-get install bubblewrap)")
                view += through_gateway_only(task.base_url, task.gateway_socket)
            seen = VIEW if view else workspace  # the folder as the harness sees it
            prompt = task.files.get("TASK.md") or task.observation  # the environment's words for a workspace
            values = {"prompt": prompt, "model": task.model, "base_url": task.base_url, "workspace": str(seen)}
            stdin = None if "{prompt}" in self.command else prompt
            result = await run_harness(
                [*(view or []), *harness_argv(self.command, values)], workspace=workspace, stdin=stdin,
                env=harness_environment(task.base_url, task.api_key, task.model, seen, task.roles),
                time_limit_s=self.time_limit_s, memory_mb=self.memory_mb, max_output_chars=self.max_output_chars,
            )  # fmt: skip
            from tapes.tape import HarnessOutput

            task.record(HarnessOutput(text=result.output, exit_code=result.exit_code, timed_out=result.timed_out,
                                      seconds=round(result.seconds, 3), dropped_chars=result.dropped_chars))  # fmt: skip
            if result.timed_out:
                raise HarnessFailed(f"{result.describe()} (program.time_limit_s)")
            if result.exit_code != 0 and task.calls() == 0:
                last = result.output.strip().splitlines()[-1:] or ["(no output)"]
                raise HarnessFailed(f"{result.describe()} before any call to the model: {last[0][:200]}")
            if self.reward is not None:
                takes = len(inspect.signature(self.reward).parameters)
                value = self.reward(task.tape, workspace) if takes >= 2 else self.reward(task.tape)
                return await value if inspect.isawaitable(value) else value
            return task.answer_from(workspace)  # None: the last reply goes to the environment
        finally:
            if not self.keep_workspace:
                shutil.rmtree(workspace, ignore_errors=True)


def harness_reward(path: str) -> bool:
    """Does the reward function `path` take the workspace too, (tape, workspace)?"""
    from agents.program import ProgramError, load_reward

    try:
        load_reward(path)
    except ProgramError:
        return True
    return False


def write_files(folder: Path, files: dict[str, str]) -> None:
    """The environment's task files into the workspace (relative paths inside it only)."""
    root = folder.resolve()
    for name, text in files.items():
        path = (folder / name).resolve()
        if root not in path.parents:
            raise ValueError(f"task file {name!r}: outside the workspace")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
