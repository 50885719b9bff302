"""The collective path (gloo or nccl, the mechanism's backend): the learner broadcasts each version over a
process group of its own with every server's workers (protocol and wire format: contract.weight_wire; the
learner's end: finetune.publish.collective; the servers' engine: orchestrate.serving.vllm_plugin.collective_engine).

- `start()` hosts the group's TCP store here, writes RUN/weight_group.json for the learner and asks every
  server to join (both sides block until all have); a server that cannot join (one by URL started without
  weight transfer, say) leaves the run on the disk path, with one line saying why.
- `serve(N)` drives every server's receive of version N (they load it only once it has arrived whole and
  matches its manifest), then writes RUN/weights_ack.json. If a server refused or failed, the ack says so:
  the learner writes version N's folder, the servers reload it from disk (a server that cannot is out of the
  pool), and a new generation of the group is formed before the next version. At the first server that
  fails every server drops the group, so that no broadcast waits out its timeout.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor, as_completed, wait

from contract.durable import atomic_write_json
from contract.weight_paths import DEFAULT
from contract.weight_wire import signal_abort
from orchestrate.serving.transports.disk import DiskTransport
from orchestrate.serving.vllm_server import RemoteServer, ServerError, VLLMServer


class CollectiveTransport(DiskTransport):
    def __init__(self, *args):
        super().__init__(*args)
        self.in_memory = True  # False once a group cannot form: the disk path from then on
        self.store = None
        self.generation = 0
        self.regroup = False  # a transfer failed: form a new generation before the next version
        self.probed = 0  # the generation whose first version was checked by a change of log-probs

    def start(self) -> None:
        self._form_group()

    def serve(self, version: int, verify: bool = True, keep_previous: bool = False) -> list[str]:
        failed = super().serve(version, verify=verify, keep_previous=keep_previous)
        if self.regroup and self.in_memory:
            self._form_group()
        return failed

    def put(self, version: int, verify: bool, keep_previous: bool) -> list[tuple[VLLMServer, str]]:
        manifest = self.run.transfer_manifest(version) if self.in_memory else None
        if manifest is None or manifest.get("generation") != self.generation:  # not sent: from its folder
            return self.reload_all(version, verify=verify)
        if self.regroup:  # a server rejoined since the group formed: it cannot take part
            self._abort_group(
                "a server rejoined"
            )  # the learner's broadcast fails at once instead of waiting out its timeout
            failed = [(s, "a server rejoined: the group is formed anew") for s in self.servers]
        else:
            failed = self._transfer(version, manifest, probe=verify and self.probed != self.generation)
        atomic_write_json(self.run.weights_ack, {"version": version, "ok": not failed,
                                                 "reason": "; ".join(r for _, r in failed)})  # fmt: skip
        if failed:  # the learner writes the version's folder now: reload every server from it
            self.regroup = True
            failed = self.reload_all(version, verify=False)
        return failed

    def rejoin(self, server: VLLMServer) -> None:
        """From disk: the server is not in the group any more, so the next version forms a new generation."""
        self.reload(server)
        if self.in_memory:
            self.regroup = True

    # -- the group -------------------------------------------------------------------

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
        info = {"generation": self.generation, "backend": self.mechanism.name, "host": self.store_host,
                "port": self.store.port, "world_size": 1 + sum(sizes), "timeout_s": self.timeout_s}  # fmt: skip
        atomic_write_json(self.run.weight_group, info)  # the learner joins as rank 0
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        payloads = [
            {"backend": self.mechanism.backend, "host": self.store_host, "port": self.store.port,
             "world_size": info["world_size"], "rank_offset": off, "timeout_s": self.timeout_s}
            for off in offsets
        ]  # fmt: skip
        pool = ThreadPoolExecutor(len(self.servers))
        joins = [pool.submit(self._join, server, payload) for server, payload in zip(self.servers, payloads)]
        try:
            while not all(j.done() for j in joins):
                wait(joins, timeout=0.5)
                # the learner joins as rank 0: one that died (a bad option, out of memory) would leave every
                # rank waiting out timeout_s; its error is raised, the servers told to drop their ends
                self.trainer.check_alive()
        except BaseException:
            self._abort_group("the learner is gone")
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        results = [j.result() for j in joins]
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

    def _abort_group(self, why: str) -> None:
        """Every rank drops its end of the group: told on the group's store, the learner and the servers in a
        broadcast abort theirs (over NCCL another rank's abort does not reach them), and every server is asked
        to drop its end (over gloo their sockets close, so a broadcast in progress fails)."""
        signal_abort(self.store_host, self.store.port, why)
        for server in self.servers:
            try:
                server.drop_weight_group()
            except ServerError:
                pass  # a dead server has no group to drop

    def _give_up(self, why: str) -> None:
        """The disk path from here on; the learner reads the default mechanism's name in the announcement."""
        print(f"weights: {self.mechanism.name} transfer unavailable ({why}); new weights go through the disk")
        self.in_memory = False
        atomic_write_json(self.run.weight_group, {"generation": self.generation + 1, "backend": DEFAULT})

    # -- one version -------------------------------------------------------------------

    def _transfer(self, version: int, manifest: dict, probe: bool) -> list[tuple[VLLMServer, str]]:
        """Every server receives version `version`. At the first that fails, every rank drops its end of the
        group: a server that failed before it took part in the broadcast would otherwise hold the learner's
        broadcast, and the others', until the group's timeout (the next version forms a new one). `probe`:
        check the load by a change of log-probs, as a disk reload is (the first version of a generation: a
        group that delivers bytes the model does not take shows once)."""
        with ThreadPoolExecutor(len(self.servers)) as pool:
            futures = {pool.submit(self._receive, s, version, manifest, probe): s for s in self.servers}
            results = {}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                if results[futures[future]] and sum(map(bool, results.values())) == 1:
                    self._abort_group(f"{futures[future].base_url}: {results[futures[future]]}")
        failed = [(s, results[s]) for s in self.servers if results[s]]
        for server in self.servers:
            if server not in dict(failed):
                self.stale.discard(server)
        if probe and not failed:
            self.probed = self.generation
        return failed

    def _receive(self, server: VLLMServer, version: int, manifest: dict, probe: bool = False) -> str | None:
        try:
            before = server.probe_logprobs() if probe else None
            server._post("/start_weight_update")
            server._post("/update_weights", {"update_info": {"version": version, "manifest": manifest}},
                         timeout=self.timeout_s + 30)  # fmt: skip
            server._post("/finish_weight_update", {"weight_version": str(version)})
            server._post("/reset_prefix_cache")  # cached KV was computed with the old weights
            if probe and server.probe_logprobs() == before:
                return (f"version {version} was received in memory but left the model's log-probs unchanged: "
                        "its weights did not take")  # fmt: skip
        except ServerError as exc:
            return str(exc).splitlines()[0]
        return None
