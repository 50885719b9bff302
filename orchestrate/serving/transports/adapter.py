"""The adapter path (a LoRA run, `--train.lora.rank`): whole weights never move; each version is the adapter
folder in its checkpoint (megabytes), loaded into every server by path under a name of its own
(vllm_server.adapter_name: policy-vN; version 0 is the base model, served under the plain name, which is
also what the reference is scored on), with each role's own beside it (agent.roles bound to `adapter`:
checkpoints/N/adapter/ROLE/, served as policy-ROLE-vN). The adapter of the version before is unloaded once the new one is in;
while episodes run (async_level >= 1) calls are not drained around a swap: those in flight finish under the
old adapter, which is unloaded when the last of them is done."""

from __future__ import annotations

from contract.rundir import role_adapters
from orchestrate.serving.vllm_server import RemoteServer, ServerError, VLLMServer, adapter_name
from orchestrate.serving.weights import Transport


class AdapterTransport(Transport):
    def __init__(self, *args):
        super().__init__(*args)
        self.loaded: set[int] = set()  # the versions whose adapters the servers hold (calls use them)
        self.roles: list[str] = []  # the roles with adapters of their own (found in the first version loaded)

    def put(self, version: int, verify: bool, keep_previous: bool) -> list[tuple[VLLMServer, str]]:
        """Load version `version`'s adapter into every server, then (unless `keep_previous`) unload the one
        served before. No log-prob check as after a reload from disk: the adapter has a name of its own, so a
        call is served by it or refused, never by the weights before."""

        def put(server: VLLMServer) -> None:
            self.load_adapter(server, version, fresh=version > self.served)
            if not keep_previous and self.served and self.served != version:
                self._unload_adapter(server, self.served)

        failed = self.on_every_server(put)
        self.loaded = ((self.loaded | {self.served}) if keep_previous else set()) | {version}
        return failed

    def load_adapter(self, server: VLLMServer, version: int, fresh: bool = False) -> None:
        """Version `version`'s adapter into `server` under its name, replacing one of that name (a server by
        URL may hold an earlier run's, a server that rejoins an older copy): then its prefix cache is
        dropped, since vLLM keys cached prefixes by the adapter's name (vLLM #42125). `fresh`: the name is
        new to this server (one of ours, the next version), so nothing cached can be stale."""
        path = self.run.adapter(version).resolve()  # by absolute path: servers elsewhere see the same
        if not self.run.has_adapter(version):
            raise ServerError(f"version {version} has no adapter at {path}")
        roles = role_adapters(path)
        self.roles = self.roles or list(roles)
        for role, folder in roles.items():  # each role's own first: the policy's name says the version is in
            server.load_adapter(adapter_name(server.served_model_name, version, role), folder)
        server.load_adapter(adapter_name(server.served_model_name, version), path)
        if not fresh or isinstance(server, RemoteServer):
            server.reset_prefix_cache()

    def unload(self, version: int) -> None:
        """Every server frees version `version`'s adapter."""
        if version in self.loaded and version != self.served:
            for server in self.servers:
                self._unload_adapter(server, version)
            self.loaded.discard(version)

    def _unload_adapter(self, server: VLLMServer, version: int) -> None:
        for role in [None, *self.roles]:
            try:
                server.unload_adapter(adapter_name(server.served_model_name, version, role))
            except ServerError:
                pass  # not loaded there (a server that rejoined since): nothing to free

    def rejoin(self, server: VLLMServer) -> None:
        for version in sorted(v for v in self.loaded if v):  # the served one, and any calls still use
            self.load_adapter(server, version)
        self.stale.discard(server)
