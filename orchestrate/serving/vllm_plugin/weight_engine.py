"""The `vllm.general_plugins` entry point (pyproject.toml), which vLLM calls in each of its processes.

It registers our weight-transfer engines (contract.weight_paths.ENGINES: the servers' end of the collective
path is orchestrate.serving.vllm_plugin.collective_engine) with vLLM's factory by path, so nothing of vLLM's
weight-transfer API is imported until a server started with `--weight-transfer-config` asks for one; this
module itself imports no vLLM at all. In a LoRA run's servers on CPU it also installs faster LoRA ops
(orchestrate.serving.vllm_plugin.cpu_lora).
"""

from __future__ import annotations

import os

from contract.weight_paths import ENGINES
from orchestrate.serving.auth import LORA_ENV


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, path in ENGINES.items():
        if name not in WeightTransferEngineFactory._registry:
            module, _, cls = path.partition(":")
            WeightTransferEngineFactory.register_engine(name, module, cls)
    if os.environ.get(LORA_ENV, "0") != "0":  # a LoRA run's server on CPU: one matmul per adapter
        from orchestrate.serving.vllm_plugin.cpu_lora import install

        install()
