"""One run set-up that every command shares: what a command needs, built from a run's config.

- the agent (`build_agent`): the built-in ChatAgent or an agent program through the gateway, one interface;
- the policy to sample from (`Policy`: a run's newest servable checkpoint or version N, a checkpoint or model
  folder, a model by name, a server that runs) and its server, started and stopped here (`PolicyServer`);
- the reference scorer for tapes (`score_reference`): a reference model served for the pass, or a server by URL;
- the teacher's model folder (`teacher_folder`: a model, or a run's newest checkpoint with weights);
- the loop's servers and learner, in the order they must start (`RunSetup.start`).

The loop (orchestrate.loop.iteration), eval (orchestrate.eval), fork, replay and offline (orchestrate.after)
build these here; the servers themselves are built in orchestrate.serving.launch, and nothing here calls a
server's private methods.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agents.agent import Agent, ChatAgent
from agents.chat import ChatTokens
from agents.env_spec import EnvSpec
from contract.rundir import CHECKPOINT_NAME, RunDir
from orchestrate.loop.config import RLConfig
from tapes.tape import SamplingParams, Tape


class SetupError(ValueError):
    """Bad input found while setting up (a model, a checkpoint, a server): one line naming the option."""


# -- the agent --------------------------------------------------------------------------------------


def build_agent(config: RLConfig, tokenizer) -> Agent:
    """The agent a run uses (replay and offline build it the same way from the run's config): the built-in
    ChatAgent, or the program of `--agent.program` through the gateway (orchestrate.gateway.agent) with the
    options of `--program.*`. Use it as `with build_agent(...) as agent:` (a program's gateway is closed)."""
    r, a = config.rollouts, config.agent
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens)
    if not a.plays_program:
        return ChatAgent(a, sampling, ChatTokens(tokenizer), max_context=config.server.max_model_len)
    from orchestrate.gateway.agent import ProgramAgent

    p, spec = config.program, EnvSpec.from_config(config, "train")
    program, reward, isolation, limit = a.program, p.reward, p.isolation, p.time_limit_s
    if a.command is not None:  # a harness: a subprocess of its own already, played from a thread
        from agents.harness import HarnessProgram
        from agents.program import load_reward

        program = HarnessProgram(a.command, time_limit_s=p.time_limit_s, memory_mb=p.memory_mb,
                                 max_output_chars=p.max_output_chars, reward=load_reward(reward) if reward else None)  # fmt: skip
        reward, isolation, limit = None, "thread", p.time_limit_s + 30  # the harness's own limit ends it first
    return ProgramAgent(program, sampling, tokenizer, max_context=config.server.max_model_len,
                        tool_parser=p.tool_parser, time_limit_s=limit, host=p.gateway_host,
                        port=p.gateway_port, sandbox=spec.sandbox, reward=reward, isolation=isolation)  # fmt: skip


def load_tokenizer(config: RLConfig):
    from transformers import AutoTokenizer

    from orchestrate.serving.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(config.model.policy))


def read_run_config(path: Path, option: str = "--config") -> RLConfig:
    """A run's config.json, validated; SetupError in one line when it is missing or is not one."""
    if not path.is_file():
        raise SetupError(f"{option}: {path} not found; pass the run's config.json")
    try:
        return RLConfig.model_validate(json.loads(path.read_text()))
    except Exception as exc:  # noqa: BLE001 - any way it is not a run config is the same one line
        raise SetupError(f"{option} {path}: not a run config ({str(exc).splitlines()[0]})") from None


def agent_from_run_config(config_path: Path) -> Agent:
    """The run's agent, for the tools that play its tapes again (replay, fork): a program's gateway on any free
    port, not the run's --program.gateway_port, which the run itself may be holding."""
    config = read_run_config(config_path)
    config.program = config.program.model_copy(update={"gateway_port": 0})
    return build_agent(config, load_tokenizer(config))


# -- the policy to sample from ----------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """What live calls are sampled from."""

    model: Path  # the folder the server serves (a LoRA version: the base model)
    version: int  # recorded on the calls (LLMCall.policy_version) and the tapes' metadata
    name: str  # recorded as the calls' model
    adapter: Path | None = None  # a LoRA run's version: its adapter, loaded on the base
    note: str = ""  # where it comes from, for the console
    url: str | None = None  # a server that runs (used as it serves now), else one is started


def checkpoint_number(folder: Path) -> int:
    """N for a folder RUN/checkpoints/N (a version of a run), else 0."""
    m = CHECKPOINT_NAME.match(folder.name)
    return int(m.group(1)) if m and folder.parent.name == "checkpoints" else 0


def servable_versions(run: RunDir, config: RLConfig) -> list[int]:
    """A run's published versions that can be served, oldest first: their weights on disk (a LoRA run: their
    adapter). Version 0, the initial model, is not listed: it always can."""
    lora = config.train.lora.rank > 0
    return [i for i in run.published() if (run.has_adapter(i) if lora else run.has_weights(i))]


def run_policy(run: RunDir, config: RLConfig, version: int | None = None, option: str = "--model") -> Policy:
    """A run's policy: version `version` (0: the initial model), else its newest checkpoint that can be served
    (its weights on disk, or for a LoRA run its adapter), else the initial model before any. SetupError when
    that version has no weights on disk (sent to the servers in memory, or dropped by keep_checkpoints)."""
    from orchestrate.serving.models import resolve_model

    published = run.published()
    lora = config.train.lora.rank > 0
    servable = servable_versions(run, config)
    initial = Policy(resolve_model(config.model.policy), 0, config.model.policy,
                     note=f"the initial policy {config.model.policy}")  # fmt: skip
    if version == 0:
        return initial
    if version is None and not published:
        return replace(initial, note=initial.note + " (the run has no checkpoint yet)")
    if version is not None and version not in servable:
        have = ", ".join(map(str, servable)) or "none"
        why = "not published" if version not in published else "its weights went to the servers in memory"
        raise SetupError(f"--version {version}: {run.root} has no such version on disk ({why}); versions with "
                         f"weights on disk: {have} (0: the initial model)")  # fmt: skip
    if not servable:
        raise SetupError(f"{option}: no checkpoint of {run.root} has its weights on disk (version {published[-1]}'s "
                         "went to the servers in memory; a clean stop writes them); pass --model MODEL")  # fmt: skip
    asked, version = version, version if version is not None else servable[-1]
    # the newest servable version was taken: say so when a newer one exists whose weights went in memory
    newer = (
        f"; version {published[-1]} is newer, its weights went in memory"
        if asked is None and published[-1] > version
        else ""
    )
    if lora:
        return Policy(resolve_model(config.model.policy), version, config.model.policy, run.adapter(version),
                      note=f"version {version} ({run.adapter(version)}{newer})")  # fmt: skip
    return Policy(run.checkpoint(version), version, config.model.policy,
                  note=f"version {version} ({run.checkpoint(version)}{newer})")  # fmt: skip


def given_policy(model: str, option: str = "--model") -> Policy:
    """A model folder (a run's checkpoint N: version N), a hub id or the embedded model's name."""
    from orchestrate.serving.models import ModelNotAvailable, resolve_model

    try:
        folder = Path(resolve_model(model))
    except ModelNotAvailable as exc:
        raise SetupError(f"{option}: {str(exc).splitlines()[0]}") from None
    version = checkpoint_number(folder)
    return Policy(folder, version, model, note=f"{model}" + (f" (version {version})" if version else ""))


def remote_policy(url: str, key_file: str | None, option: str = "--url", key_option: str = "--key-file") -> Policy:
    """The policy server at `url`, checked (it answers, takes the key, serves 'policy'), as it serves now."""
    from orchestrate.loop.preflight import PreflightError, remote_server
    from orchestrate.serving.auth import APIKeyMissing, read_api_key

    try:
        server = remote_server(option, url, "policy", read_api_key(key_file, option=key_option))
    except (APIKeyMissing, PreflightError) as exc:
        raise SetupError(str(exc).splitlines()[0]) from None
    root = server.model_root()
    return Policy(Path(root), checkpoint_number(Path(root)), root, note=f"the server at {url} ({root})", url=url)


class PolicyServer:
    """A policy, served: a vLLM server started for it with the run's server settings (its GPUs, cores, context
    length, KV cache; a LoRA version's adapter loaded under its name), or the server that runs at its URL;
    `client()` calls it, recording the policy's version and name. `with PolicyServer(...) as served:`."""

    def __init__(self, policy: Policy, config: RLConfig, logs: Path, key_file: str | None = None,
                 log_name: str = "policy", switches: bool = False):  # fmt: skip
        self.policy, self.config, self.logs, self.key_file, self.log_name = policy, config, logs, key_file, log_name
        self.switches = switches  # other versions of the run will be served after this one (`switch`)
        self.server = None

    @property
    def log_path(self) -> Path | None:
        return None if self.policy.url else self.logs / f"{self.log_name}.log"

    def start(self) -> PolicyServer:
        from orchestrate.loop.config_checks import gpu_slices
        from orchestrate.serving.auth import read_api_key
        from orchestrate.serving.launch import policy_servers, remote_servers
        from orchestrate.serving.models import untied_copy
        from orchestrate.serving.processes import parse_cpus
        from orchestrate.serving.vllm_server import adapter_name

        p, s = self.policy, self.config.server
        if p.url:
            self.server = remote_servers([p.url], role="policy", api_key=read_api_key(self.key_file))[0]
            return self
        gpus = [gpu_slices(s.gpus, 1, s.tensor_parallel_size * s.data_parallel_size)[0]] if s.gpus else None
        # a server whose weights will be reloaded serves an untied folder from the start (untied_copy says why)
        lora = self.config.train.lora.rank if p.adapter or self.switches else 0
        model = untied_copy(p.model) if self.switches and not lora else p.model
        (self.server,) = policy_servers(model, s, self.logs, gpus=gpus, cpus=parse_cpus(s.cpus) if s.cpus else None,
                                        seed=self.config.run.seed, reloads=False, log_name=self.log_name,
                                        lora_rank=lora)  # fmt: skip
        self.server.start()
        try:
            if p.adapter is not None:
                self.server.load_adapter(adapter_name(self.server.served_model_name, p.version), p.adapter.resolve())
        except Exception:
            self.server.stop()
            raise
        return self

    def switch(self, policy: Policy) -> None:
        """Serve another version of the same run on the running server (started with `switches`): its weights
        reloaded from disk (an untied copy where the folder ties its head), or, for a LoRA run, its adapter
        loaded in place of the one served before (version 0: the base model, no adapter)."""
        from orchestrate.serving.models import untied_copy
        from orchestrate.serving.vllm_server import adapter_name

        if not self.switches or self.policy.url:
            raise RuntimeError("PolicyServer.switch: a server started with switches=True, not one by URL")
        name = self.server.served_model_name
        if policy.adapter is not None:
            self.server.load_adapter(adapter_name(name, policy.version), policy.adapter.resolve())
        elif policy.model != self.policy.model:  # another folder of weights (a LoRA run's base never changes)
            self.server.reload_weights(untied_copy(policy.model), verify=False)  # the prefix cache reset with it
        if self.policy.adapter is not None:  # the adapter served before is not needed again
            self.server.unload_adapter(adapter_name(name, self.policy.version))
        self.policy = policy

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()  # a server by URL is not ours: RemoteServer.stop leaves it running

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def client(self, max_concurrency: int | None = None):
        """A client of the server (`async with`), each call recording the policy's version."""
        from orchestrate.serving.llm import VLLMClient
        from orchestrate.serving.vllm_server import adapter_name

        p = self.policy
        adapter = adapter_name(self.server.served_model_name, p.version) if p.adapter is not None else None
        return VLLMClient([self.server], model=p.name, policy_version=p.version,
                          max_concurrency=max_concurrency or self.config.rollouts.max_concurrency,
                          adapter=(lambda _: adapter) if adapter else None)  # fmt: skip


# -- the reference scorer ---------------------------------------------------------------------------


def score_reference(tapes: list[Tape], reference: Path | Any, settings, log_path: Path, progress: bool = True) -> None:
    """Reference log-probs on every LLM call of `tapes` from a vLLM server: `reference` is a model folder,
    served by a server started for this and stopped after, or a running server (checked, by URL)."""
    from orchestrate.loop.reference import annotate_reference
    from orchestrate.serving.launch import reference_server
    from orchestrate.serving.llm import VLLMClient

    server = reference_server(reference, settings, log_path) if isinstance(reference, Path) else reference
    name = str(reference) if isinstance(reference, Path) else reference.url
    with server:  # a server by URL is neither started nor stopped here

        async def go():
            async with VLLMClient([server], tokenizer=None, model=name) as client:
                await annotate_reference(tapes, client, progress=progress)

        asyncio.run(go())


def is_run_dir(run: RunDir) -> bool:
    """Whether the folder holds a run: a config.json that is a run's (sections such as `model`), not a model's
    (`model_type`)."""
    try:
        saved = json.loads(run.config_path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and "model" in saved and "model_type" not in saved


def teacher_folder(model: str, option: str = "--teacher.model") -> Path:
    """The teacher's model folder: a run directory's newest checkpoint with its weights on disk, else a model
    folder or name (resolve_model). SetupError in one line: a LoRA run (its versions are adapters), a run
    with no checkpoint on disk, a model that cannot be had."""
    run = RunDir(Path(model).expanduser())
    if not is_run_dir(run):
        return given_policy(model, option).model
    config = read_run_config(run.config_path, option)
    if config.train.lora.rank:
        raise SetupError(f"{option}: {run.root} is a LoRA run, whose versions are adapters; fold one into a model "
                         f"folder (uv run -m orchestrate.after.merge {run.root} --out DIR) and give that")  # fmt: skip
    policy = run_policy(run, config, option=option)
    if policy.version == 0:
        raise SetupError(f"{option}: {run.root} has no checkpoint yet; give a run that has trained, or a model")
    return policy.model


# -- the loop's servers and learner ------------------------------------------------------------------


class RunSetup:
    """What the RL loop runs on, built from its config: the model folders, the tokenizer, the agent, the
    servers and the learner, started in the order they must start."""

    def __init__(self, config: RLConfig, run: RunDir, progress: bool = True):
        from orchestrate.serving.models import resolve_model

        self.config, self.run, self.progress = config, run, progress
        self.policy_dir = resolve_model(config.model.policy)
        self.reference_dir = resolve_model(config.model.reference) if config.model.reference else self.policy_dir
        t = config.teacher
        self.teacher_dir = teacher_folder(t.model) if t.model and not t.url else None  # by URL: its server's
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.policy_dir)
        return self._tokenizer

    def agent(self, stack: ExitStack):
        """The run's agent, closed (a program's gateway stopped) when `stack` closes."""
        return stack.enter_context(build_agent(self.config, self.tokenizer))

    def start(self, stack: ExitStack):
        """(servers, trainer), started: the trainer before the servers start (it loads its model meanwhile);
        colocated on a GPU, after them (each server measured the GPU's free memory alone); then the weight
        path, and the version the trainer resumes at served. Each is stopped when `stack` closes."""
        from orchestrate.loop.servers import Servers
        from orchestrate.loop.trainer import TrainerProcess

        c = self.config
        servers = Servers.for_run(c, self.run, self.policy_dir, self.reference_dir, self.tokenizer,
                                  progress=self.progress, teacher_dir=self.teacher_dir)  # fmt: skip
        train = c.train.model_copy(
            update={
                "colocated": servers.colocated,
                "teacher_coef": c.teacher_coef,
                "teacher_topk_coef": c.teacher_topk_coef,
            }
        )
        if c.run.async_level and c.train.max_lag is None:  # it trains nothing more than K versions old
            train = train.model_copy(update={"max_lag": c.run.async_level})
        trainer = TrainerProcess(self.run, self.policy_dir, train, c.trainer)
        if not servers.colocated:
            trainer.start()
            stack.callback(trainer.stop)
        servers.launch(stack)
        if servers.colocated:
            trainer.start()
            stack.callback(trainer.stop)
        servers.use(trainer)
        stack.callback(servers.close)
        servers.resume()
        return servers, trainer


@contextmanager
def interrupting_signals():
    """Ctrl-C (SIGINT) and SIGTERM raise KeyboardInterrupt at once, wherever a command is (the loop, an
    evaluation), so that its exits stop the children and it ends with its resume line; the handlers from before
    are restored after.

    Left to itself, asyncio.run turns a SIGINT into a cancel of its task, and a cancel can be swallowed inside
    an LLM call: a Ctrl-C in a real run's rollouts was lost and the run went on. With a handler of our own,
    asyncio.run leaves SIGINT alone. A SIGINT ignored from the start (nohup, a shell's `&`) stays ignored, and a
    note says so with the command's process id for SIGTERM."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:  # a `kill -INT` would do nothing, silently: say what stops it
        print(
            f"note: SIGINT is ignored in this process (started with nohup or in the background): stop it with "
            f"SIGTERM (kill {os.getpid()}); what finished is kept.",
            flush=True,
        )
    signals = [signal.SIGTERM] + ([] if ignored else [signal.SIGINT])
    before = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, previous in before.items():
            if previous is not None:  # None: set outside Python, cannot be put back
                signal.signal(sig, previous)
