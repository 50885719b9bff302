"""How each new policy version reaches the policy servers: in memory, or by a reload from disk.

`PolicyWeights.serve(version)` is what the loop calls once the learner has published checkpoint `version`.
With `--server.weight_transfer disk` every server reloads the checkpoint's model folder by path. With gloo
or nccl the learner broadcasts the version over a process group of its own with every server's workers
(protocol and wire format: finetune.weight_transfer; the servers' end: orchestrate.serving.vllm_plugin.weight_engine):

- `start()` hosts the group's TCP store here, writes RUN/weight_group.json for the learner and asks every
  server to join (both sides block until all have); a server that cannot join (one by URL started without
  weight transfer, say) leaves the run on the disk path, with one line saying why.
- `serve(N)` drives every server's receive of version N (they load it only once it has arrived whole and
  matches its manifest), then writes RUN/weights_ack.json. If a server refused or failed, the ack says so:
  the learner writes version N's folder, the servers reload it from disk (a server that cannot is out of the
  pool), and a new generation of the group is formed before the next version. At the first server that
  fails every server drops the group, so that no broadcast waits out its timeout.

A LoRA run (`--train.lora.rank`) sends neither: each version is the adapter folder in its checkpoint
(megabytes), loaded into every server by path under a name of its own (vllm_server.adapter_name: policy-vN;
version 0 is the base model, served under the plain name, which is also what the reference is scored on).
The adapter of the version before is unloaded once the new one is in; while episodes run (async_level >= 1)
calls are not drained around a swap: those in flight finish under the old adapter, which is unloaded when
the last of them is done.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from contract.durable import atomic_write_json
from contract.rundir import RunDir
from orchestrate.serving.vllm_server import RemoteServer, ServerError, VLLMServer, adapter_name


class PolicyWeights:
    def __init__(self, run: RunDir, servers: list[VLLMServer], backend: str, timeout_s: float, trainer,
                 lora: bool = False):  # fmt: skip
        self.run = run
        self.lora = lora  # each version is an adapter, loaded by path (the backend is disk)
        self.loaded: set[int] = set()  # LoRA: the versions whose adapters the servers hold (calls use them)
        self.servers = servers
        self.backend = backend  # "disk", "gloo" or "nccl"; becomes "disk" when a group cannot form
        self.timeout_s = timeout_s
        self.trainer = trainer  # orchestrate.loop.trainer.TrainerProcess: its checkpoints and liveness
        self.store = None
        self.generation = 0
        self.regroup = False  # a transfer failed: form a new generation before the next version
        self.stale: set = set()  # servers that do not hold the served version (out of the pool)
        self.served = 0

    @property
    def in_memory(self) -> bool:
        return self.backend != "disk"

    # -- the group -------------------------------------------------------------------

    @staticmethod
    def close_group(run: RunDir) -> None:
        """Before a learner starts: the group an earlier (killed) orchestrator announced is gone; a learner
        must not try to join it (its store is dead). The generation number is kept: it goes on from there."""
        old = run.read_json(run.weight_group)
        if old.get("backend") is not None:
            atomic_write_json(run.weight_group, {"generation": int(old.get("generation", 0)), "backend": None})

    def start(self) -> None:
        """Form the first generation of the group (no-op on the disk path)."""
        if self.in_memory:
            self._form_group()

    def _host(self) -> str:
        """The address the learner and the servers reach this machine's store at: loopback when every
        server is ours, else this machine's name."""
        if any(isinstance(s, RemoteServer) for s in self.servers) or self.trainer.external:
            return socket.getfqdn()
        return "127.0.0.1"

    def _form_group(self) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore

        # A store per generation: its keys (each rank's address) are the group's, and a new group must not
        # read an old one's (vLLM's side prefixes them with the store's address only).
        self.store_host = self._host()
        self.store = TCPStore(self.store_host, 0, world_size=None, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=self.timeout_s))  # fmt: skip
        try:
            sizes = [int(s.get("/get_world_size", {"include_dp": "true"}).json()["world_size"]) for s in self.servers]
        except (ServerError, KeyError, ValueError) as exc:
            return self._give_up(f"a server does not tell its world size ({exc})")
        # Generations go on from the run's earlier ones: a manifest of a killed run's generation is never
        # taken for one of this group (its broadcast is not coming).
        self.generation = max(self.generation, int(self.run.read_json(self.run.weight_group).get("generation", 0))) + 1
        info = {"generation": self.generation, "backend": self.backend, "host": self.store_host,
                "port": self.store.port, "world_size": 1 + sum(sizes), "timeout_s": self.timeout_s}  # fmt: skip
        atomic_write_json(self.run.weight_group, info)  # the learner joins as rank 0
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        payloads = [
            {"backend": self.backend, "host": self.store_host, "port": self.store.port,
             "world_size": info["world_size"], "rank_offset": off, "timeout_s": self.timeout_s}
            for off in offsets
        ]  # fmt: skip
        with ThreadPoolExecutor(len(self.servers)) as pool:
            results = list(pool.map(self._join, self.servers, payloads))
        failed = [f"{s.base_url}: {r}" for s, r in zip(self.servers, results) if r]
        if failed:
            return self._give_up("; ".join(failed))
        self.regroup = False

    def _join(self, server: VLLMServer, payload: dict) -> str | None:
        try:
            server._post("/init_weight_transfer_engine", {"init_info": payload}, timeout=self.timeout_s + 30)
        except ServerError as exc:
            return str(exc).splitlines()[0]
        return None

    def _leave_group(self) -> None:
        """Every server drops its end of the group (their sockets close, so a broadcast in progress fails)."""
        for server in self.servers:
            try:
                server._post("/shutdown_weight_transfer_engine", timeout=30)
            except ServerError:
                pass  # a dead server has no group to drop

    def _give_up(self, why: str) -> None:
        print(f"weights: {self.backend} transfer unavailable ({why}); new weights go through the disk")
        self.backend = "disk"
        atomic_write_json(self.run.weight_group, {"generation": self.generation + 1, "backend": "disk"})

    # -- one version -------------------------------------------------------------------

    def serve(self, version: int, verify: bool = True, keep_previous: bool = False) -> list[str]:
        """Put version `version` on every policy server; returns the servers that could not take it (they
        are in `stale`). Raises when none could. LoRA: with `keep_previous` the adapter served before stays
        loaded (calls still use it) until `unload` is called for it."""
        manifest = self.run.transfer_manifest(version) if self.in_memory else None
        failed: list[tuple[VLLMServer, str]] = []
        if self.lora:
            failed = self._load_adapters(version, unload=not keep_previous)
        elif manifest is not None and manifest.get("generation") == self.generation:  # the learner is sending it
            if self.regroup:  # a server rejoined since the group formed: it cannot take part
                self._leave_group()  # the learner's broadcast fails at once instead of waiting out its timeout
                failed = [(s, "a server rejoined: the group is formed anew") for s in self.servers]
            else:
                failed = self._transfer(version, manifest)
            atomic_write_json(self.run.weights_ack, {"version": version, "ok": not failed,
                                                     "reason": "; ".join(r for _, r in failed)})  # fmt: skip
            if failed:  # the learner writes the version's folder now: reload every server from it
                self.regroup = True
                failed = self._reload_all(version, verify=False)
        else:
            failed = self._reload_all(version, verify=verify)
        for server, _ in failed:
            self.stale.add(server)
        if self.lora:
            self.loaded = ((self.loaded | {self.served}) if keep_previous else set()) | {version}
        if len(failed) == len(self.servers):
            raise ServerError(f"no policy server is left to serve version {version} "
                              f"({'; '.join(f'{s.base_url}: {r}' for s, r in failed)})")  # fmt: skip
        self.served = version
        if self.regroup and self.in_memory:
            self._form_group()
        return [s.base_url for s, _ in failed]

    def _transfer(self, version: int, manifest: dict) -> list[tuple[VLLMServer, str]]:
        """Every server receives version `version`. At the first that fails, every server drops its end of
        the group: a server that failed before it took part in the broadcast would otherwise hold the
        learner's broadcast, and the others', until the group's timeout (the next version forms a new one)."""
        with ThreadPoolExecutor(len(self.servers)) as pool:
            futures = {pool.submit(self._receive, s, version, manifest): s for s in self.servers}
            results = {}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                if results[futures[future]] and sum(map(bool, results.values())) == 1:
                    self._leave_group()
        failed = [(s, results[s]) for s in self.servers if results[s]]
        for server in self.servers:
            if server not in dict(failed):
                self.stale.discard(server)
        return failed

    def _receive(self, server: VLLMServer, version: int, manifest: dict) -> str | None:
        try:
            server._post("/start_weight_update")
            server._post("/update_weights", {"update_info": {"version": version, "manifest": manifest}},
                         timeout=self.timeout_s + 30)  # fmt: skip
            server._post("/finish_weight_update", {"weight_version": str(version)})
            server._post("/reset_prefix_cache")  # cached KV was computed with the old weights
        except ServerError as exc:
            return str(exc).splitlines()[0]
        return None

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

    def _on_every_server(self, put) -> list[tuple[VLLMServer, str]]:
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

    def _reload_all(self, version: int, verify: bool) -> list[tuple[VLLMServer, str]]:
        path = self.wait_for_folder(version)
        return self._on_every_server(lambda server: server.reload_weights(path, verify=verify))

    # -- LoRA: adapters by path -------------------------------------------------------

    def _load_adapters(self, version: int, unload: bool) -> list[tuple[VLLMServer, str]]:
        """Load version `version`'s adapter into every server, then (with `unload`) unload the one served
        before. No log-prob check as after a reload from disk: the adapter has a name of its own, so a call
        is served by it or refused, never by the weights before."""

        def put(server: VLLMServer) -> None:
            self.load_adapter(server, version, fresh=version > self.served)
            if unload and self.served and self.served != version:
                self._unload_adapter(server, self.served)

        return self._on_every_server(put)

    def load_adapter(self, server: VLLMServer, version: int, fresh: bool = False) -> None:
        """Version `version`'s adapter into `server` under its name, replacing one of that name (a server by
        URL may hold an earlier run's, a server that rejoins an older copy): then its prefix cache is
        dropped, since vLLM keys cached prefixes by the adapter's name (vLLM #42125). `fresh`: the name is
        new to this server (one of ours, the next version), so nothing cached can be stale."""
        path = self.run.adapter(version).resolve()  # by absolute path: servers elsewhere see the same
        if not self.run.has_adapter(version):
            raise ServerError(f"version {version} has no adapter at {path}")
        server._post("/v1/load_lora_adapter", {"lora_name": adapter_name(server.served_model_name, version),
                                               "lora_path": str(path), "load_inplace": True})  # fmt: skip
        if not fresh or isinstance(server, RemoteServer):
            server._post("/reset_prefix_cache")

    def unload(self, version: int) -> None:
        """LoRA: no call uses version `version` any more: every server frees its adapter."""
        if version in self.loaded and version != self.served:
            for server in self.servers:
                self._unload_adapter(server, version)
            self.loaded.discard(version)

    def _unload_adapter(self, server: VLLMServer, version: int) -> None:
        try:
            server._post("/v1/unload_lora_adapter", {"lora_name": adapter_name(server.served_model_name, version)})
        except ServerError:
            pass  # not loaded there (a server that rejoined since): nothing to free

    def rejoin(self, server: VLLMServer) -> None:
        """A server back in the pool (restarted, or answering again) gets the served version from disk; it
        is not in the group any more, so the next version forms a new generation."""
        if self.lora:
            for version in sorted(v for v in self.loaded if v):  # the served one, and any calls still use
                self.load_adapter(server, version)
            self.stale.discard(server)
            return
        if self.served:
            server.reload_weights(self.wait_for_folder(self.served), verify=False)
        self.stale.discard(server)
        if self.in_memory:
            self.regroup = True
