"""The agent of a run with `--agent.program`: the user's program plays each episode through the gateway.

`ProgramAgent.run_episode` has the built-in agent's shape (agents.agent.ChatAgent), so rollouts, evaluation,
replay and fork play programs as they play the built-in agent: the environment is reset from the episode's
seed, a session is opened on the gateway with the episode's LLM (the policy servers' client, or a tape's
recorded calls), the program runs with a client bound to it (in a thread of its own, on its own event loop:
a program that blocks its thread stalls no other episode and is still bounded by its time limit), and the
reward is settled (agents.program):

- the program's return: a number (finite) is the reward; a string, or (None) the last reply's text, is sent to
  the environment as the answer, unless the program stepped the environment itself (a string: unless those steps
  ended its episode);
- a program that made no call through the gateway leaves the episode with `metadata.error`: nothing to train;
- a program that raises, runs past `program.time_limit_s`, or made a request the gateway refused (its first
  fault) leaves the episode with `metadata.error` (where it raised: the program's own line, `program_frame`):
  an infrastructure failure, left out of training, never a zero reward. A failure of the servers themselves (LLMError) stops the run, as it does for the built-in agent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import sysconfig
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agents.agent import Agent, summarize
from agents.chat import ChatTokens
from agents.envs import capabilities
from agents.envs.base import jsonable
from agents.program import Program, ProgramTask, StepResult, finite_reward, load_program, load_reward
from agents.tool_format import ToolFormat
from orchestrate.gateway.processes import ProgramProcesses
from orchestrate.gateway.server import Gateway
from tapes.tape import EnvObservation, SamplingParams, Tape

MODEL_NAME = "policy"  # the model name the gateway serves: what a program passes as `model`


class ProgramAgent(Agent):
    """Plays episodes with an agent program; one gateway per agent (started by `start` or the first episode)."""

    def __init__(
        self,
        program: str | Program,
        sampling: SamplingParams,
        tokenizer: Any,
        *,
        max_context: int | None = None,
        tool_parser: str = "hermes",
        time_limit_s: float = 600.0,
        host: str = "127.0.0.1",
        port: int = 0,
        key: str | None = None,
        sandbox: Any = None,
        reward: str | Callable[[Tape], Any] | None = None,
        isolation: str = "thread",
        roles: Mapping[str, str] | Sequence[str] = (),
    ):
        # the episode's agents (agent.roles): each `model` name and its binding (a list: each bound to the policy)
        self.bindings = dict(roles) if isinstance(roles, Mapping) else dict.fromkeys(roles, "policy")
        self.roles = tuple(self.bindings)  # none: one agent, MODEL_NAME
        self.program = load_program(program) if isinstance(program, str) else program
        self.reward = load_reward(reward) if isinstance(reward, str) else reward
        self.name = program if isinstance(program, str) else (
            getattr(program, "name", None) or getattr(program, "__qualname__", "program"))  # fmt: skip
        self.sampling, self.max_context, self.time_limit_s = sampling, max_context, time_limit_s
        self.chat = ChatTokens(tokenizer)
        self.tool_format = ToolFormat(tokenizer, tool_parser)
        self.gateway = Gateway(host, port, key)
        self._sandbox = sandbox  # a Sandbox, or a callable that makes one (first use)
        self._sandbox_lock = threading.Lock()
        self.mismatches = 0  # calls, over this agent's episodes, that did not extend their predecessor
        if isolation not in ("thread", "process"):
            raise ValueError(f"isolation: {isolation!r} is not thread or process")
        if isolation == "process" and not isinstance(program, str):
            raise ValueError("isolation process: the program must be given as MODULE:FUNCTION (a process imports it)")
        # a process of its own per episode (orchestrate.gateway.forkserver), or a thread of the orchestrator's
        self.processes = ProgramProcesses(program) if isolation == "process" else None

    def start(self) -> None:
        self.gateway.start()

    def close(self) -> None:
        self.gateway.stop()
        if self.processes is not None:
            self.processes.close()

    async def _in_process(self, task: ProgramTask, session, step) -> Any:
        """The program in a child of the fork server (orchestrate.gateway.forkserver): its environment, sandbox
        and rewards reached through the gateway's control routes; what it returned, posted there. Past the time
        limit, when it exits without a result (os._exit, a crash) or when the episode is cancelled, its whole
        group is ended; the run goes on."""
        loop = asyncio.get_running_loop()
        posted: asyncio.Future = loop.create_future()

        async def python(body: dict[str, Any]) -> dict[str, Any]:
            return dataclasses.asdict(await asyncio.to_thread(self._run_python, str(body.get("code", ""))))

        async def reward(body: dict[str, Any]) -> dict[str, Any]:
            self._give(session, finite_reward(body.get("value"), "task.reward"), role=body.get("role"))
            return {}

        async def result(body: dict[str, Any]) -> dict[str, Any]:
            if not posted.done():
                posted.set_result(body)
            return {}

        async def step_json(body: dict[str, Any]) -> dict[str, Any]:
            return dataclasses.asdict(await step(str(body.get("action", ""))))

        session.control = {"step": step_json, "python": python, "reward": reward, "result": result}
        job = {"id": session.id, "observation": task.observation, "seed": task.seed, "info": task.info,
               "model": task.model, "roles": task.roles, "base_url": task.base_url, "api_key": task.api_key,
               "control": self.gateway.control_url(session.id), "time_limit_s": self.time_limit_s}  # fmt: skip
        pid, exited = await self.processes.run(job)
        try:
            await asyncio.wait({posted, exited}, timeout=self.time_limit_s, return_when=asyncio.FIRST_COMPLETED)
            if posted.done():
                report = posted.result()
            elif exited.done():
                raise ProgramRaised(f"nothing: its process exited with status {exited.result()} before it returned "
                                    "(os._exit, a signal or a crash)")  # fmt: skip
            else:
                raise TimeoutError
        finally:
            ProgramProcesses.end(pid)  # its whole group: a spinning program, children it left behind
            exited.cancel()
            self.processes.forget(session.id)
        task.stepped = bool(report.get("stepped"))
        if not report.get("ok"):
            raise ProgramRaised(f"{report.get('error')} ({report.get('where')})")
        return report.get("result")

    async def _play(self, task: ProgramTask) -> Any:
        """The program on its own thread's loop, with an OpenAI client for this episode: the gateway's app
        called directly (server.py, Gateway.asgi), its work handed to the episode's loop as a socket's is."""
        import httpx
        import openai

        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.gateway.asgi), timeout=self.time_limit_s)
        try:
            client = openai.AsyncOpenAI(base_url=task.base_url, api_key=self.gateway.key, max_retries=0,
                                        timeout=self.time_limit_s, http_client=http)  # fmt: skip
            return await self.program(task, client)
        finally:
            await http.aclose()

    def _run_python(self, code: str):
        """Run code in the agent's one Sandbox (made on first use; episodes call this from worker threads)."""
        with self._sandbox_lock:
            if self._sandbox is None:
                from agents.sandbox import Sandbox

                self._sandbox = Sandbox()
            elif not hasattr(self._sandbox, "run"):
                self._sandbox = self._sandbox()
        return self._sandbox.run(code)

    async def run_episode(self, env, seed: int, llm, tape: Tape, sampling: SamplingParams | None = None) -> Tape:
        """Play one episode of `env` from `seed` with the program, its calls answered by `llm`; extends `tape`."""
        sampling = sampling or self.sampling
        self.start()
        tape.metadata.author = self.name
        can = capabilities(env)
        observation, info = env.reset(seed=seed)
        first = EnvObservation(text=str(observation), turn=0, info=jsonable(info))
        first.metadata.agent, first.metadata.node = self.name, "env"
        tape.append(first)
        session = self.gateway.open(
            tape=tape, llm=llm, chat=self.chat, tool_format=self.tool_format, sampling=sampling,
            model_name=MODEL_NAME, max_context=self.max_context, loop=asyncio.get_running_loop(), roles=self.roles,
            bindings=self.bindings,
        )  # fmt: skip
        ended = False

        async def step(action: str) -> StepResult:
            nonlocal ended
            if ended:
                raise RuntimeError("the environment's episode has ended")
            answer = await env.astep(action) if can.async_step else env.step(action)
            text, reward, terminated, truncated, step_info = answer
            record = EnvObservation(text=str(text), turn=max(1, session.calls), reward=float(reward),
                                    terminated=bool(terminated), truncated=bool(truncated), info=jsonable(step_info))  # fmt: skip
            record.metadata.agent, record.metadata.node = self.name, "env"
            tape.append(record)
            ended = bool(terminated or truncated)
            return StepResult(str(text), float(reward), bool(terminated), bool(truncated), record.info)

        loop = asyncio.get_running_loop()

        async def step_here(action: str) -> StepResult:  # the program's thread -> the episode's loop
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(step(action), loop))

        def give(value: float, role: str | None) -> None:  # in order with the program's next call, as it is
            if role is not None and role not in session.last_turns:  # refused in the program's own thread
                raise ValueError(f"task.reward: role {role!r} has made no call yet: its reward has no turn to go on")
            loop.call_soon_threadsafe(self._give, session, value, "the program's reward", False, role)

        def record(step) -> None:  # in order with the program's next call, as a reward is
            step.metadata.agent, step.metadata.node = self.name, "program"
            loop.call_soon_threadsafe(tape.append, step)

        task = ProgramTask(
            observation=str(observation), seed=seed, info=jsonable(info), model=(self.roles or (MODEL_NAME,))[0],
            roles=list(self.roles),
            base_url=self.gateway.base_url(session.id), api_key=self.gateway.key,
            _step=step_here, _run_python=self._run_python, _reward=give, _record=record,
            _calls=lambda: session.calls, _tape=tape, gateway_socket=self.gateway.unix_path,
            files=env.workspace_files() if can.workspace else {},
            _answer_from=env.answer_from_workspace if can.workspace else None,
        )  # fmt: skip
        result: Any = None
        try:
            if self.processes is not None:
                result = await self._in_process(task, session, step)
            else:
                result = await in_own_thread(self._play(task), self.time_limit_s, name=f"program {session.id[:8]}")
        except TimeoutError:
            tape.metadata.error = (f"the program ran past its time limit of {self.time_limit_s:g} s "
                                   "(program.time_limit_s); it was cancelled, or left blocked in its thread")  # fmt: skip
        except ProgramRaised as exc:  # in its own process
            if session.server_error is None:
                tape.metadata.error = f"the program raised {exc}"
        except Exception as exc:  # noqa: BLE001 - the program's failure: on the tape, left out of training
            if session.server_error is None:
                where = program_frame(exc, self.program)
                tape.metadata.error = (f"the program raised {type(exc).__name__}: {exc} "
                                       f"({where.filename}:{where.lineno})")  # fmt: skip
        finally:
            self.gateway.close(session)
            self.mismatches += session.mismatches
        if session.server_error is not None:
            raise session.server_error  # the servers failed: the run stops, as with the built-in agent
        if tape.metadata.error is None and session.error is not None:
            tape.metadata.error = session.error
        if tape.metadata.error is None and session.calls == 0:
            tape.metadata.error = ("the program made no call through the gateway: nothing to train on (its calls "
                                   "go through the `client` it is given, or an OpenAI client at task.base_url)")  # fmt: skip
        if tape.metadata.error is None:
            try:
                await self._settle(result, session, step, task.stepped, ended)
            except Exception as exc:  # noqa: BLE001 - the environment failed: as a rollout keeps it
                tape.metadata.error = f"{type(exc).__name__}: {exc}"
        summarize(tape)
        return tape

    def _give(self, session, value: float, reason: str = "the program's reward", end: bool = False,
              role: str | None = None) -> None:  # fmt: skip
        """A reward for the latest call's turn, or `role`'s latest call's (agent.roles), on the tape."""
        if role is None:
            turn = max(1, session.calls)
        elif role in session.last_turns:
            turn = session.last_turns[role]
        else:
            raise ValueError(f"a reward for role {role!r}, which made no call: it has no turn to go on")
        info: dict[str, Any] = {"reason": reason} if role is None else {"reason": reason, "role": role}
        record = EnvObservation(text="", turn=turn, reward=float(value), terminated=end, info=info)
        record.metadata.agent, record.metadata.node = self.name, "program"
        session.tape.append(record)

    async def _settle(self, result: Any, session, step, stepped: bool, ended: bool) -> None:
        """The episode's reward from what the program returned (agents.program): a string after the program's
        own steps ended the environment's episode is not sent (the rewards they gave stand)."""
        if isinstance(result, str):
            if not (stepped and ended):
                await step(result)
        elif self.roles and isinstance(result, dict):
            self._give_roles(session, result)
        elif result is not None and self.roles:  # every role's (a team's reward): each on its own last turn
            value = finite_reward(result, "the program's return")
            self._give_roles(session, dict.fromkeys(session.last_turns, value))
        elif result is not None:
            self._give(session, finite_reward(result, "the program's return"), end=True)
        elif stepped:
            return
        elif self.reward is not None:
            value = self.reward(session.tape)
            value = await value if inspect.isawaitable(value) else value
            value = finite_reward(value, "the reward function")
            if self.roles:  # the episode's reward, every role's (as a returned number)
                self._give_roles(session, dict.fromkeys(session.last_turns, value))
            else:
                self._give(session, value, reason="the reward function's", end=True)
        else:
            await step(session.last_reply)

    def _give_roles(self, session, rewards: dict[str, Any]) -> None:
        """Each role's reward (a program's return by role) on its last call's turn; a role that is not the run's,
        or made no call, is refused (ValueError: the episode is left out of training, the reason on its tape)."""
        for role in rewards:
            if role not in self.roles:
                raise ValueError(f"the program returned a reward for {role!r}, which is not a role of this run "
                                 f"({', '.join(self.roles)})")  # fmt: skip
            if role not in session.last_turns:
                raise ValueError(f"the program returned a reward for role {role!r}, which made no call")
        values = {role: finite_reward(value, f"the program's return[{role!r}]") for role, value in rewards.items()}
        for i, (role, value) in enumerate(values.items()):
            self._give(session, value, "the program's return", end=i == len(values) - 1, role=role)


async def in_own_thread(coroutine, time_limit_s: float, name: str = "program") -> Any:
    """Run `coroutine` on an event loop of its own in a thread of its own; its result or exception, or
    TimeoutError past `time_limit_s`. A program that blocks its thread (a synchronous sleep or HTTP call)
    then stalls only itself, and is bounded all the same: past the limit its tasks are cancelled and, if it
    does not return, its thread is left behind (a daemon) and the episode goes on without it."""
    episode_loop = asyncio.get_running_loop()
    done = episode_loop.create_future()
    own = asyncio.new_event_loop()

    def settle(outcome: tuple[bool, Any]) -> None:
        if not done.done():
            ok, value = outcome
            done.set_result(value) if ok else done.set_exception(value)

    def run() -> None:
        asyncio.set_event_loop(own)
        try:
            outcome = (True, own.run_until_complete(coroutine))
        except Exception as exc:  # noqa: BLE001 - handed to the episode's loop whole
            outcome = (False, exc)
        except BaseException as exc:  # noqa: BLE001 - sys.exit() and the like end the program, never the run
            ended = ProgramExited(f"{type(exc).__name__}{_args(exc)}: it ended its episode, not the run")
            outcome = (False, ended.with_traceback(exc.__traceback__))
        finally:
            try:
                own.run_until_complete(own.shutdown_asyncgens())
                own.run_until_complete(own.shutdown_default_executor())
            finally:
                own.close()
        try:
            episode_loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:  # the episode's loop closed meanwhile (it gave up on this program)
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(done), time_limit_s)
    except (TimeoutError, asyncio.CancelledError):  # past the limit, or the episode cancelled: cancel its tasks
        done.cancel()
        try:
            own.call_soon_threadsafe(_cancel_all, own)
        except RuntimeError:  # its loop has closed: it ended meanwhile
            pass
        raise


class ProgramRaised(RuntimeError):
    """A program in its own process that raised (its message: the exception and where) or exited early."""


class ProgramExited(RuntimeError):
    """A program that raised SystemExit (sys.exit, exit()) or KeyboardInterrupt in its own thread."""


def _args(exc: BaseException) -> str:
    return f"({exc.args[0]!r})" if exc.args else ""


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()


def program_frame(exc: BaseException, program: Any) -> traceback.FrameSummary:
    """Where a program's exception is located: the last frame in the program's own module (not the openai
    client's, a framework's, or ours), else the last outside libraries and the standard library."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = _source_file(program)
    libraries = tuple(p for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                                  sysconfig.get_paths()["platlib"]} if p)  # fmt: skip
    for choose in (
        lambda f: own is not None and os.path.realpath(f.filename) == own,
        lambda f: not os.path.realpath(f.filename).startswith(libraries) and "site-packages" not in f.filename,
    ):
        mine = [f for f in frames if choose(f)]
        if mine:
            return mine[-1]
    return frames[-1]


def _source_file(program: Any) -> str | None:
    target = inspect.unwrap(program)
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(target)
    try:
        path = inspect.getsourcefile(target)
    except TypeError:
        return None
    return os.path.realpath(path) if path else None
