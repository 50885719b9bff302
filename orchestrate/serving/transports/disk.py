"""The disk path: every server reloads the checkpoint's model folder by path (/collective_rpc reload_weights),
checked by a change of log-probs unless the learner recorded that the weights did not change."""

from __future__ import annotations

from orchestrate.serving.vllm_server import VLLMServer
from orchestrate.serving.weights import Transport


class DiskTransport(Transport):
    def put(self, version: int, verify: bool, keep_previous: bool) -> list[tuple[VLLMServer, str]]:
        return self.reload_all(version, verify=verify)

    def rejoin(self, server: VLLMServer) -> None:
        self.reload(server)
