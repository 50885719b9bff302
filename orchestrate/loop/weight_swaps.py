"""New weights on the run's policy servers: the version they serve, each checkpoint served as the learner
publishes it, the versions a resumed run serves again, and a swap under the calls in flight.

The weights travel by orchestrate.serving.weights (in memory, from the checkpoint's folder, or its adapter:
contract.weight_paths selects how). The pool of servers (orchestrate.loop.servers.Servers) holds one
WeightSwaps and offers the loop its methods; this module decides when a version is served and what the calls
in flight see meanwhile.
"""

from __future__ import annotations

import asyncio

from contract.rundir import RunDir
from contract.weight_paths import KEEP, select
from orchestrate.loop.config import RLConfig
from orchestrate.serving.llm import VLLMClient
from orchestrate.serving.vllm_server import ServerError
from orchestrate.serving.weights import Transport, transport_for


class WeightSwaps:
    """The weights of one run's policy servers. `use(trainer)` attaches the learner whose checkpoints they serve
    and starts the weight path; until then they serve version 0, the initial weights."""

    def __init__(self, config: RLConfig, run: RunDir, policy: list, progress: bool = True):
        self.config = config
        self.run = run
        self.policy = policy
        self.progress = progress
        # how new weights reach the policy servers (contract.weight_paths): a LoRA run's, each version an adapter
        self.mechanism = select(config.server.weight_transfer, config.train.lora.rank)
        self.trainer = None
        self.weights: Transport | None = None

    @property
    def served(self) -> int:
        """The version the policy servers serve (0: the initial weights)."""
        return self.weights.served if self.weights is not None else 0

    @property
    def stale(self) -> set:
        """Policy servers that missed a version: out of the pool until they rejoin with the served one."""
        return self.weights.stale if self.weights is not None else set()

    def use(self, trainer) -> None:
        """Serve the checkpoints of `trainer` (orchestrate.loop.trainer.TrainerProcess): the weight path starts."""
        c = self.config.server
        self.trainer = trainer
        self.weights = transport_for(self.run, self.policy, self.mechanism, c.weight_transfer_timeout_s, trainer)
        self.weights.start()

    def close(self) -> None:
        """The run stops: the weight path frees what it holds (shared memory, say)."""
        if self.weights is not None:
            self.weights.close()

    def resume(self) -> None:
        """Resuming: the servers get the newest version the learner holds. The learner resumes from its
        last full state and trains the batches after it again, publishing each (served in turn) up to the
        last completed iteration."""
        completed = self.run.load_state().completed_iteration
        if completed == 0 and not self.trainer.newest_checkpoint():
            return
        self.trainer.wait_until_loaded()  # it has dropped the checkpoints it will train again
        start = self.trainer.newest_checkpoint()
        for version in range(max(start, 1), max(start, completed) + 1):
            self.trainer.wait_for_checkpoint(version, progress=self.progress, desc=f"resuming: version {version}")
            self.serve(version)

    def serve(self, version: int, keep_previous: bool = False) -> None:
        """Serve checkpoint `version` on every policy server (blocking; no call may be in flight), in memory
        or from disk (orchestrate.serving.weights). A reload from disk is checked by a change of log-probs, unless
        the learner recorded that the weights did not change. A server that does not take it is left stale
        (out of the pool until it rejoins with the weights); with none left the run stops."""
        self.weights.serve(version, verify=self.trainer.weights_changed(version), keep_previous=keep_previous)

    async def rejoin(self, server) -> None:
        """A policy server back in the pool (restarted, or answering again) serves the current weights."""
        await asyncio.to_thread(self.weights.rejoin, server)

    async def follow(self, client: VLLMClient, stop: asyncio.Event) -> None:
        """While episodes run (async_level >= 1): serve each checkpoint as soon as the trainer publishes it.
        The client drains its calls in flight around the reload, so every call has one version; with
        `--run.in_flight_swaps` they are paused between two engine steps instead (`swap_in_flight`); with
        LoRA nothing waits: calls in flight finish under the old adapter, unloaded once the last is done."""
        mode = self.mechanism.swap(self.config.run.in_flight_swaps)
        adapters = self.mechanism.adapter  # versions side by side: the one before is unloaded once idle
        unloads = []
        while not stop.is_set():
            newest = self.trainer.newest_checkpoint()
            if newest > self.served:
                old = self.served

                async def reload(v=newest):
                    if mode == KEEP:
                        await self.swap_in_flight(client, v)
                    else:
                        await asyncio.to_thread(self.serve, v, adapters)
                    for server in list(self.stale):  # missed it: out until it rejoins with these weights
                        client.take_out(server)

                await client.swap_weights(reload, newest, mode=mode)
                if adapters:

                    async def unload(v=old):
                        await client.version_idle(v)
                        await asyncio.to_thread(self.weights.unload, v)

                    unloads.append(asyncio.create_task(unload()))
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except TimeoutError:
                pass
        await asyncio.gather(*unloads)  # the episodes are done: no call uses an old adapter

    async def swap_in_flight(self, client: VLLMClient, version: int) -> None:
        """Version `version` under the calls in flight: every policy server pauses between two engine steps
        with its requests kept and says how many tokens each has sampled; the weights are swapped (no
        log-prob check: a paused server answers no probe); the client records on each call the token from
        which `version` sampled (`VLLMClient.mark_versions`); the paused requests drop the KV the old
        weights computed, so that the new ones compute it again, and the servers resume. A server that
        fails is resumed all the same and left stale (out of the pool until it rejoins)."""
        paused, lengths = [], {}

        def pause_and_swap() -> None:
            for server in self.policy:
                if server in self.stale:
                    continue
                try:
                    server.pause()
                    paused.append(server)
                    lengths[server] = server.output_lengths()
                except ServerError:
                    self.weights.stale.add(server)
            self.weights.serve(version, verify=False)

        def recompute_and_resume() -> None:
            for server in paused:
                try:
                    if server not in self.stale:
                        server.recompute()
                except ServerError:
                    self.weights.stale.add(server)
                finally:
                    try:
                        server.resume()
                    except ServerError:
                        self.weights.stale.add(server)

        try:
            await asyncio.to_thread(pause_and_swap)
            for server, n in lengths.items():
                if server not in self.stale:
                    client.mark_versions(server, n, version)
        finally:
            await asyncio.to_thread(recompute_and_resume)
