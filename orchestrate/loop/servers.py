"""The run's vLLM servers and the weights they serve.

The policy servers (started here, or run elsewhere and used by URL: `orchestrate.serve`), the reference
server when a KL term needs one (a LoRA run scores the reference on the policy servers' base model instead,
no adapter), the teacher's server with --teacher.model (the reference's seat: served like it, or by URL), a
server for each frozen model a role is bound to (agent.roles; started here, or by URL), the
version the policy servers serve, and the clients that call them. New weights reach the servers by
orchestrate.loop.weight_swaps (when a version is served, what the calls in flight see), which this pool holds.
The loop (orchestrate.loop.iteration) asks for a client, a reference pass, or the next version served; this module
decides how.
"""

from __future__ import annotations

import asyncio
from contextlib import ExitStack

from contract.rundir import RunDir
from contract.weight_paths import select
from orchestrate.loop.config import RLConfig
from orchestrate.loop.config_checks import colocated, gpu_slices, visible_gpus
from orchestrate.loop.metrics import server_metrics
from orchestrate.loop.policy import role_models
from orchestrate.loop.reference import annotate_reference
from orchestrate.loop.weight_swaps import WeightSwaps
from orchestrate.serving.auth import APIKeyMissing, read_api_key
from orchestrate.serving.launch import policy_servers, reference_server, remote_servers, served_name
from orchestrate.serving.llm import VLLMClient
from orchestrate.serving.processes import parse_cpus
from orchestrate.serving.vllm_server import RemoteServer, ServerError, VLLMServer, adapter_name
from orchestrate.serving.weights import Transport, close_group
from tapes.tape import Tape

ROLES = ("policy", "base", "reference", "teacher")


class Servers:
    """The policy servers (and the reference and teacher servers, if any) of one run. `use(trainer)` attaches the
    learner whose checkpoints they serve; `start` starts them (those given by URL are reset to their own model)."""

    def __init__(self, config: RLConfig, run: RunDir, tokenizer, policy: list, reference=None, progress=True,
                 teacher=None, models: dict | None = None):  # fmt: skip
        self.config = config
        self.run = run
        self.tokenizer = tokenizer
        self.policy = list(policy)
        self.reference = reference
        self.teacher = teacher
        self.models = dict(models or {})  # the frozen models roles are bound to: binding -> its server
        self.progress = progress
        self.swaps = WeightSwaps(config, run, self.policy, progress)  # the versions the policy servers serve
        self.counts = _no_counts()  # policy requests since the last record
        # time-sharing the learner's GPUs (--server.colocate): the policy servers sleep while it trains
        self.colocated = colocated(config) and any(isinstance(s, VLLMServer) for s in self.policy)
        self.asleep = False  # the policy servers sleep (colocated, between the batch and its checkpoint)

    @classmethod
    def for_run(cls, config: RLConfig, run: RunDir, policy_dir, reference_dir, tokenizer, progress=True,
                teacher_dir=None, role_dirs: dict | None = None) -> Servers:  # fmt: skip
        """The servers `config` asks for, built (not started): ours, or those given by URL. `teacher_dir`: the
        teacher's model folder (orchestrate.loop.policy.teacher_folder), when it is not given by URL; `role_dirs`:
        the folders of the models roles are bound to (RunModels.roles)."""
        c = config
        by_url = role_models(c, urls=True)
        remote = bool(c.server.policy_urls or c.server.reference_url or c.teacher.url or by_url)
        try:
            key = read_api_key(c.server.api_key_file) if remote else ""
        except APIKeyMissing as exc:
            raise ServerError(str(exc)) from None
        per_server = c.server.tensor_parallel_size * c.server.data_parallel_size
        cpus = parse_cpus(c.server.cpus) if c.server.cpus else None
        logs = run.logs
        if c.server.policy_urls:
            policy = remote_servers(c.server.policy_urls, role="policy", api_key=key)
        else:
            n = c.server.policy_servers
            gpus = gpu_slices(c.server.gpus, n, per_server) if (c.server.gpus or n > 1) else None
            policy = policy_servers(policy_dir, c.server, logs, count=n, gpus=gpus, cpus=cpus, seed=c.run.seed,
                                    lora_rank=c.train.lora.rank, lora_adapters=1 + len(c.adapter_roles))  # fmt: skip
        reference = None
        if c.train.needs_reference and not c.reference_on_policy:
            if c.server.reference_url:
                reference = remote_servers([c.server.reference_url], role="reference", api_key=key)[0]
            else:
                gpus = gpu_slices(c.server.reference_gpus, 1, per_server)[0] if c.server.reference_gpus else None
                reference = reference_server(reference_dir, c.server, logs / "reference.log", gpus=gpus, cpus=cpus)
        teacher = None
        if c.teacher.url:
            teacher = remote_servers([c.teacher.url], role="teacher", api_key=key)[0]
        elif c.teacher.model:  # on the reference's GPUs (each sleeps while the other scores)
            gpus = gpu_slices(c.server.reference_gpus, 1, per_server)[0] if c.server.reference_gpus else None
            teacher = reference_server(teacher_dir, c.server, logs / "teacher.log", gpus=gpus, cpus=cpus,
                                       role="teacher")  # fmt: skip
        models = {}
        gpus = gpu_slices(c.server.reference_gpus, 1, per_server)[0] if c.server.reference_gpus else None
        for role, binding in role_models(c).items():  # on the reference's GPUs, awake: they answer calls
            models[binding] = reference_server(role_dirs[binding], c.server, logs / f"role-{role}.log", gpus=gpus,
                                               cpus=cpus, role=f"role-{role}")  # fmt: skip
        for url in by_url.values():
            models[url] = remote_servers([url], role=served_name(url, key), api_key=key)[0]
        by_path = select(c.server.weight_transfer, c.train.lora.rank).by_path  # servers reload versions by path
        for server in policy:
            # Checked before the run directory was written (preflight); now that it exists, exactly (before
            # the trainer writes there too).
            if (isinstance(server, RemoteServer) and by_path
                    and (problem := server.sees(run.root.resolve()))):  # fmt: skip
                raise ServerError(f"--server.policy_urls: {server.url}: {problem}; weights are reloaded by path, "
                                  f"so mount {run.root.resolve()} at the same path there")  # fmt: skip
        close_group(run)  # before the learner starts: no joining the group of a killed run
        return cls(config, run, tokenizer, policy, reference, progress, teacher, models)

    @property
    def all(self) -> list:
        return self.policy + [s for s in (self.reference, self.teacher) if s is not None] + list(self.models.values())

    # -- start -------------------------------------------------------------------------

    def launch(self, stack: ExitStack) -> None:
        """Start every server and wait for them. vLLM sizes a server's KV cache from its GPU's free memory at
        start, so no two servers on one GPU measure it at once: colocated, they start one after the other, each
        asleep before the next starts (each finds the others' share free), then the policy servers are woken;
        otherwise a server starts once those before it on any of its GPUs answer, and servers on other GPUs
        (or on CPU) start at once. The servers by URL serve their own model again (one used by an earlier run
        may hold its weights)."""
        for i, server in enumerate(self.all):
            stack.callback(server.stop)
            if not self.colocated:
                for earlier in self.all[:i]:
                    if gpus_of(server) & gpus_of(earlier):
                        earlier.wait_ready()
            server.start(wait=self.colocated)
            if self.colocated:
                server.sleep()
        for server in self.all:
            server.wait_ready()
        if self.colocated:
            for server in self.policy:
                server.wake_up()
        for scorer in (self.reference, self.teacher):
            if scorer is not None and not self.colocated:  # colocated, it is asleep already
                scorer.sleep()  # GPU: woken for its scoring pass only
        self.reset_lent()

    def reset_lent(self) -> None:
        """The policy servers by URL resumed and their own model's weights reloaded (an earlier run may have
        left them paused, or serving its weights), except the base of one with LoRA on a vLLM that cannot
        reload it (0.26-0.27: orchestrate.serving.vllm_server.LORA_RELOAD_FROM), which nothing of ours changes."""
        for server in self.policy:
            if isinstance(server, RemoteServer):
                server.resume()  # an orchestrator killed during an in-flight swap may have left it paused
                if server.reloads_weights():
                    server.reload_weights(server.model_root(), verify=False)

    def make_room(self) -> None:
        """Colocated: the policy servers sleep (weights and KV cache off the GPU) while the learner trains."""
        if self.colocated and not self.asleep:
            for server in self.policy:
                server.sleep()
            self.asleep = True

    def wake(self) -> None:
        """Colocated: the policy servers back on the GPU, before they load the learner's new weights."""
        if self.asleep:
            for server in self.policy:
                server.wake_up()
            self.asleep = False

    # -- new weights: orchestrate.loop.weight_swaps ---------------------------------------------

    @property
    def mechanism(self):
        return self.swaps.mechanism

    @property
    def weights(self) -> Transport | None:
        return self.swaps.weights

    @property
    def served(self) -> int:
        """The version the policy servers serve (0: the initial weights)."""
        return self.swaps.served

    @property
    def stale(self) -> set:
        """Policy servers that missed a version: out of the pool until they rejoin with the served one."""
        return self.swaps.stale

    def use(self, trainer) -> None:
        self.swaps.use(trainer)

    def close(self) -> None:
        self.swaps.close()

    def resume(self) -> None:
        self.swaps.resume()

    def serve(self, version: int, keep_previous: bool = False) -> None:
        self.swaps.serve(version, keep_previous)

    async def rejoin(self, server) -> None:
        await self.swaps.rejoin(server)

    async def follow(self, client: VLLMClient, stop: asyncio.Event) -> None:
        await self.swaps.follow(client, stop)

    async def swap_in_flight(self, client: VLLMClient, version: int) -> None:
        await self.swaps.swap_in_flight(client, version)

    # -- calls -------------------------------------------------------------------------------

    async def _recover(self, endpoint, exc) -> None:
        await endpoint.recover(self.config.server.max_restarts)

    def client(self, role: str, policy_version: int = 0) -> VLLMClient:
        """A client for `role`: "policy" (the policy servers; in a LoRA run each call names its version's
        adapter), "base" (the policy servers' base model, no adapter: a LoRA run's reference) or "reference"
        (the reference server) or "teacher" (the teacher's server)."""
        if role not in ROLES:
            raise ValueError(f"role {role!r}: one of {', '.join(ROLES)}")
        scorer = role in ("reference", "teacher")
        servers = [self.reference if role == "reference" else self.teacher] if scorer else self.policy
        adapter = None
        if role == "policy" and self.mechanism.adapter:
            name = self.policy[0].served_model_name
            adapter = lambda v, role=None: adapter_name(name, v, role) if v else None  # noqa: E731 - 0 is the base
        models = None
        if role == "policy":  # each frozen model's calls on its own server, version 0 (nothing swaps there)
            models = {binding: VLLMClient([server], self.tokenizer, model=f"{binding} (frozen)",
                                          max_concurrency=self.config.rollouts.max_concurrency,
                                          on_failure=self._recover)
                      for binding, server in self.models.items()}  # fmt: skip
        return VLLMClient(
            servers, self.tokenizer, model=self.config.model.policy, policy_version=policy_version,
            max_concurrency=self.config.rollouts.max_concurrency, on_failure=self._recover,
            on_rejoin=None if scorer else self.rejoin, out=[s for s in servers if s in self.stale],
            adapter=adapter, models=models,
        )  # fmt: skip

    def count(self, client: VLLMClient) -> None:
        """Add a policy client's requests per server, retries and take-outs to the next record's."""
        per_server = client.requests_per_server()
        done = self.counts["requests"] + [0] * (len(per_server) - len(self.counts["requests"]))
        self.counts["requests"] = [a + b for a, b in zip(done, per_server)]
        self.counts["retries"] += client.retries
        self.counts["taken_out"] += client.taken_out

    def take_metrics(self) -> dict:
        """The servers' part of an iteration's record (requests per server, retries, take-outs), counted
        afresh from here."""
        record = server_metrics(**self.counts)
        self.counts = _no_counts()
        return record

    def score_reference(self, tapes: list[Tape]) -> None:
        """Reference log-probs on every LLM call of `tapes` when a KL term needs them (from the reference server,
        or a LoRA run's from the policy servers' base model), and the teacher's with --teacher.model (from its
        server; with --teacher.topk its top-k too); on a GPU the policy servers sleep while a server of its own scores."""
        passes = []  # (role, the LLMCall field it fills)
        if self.reference is not None or self.config.train.needs_reference:
            passes.append(("reference" if self.reference is not None else "base", "ref_logprobs"))
        if self.teacher is not None:
            passes.append(("teacher", "teacher_logprobs"))

        async def score(role: str, field: str):
            top = self.config.teacher.topk if role == "teacher" else 0
            async with self.client(role) as client:
                await annotate_reference(tapes, client, progress=self.progress, field=field, top=top)

        apart = [(role, field) for role, field in passes if role != "base"]
        for role, field in passes:
            if role == "base":
                asyncio.run(score(role, field))
        if not apart:
            return
        if self.colocated:
            self.make_room()
        else:
            for server in self.policy:
                server.sleep()
        try:
            for role, field in apart:
                server = self.reference if role == "reference" else self.teacher
                server.wake_up()
                try:
                    asyncio.run(score(role, field))
                finally:
                    server.sleep()
        finally:
            if not self.colocated:  # colocated, they sleep on: the learner trains next (`wake` after it)
                for server in self.policy:
                    server.wake_up()


def gpus_of(server) -> set[str]:
    """The GPUs a server of ours runs on, as CUDA_VISIBLE_DEVICES names them; none for a server on CPU or
    elsewhere (by URL). Without GPUs of its own it takes the first visible ones, as many as its parallelism."""
    if not server.on_gpu:
        return set()
    if server.gpu_ids is not None:
        return {str(gpu) for gpu in server.gpu_ids}
    return set(visible_gpus()[: server.config.tensor_parallel_size * server.config.data_parallel_size])


def _no_counts() -> dict:
    return {"requests": [], "retries": 0, "taken_out": 0}
