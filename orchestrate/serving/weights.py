"""How each new policy version reaches the policy servers: the orchestrator's end of the weight paths.

The loop holds one `Transport`, built by `transport_for` from the mechanism the registry selects
(contract.weight_paths: `--server.weight_transfer` and `--train.lora.rank`); one subclass per mechanism, in
orchestrate.serving.transports: disk (every server reloads the checkpoint's model folder by path), collective
(gloo or nccl: the learner broadcasts the version over a process group of its own with every server's
workers, falling back to the disk path when a group cannot form or a transfer fails) and adapter (a LoRA run:
each version's adapter folder loaded by path under a name of its own). The learner's ends are in
finetune.publish.

What the loop drives: `start()` before the first version; `serve(N)` once the learner has published
checkpoint N (returns the servers that could not take it: they are `stale`, out of the pool until they
`rejoin` with the served version); `unload(N)` when no call uses version N any more (adapters only).
"""

from __future__ import annotations

import time
from pathlib import Path

from contract.durable import atomic_write_json
from contract.rundir import RunDir
from contract.weight_paths import Mechanism, load
from orchestrate.serving.vllm_server import ServerError, VLLMServer


def transport_for(run: RunDir, servers: list[VLLMServer], mechanism: Mechanism, timeout_s: float, trainer) -> Transport:
    """The orchestrator's end of `mechanism` (contract.weight_paths.select), for the policy servers `servers`."""
    return load(mechanism.transport)(run, servers, mechanism, timeout_s, trainer)


def close_group(run: RunDir) -> None:
    """Before a learner starts: what an earlier (killed) orchestrator announced is gone; a learner must not
    act on it (a group's store is dead). The generation number is kept: it goes on from there."""
    old = run.read_json(run.weight_group)
    if old.get("backend") is not None:
        atomic_write_json(run.weight_group, {"generation": int(old.get("generation", 0)), "backend": None})


class Transport:
    """Puts each version on every policy server. Subclasses implement `put` (their part of `serve`) and
    `rejoin`; the helpers here are the disk path's, which every mechanism can fall back to."""

    def __init__(self, run: RunDir, servers: list[VLLMServer], mechanism: Mechanism, timeout_s: float, trainer):
        self.run = run
        self.servers = servers
        self.mechanism = mechanism
        self.timeout_s = timeout_s
        self.trainer = trainer  # orchestrate.loop.trainer.TrainerProcess: its checkpoints and liveness
        self.stale: set = set()  # servers that do not hold the served version (out of the pool)
        self.served = 0

    def start(self) -> None:
        """Set up before the first version (nothing by default)."""

    def serve(self, version: int, verify: bool = True, keep_previous: bool = False) -> list[str]:
        """Put version `version` on every policy server; returns the servers that could not take it (they
        are in `stale`). Raises when none could. `verify`: check a reload by a change of log-probs;
        `keep_previous`: the version served before stays loaded while calls use it (adapters)."""
        failed = self.put(version, verify=verify, keep_previous=keep_previous)
        for server, _ in failed:
            self.stale.add(server)
        if len(failed) == len(self.servers):
            raise ServerError(f"no policy server is left to serve version {version} "
                              f"({'; '.join(f'{s.base_url}: {r}' for s, r in failed)})")  # fmt: skip
        self.served = version
        return [s.base_url for s, _ in failed]

    def put(self, version: int, verify: bool, keep_previous: bool) -> list[tuple[VLLMServer, str]]:
        """The mechanism's part of `serve`: version `version` onto every server; (server, why) of each that
        did not take it."""
        raise NotImplementedError

    def rejoin(self, server: VLLMServer) -> None:
        """A server back in the pool (restarted, or answering again) gets the served version."""
        raise NotImplementedError

    def unload(self, version: int) -> None:
        """No call uses version `version` any more (nothing to free unless versions stay loaded side by side)."""

    def close(self) -> None:
        """The run stops: free what the mechanism holds outside the run directory (nothing by default)."""

    # -- the disk path, shared --------------------------------------------------------------

    def wait_for_folder(self, version: int) -> Path:
        """The model folder of version `version`, written by the learner (asked for when it is not there)."""
        if not self.run.has_weights(version):
            atomic_write_json(self.run.weights_request, {"version": version})
            deadline = time.monotonic() + self.timeout_s
            while not self.run.has_weights(version):
                if time.monotonic() > deadline:
                    raise ServerError(f"the learner wrote no model folder for version {version} within "
                                      f"{self.timeout_s:.0f} s (raise --server.weight_transfer_timeout_s)")  # fmt: skip
                self.trainer.check_alive()
                time.sleep(0.1)
        return self.run.checkpoint(version).resolve()  # by absolute path: servers elsewhere see the same

    def on_every_server(self, put) -> list[tuple[VLLMServer, str]]:
        """put(server) on every server: one that fails and does not answer is out (returned, with why), one
        that answers and fails raises (it is up and did not take the weights: a real error)."""
        failed = []
        for server in self.servers:
            try:
                put(server)
            except ServerError as exc:
                if server.answers():
                    raise
                failed.append((server, str(exc).splitlines()[0]))
                continue
            self.stale.discard(server)
        return failed

    def folder(self, version: int) -> Path:
        """Where the servers reload version `version` from: its checkpoint's model folder (wait_for_folder)."""
        return self.wait_for_folder(version)

    def reload_all(self, version: int, verify: bool) -> list[tuple[VLLMServer, str]]:
        path = self.folder(version)
        return self.on_every_server(lambda server: server.reload_weights(path, verify=verify))

    def reload(self, server: VLLMServer) -> None:
        """`server` reloads the served version's model folder (none before the first version)."""
        if self.served:
            server.reload_weights(self.folder(self.served), verify=False)
        self.stale.discard(server)
