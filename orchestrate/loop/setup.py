"""One run set-up that every command shares: what a command needs, built from a run's config.

- the agent (`build_agent`): the built-in ChatAgent or an agent program through the gateway, one interface;
- the policy's server (`PolicyServer`), started and stopped here, for a policy resolved in orchestrate.loop.policy
  (a run's version, a checkpoint or model folder, a model by name, a server that runs);
- the reference scorer for tapes (`score_reference`): a reference model served for the pass, or a server by URL;
- the loop's servers and learner, in the order they must start (`RunSetup.start`), on the model folders the
  run's checks resolved (orchestrate.loop.policy.RunModels).

The loop (orchestrate.loop.iteration), eval (orchestrate.eval), fork, replay and offline (orchestrate.after)
build these here; the servers themselves are built in orchestrate.serving.launch, and nothing here calls a
server's private methods.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from agents.agent import Agent, ChatAgent
from agents.chat import ChatTokens
from agents.env_spec import EnvSpec
from contract.rundir import RunDir, role_adapters
from orchestrate.loop.config import RLConfig
from orchestrate.loop.policy import Policy, RunModels, read_run_config
from tapes.tape import SamplingParams, Tape

# -- the agent --------------------------------------------------------------------------------------


def build_agent(config: RLConfig, tokenizer) -> Agent:
    """The agent a run uses (replay and offline build it the same way from the run's config): the built-in
    ChatAgent, or the program of `--agent.program` through the gateway (orchestrate.gateway.agent) with the
    options of `--program.*`. Use it as `with build_agent(...) as agent:` (a program's gateway is closed)."""
    r, a = config.rollouts, config.agent
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens)
    if not a.plays_program and a.roles:  # the agents of a multi-agent environment, each a role
        from agents.multi_agent import MultiAgentChatAgent

        return MultiAgentChatAgent(a, sampling, ChatTokens(tokenizer), max_context=config.server.max_model_len)
    if not a.plays_program:
        return ChatAgent(a, sampling, ChatTokens(tokenizer), max_context=config.server.max_model_len)
    from orchestrate.gateway.agent import ProgramAgent

    p, spec = config.program, EnvSpec.from_config(config, "train")
    program, reward, isolation, limit = a.program, p.reward, p.isolation, p.time_limit_s
    if a.command is not None:  # a harness: a subprocess of its own already, played from a thread
        from agents.harness import HarnessProgram, harness_reward
        from agents.program import load_reward

        takes_workspace = reward is not None and harness_reward(reward)
        program = HarnessProgram(a.command, time_limit_s=p.time_limit_s, memory_mb=p.memory_mb,
                                 max_output_chars=p.max_output_chars, network=p.network,
                                 reward=load_reward(reward, workspace=takes_workspace) if reward else None)  # fmt: skip
        reward, isolation, limit = None, "thread", p.time_limit_s + 30  # the harness's own limit ends it first
    return ProgramAgent(program, sampling, tokenizer, max_context=config.server.max_model_len,
                        tool_parser=p.tool_parser, time_limit_s=limit, host=p.gateway_host,
                        port=p.gateway_port, sandbox=spec.sandbox, reward=reward, isolation=isolation,
                        roles=a.roles)  # fmt: skip


def load_tokenizer(config: RLConfig):
    from transformers import AutoTokenizer

    from orchestrate.serving.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(config.model.policy))


def agent_from_run_config(config_path: Path) -> Agent:
    """The run's agent, for the tools that play its tapes again (replay, fork): a program's gateway on any free
    port, not the run's --program.gateway_port, which the run itself may be holding."""
    config = read_run_config(config_path)
    config.program = config.program.model_copy(update={"gateway_port": 0})
    return build_agent(config, load_tokenizer(config))


# -- the policy's server ----------------------------------------------------------------------------


class PolicyServer:
    """A policy, served: a vLLM server started for it with the run's server settings (its GPUs, cores, context
    length, KV cache; a LoRA version's adapters loaded under their names), or the server that runs at its URL,
    and a server for each frozen model the run's roles are bound to (agent.roles); `client()` calls them,
    recording the policy's version and name. `with PolicyServer(...) as served:`."""

    def __init__(self, policy: Policy, config: RLConfig, logs: Path, key_file: str | None = None,
                 log_name: str = "policy", switches: bool = False):  # fmt: skip
        self.policy, self.config, self.logs, self.key_file, self.log_name = policy, config, logs, key_file, log_name
        self.switches = switches  # other versions of the run will be served after this one (`switch`)
        self.server = None
        self.models: dict = {}  # the frozen models roles are bound to: binding -> its server
        self.adapters: list[str] = []  # the names of the adapters loaded for the policy served now

    @property
    def log_path(self) -> Path | None:
        return None if self.policy.url else self.logs / f"{self.log_name}.log"

    def start(self) -> PolicyServer:
        from orchestrate.loop.config_checks import gpu_slices
        from orchestrate.serving.auth import read_api_key
        from orchestrate.serving.launch import policy_servers, remote_servers
        from orchestrate.serving.models import untied_copy
        from orchestrate.serving.processes import parse_cpus

        p, s = self.policy, self.config.server
        try:
            self._start_models()
            if p.url:
                self.server = remote_servers([p.url], role="policy", api_key=read_api_key(self.key_file))[0]
            else:
                gpus = [gpu_slices(s.gpus, 1, s.tensor_parallel_size * s.data_parallel_size)[0]] if s.gpus else None
                # a server whose weights will be reloaded serves an untied folder from the start (untied_copy says why)
                lora = self.config.train.lora.rank if p.adapter or self.switches else 0
                model = untied_copy(p.model) if self.switches and not lora else p.model
                (self.server,) = policy_servers(model, s, self.logs, gpus=gpus,
                                                cpus=parse_cpus(s.cpus) if s.cpus else None, seed=self.config.run.seed,
                                                reloads=False, log_name=self.log_name, lora_rank=lora,
                                                lora_adapters=1 + len(self.config.adapter_roles))  # fmt: skip
                self.server.start()
            for server in self.models.values():
                server.wait_ready()
            if p.adapter is not None and not p.url:
                self._load_adapters(p)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_models(self) -> None:
        """A server for each frozen model a role is bound to (orchestrate.loop.policy.role_models), started
        without waiting (the policy's starts meanwhile); those by URL used as they are."""
        from orchestrate.loop.policy import role_models, teacher_folder
        from orchestrate.serving.auth import read_api_key
        from orchestrate.serving.launch import reference_server, remote_servers, served_name
        from orchestrate.serving.processes import parse_cpus

        s = self.config.server
        for role, binding in role_models(self.config).items():
            folder = teacher_folder(binding, f"--agent.roles {role}")
            self.models[binding] = reference_server(folder, s, self.logs / f"{self.log_name}-role-{role}.log",
                                                    cpus=parse_cpus(s.cpus) if s.cpus else None, role=f"role-{role}")  # fmt: skip
            self.models[binding].start(wait=False)
        if urls := role_models(self.config, urls=True):
            key = read_api_key(self.key_file)
            for url in urls.values():
                self.models[url] = remote_servers([url], role=served_name(url, key), api_key=key)[0]

    def switch(self, policy: Policy) -> None:
        """Serve another version of the same run on the running server (started with `switches`): its weights
        reloaded from disk (an untied copy where the folder ties its head), or, for a LoRA run, its adapter
        loaded in place of the one served before (version 0: the base model, no adapter)."""
        from orchestrate.serving.models import untied_copy

        if not self.switches or self.policy.url:
            raise RuntimeError("PolicyServer.switch: a server started with switches=True, not one by URL")
        before, self.adapters = self.adapters, []
        if policy.adapter is not None:
            self._load_adapters(policy)
        elif policy.model != self.policy.model:  # another folder of weights (a LoRA run's base never changes)
            self.server.reload_weights(untied_copy(policy.model), verify=False)  # the prefix cache reset with it
        for adapter in before:  # those served before are not needed again (their folders may be gone by now)
            self.server.unload_adapter(adapter)
        self.policy = policy

    def _load_adapters(self, policy: Policy) -> None:
        """A LoRA version's adapters into the server: the policy's, and each role's own (contract.rundir.role_adapters)."""
        from orchestrate.serving.vllm_server import adapter_name

        name = self.server.served_model_name
        folders = {adapter_name(name, policy.version): policy.adapter}
        folders |= {adapter_name(name, policy.version, role): f for role, f in role_adapters(policy.adapter).items()}
        for adapter, folder in folders.items():
            self.server.load_adapter(adapter, folder.resolve())
            self.adapters.append(adapter)

    def stop(self) -> None:
        for server in [self.server, *self.models.values()]:
            if server is not None:
                server.stop()  # a server by URL is not ours: RemoteServer.stop leaves it running

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def client(self, max_concurrency: int | None = None):
        """A client of the server (`async with`), each call recording the policy's version."""
        from orchestrate.serving.llm import VLLMClient
        from orchestrate.serving.vllm_server import adapter_name

        p, name = self.policy, self.server.served_model_name
        adapter = (lambda _, role=None: adapter_name(name, p.version, role)) if p.adapter is not None else None
        concurrency = max_concurrency or self.config.rollouts.max_concurrency
        models = {binding: VLLMClient([server], model=f"{binding} (frozen)", max_concurrency=concurrency)
                  for binding, server in self.models.items()}  # fmt: skip
        return VLLMClient([self.server], model=p.name, policy_version=p.version, max_concurrency=concurrency,
                          adapter=adapter, models=models)  # fmt: skip


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


# -- the loop's servers and learner ------------------------------------------------------------------


class RunSetup:
    """What the RL loop runs on, built from its config: the model folders, the tokenizer, the agent, the
    servers and the learner, started in the order they must start. `models`: the folders the run's checks
    resolved (orchestrate.loop.preflight.preflight), else resolved here."""

    def __init__(self, config: RLConfig, run: RunDir, models: RunModels | None = None, progress: bool = True):
        self.config, self.run, self.progress = config, run, progress
        models = models or RunModels.of(config)
        self.policy_dir, self.reference_dir, self.teacher_dir = models.policy, models.reference, models.teacher
        self.role_dirs = models.roles
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
                                  progress=self.progress, teacher_dir=self.teacher_dir,
                                  role_dirs=self.role_dirs)  # fmt: skip
        train = c.train.model_copy(
            update={
                "colocated": servers.colocated,
                "teacher_coef": c.teacher_coef,
                "teacher_topk_coef": c.teacher_topk_coef,
                "roles": c.trained_roles,
                "lora": c.train.lora.model_copy(update={"roles": c.adapter_roles}) if c.adapter_roles else c.train.lora,
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
