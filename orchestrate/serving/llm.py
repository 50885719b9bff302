"""LLMs an agent can call. Every call comes back as a whole `LLMCall`.

`VLLMClient` talks to one or more vLLM OpenAI-compatible servers: it sends token ids (the agent renders them,
see `agents.chat`), so the prompt ids on the tape are exactly what the model saw, and it keeps the output
token ids vLLM sampled (never re-tokenized text) with their log-probs. It is three parts, each a file:

- the calls, here: the request a call sends, and the LLMCall (or reference log-probs) it reads back;
- the servers, `orchestrate.serving.pool.ServerPool`: the least-busy server that is up, failover, health
  checks, retries, a server taken out and rejoining;
- new weights while calls run, `orchestrate.serving.swaps.WeightGate`: the gate a weight swap closes, the
  version each call records, and where a version took over under a call in flight.

Calls answered from a tape instead (replay, fork): `orchestrate/serving/recorded.py`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import httpx

from contract.weight_paths import DRAIN
from orchestrate.serving.pool import Endpoint, LLMError, NoServerLeft, RequestRejected, ServerPool
from orchestrate.serving.swaps import Flight, WeightGate
from tapes.tape import LLMCall, SamplingParams

__all__ = ["Endpoint", "LLMError", "NoServerLeft", "RequestRejected", "Scores", "VLLMClient"]


def _token_id(token: str) -> int:
    # with return_tokens_as_token_ids, vLLM names each token "token_id:<id>"
    return int(token.rsplit(":", 1)[1])


class VLLMClient:
    """Calls on a pool of vLLM servers, each recording the policy version that served it."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        tokenizer: Any = None,
        *,
        model: str = "",
        policy_version: int = 0,
        max_concurrency: int = 64,
        timeout_s: float = 900,
        max_retries: int = 4,
        on_failure: Callable[[Endpoint, Exception], Awaitable[None]] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        extra_body: dict[str, Any] | None = None,
        on_rejoin: Callable[[Endpoint], Awaitable[None]] | None = None,
        out: Sequence[Endpoint] = (),
        health_interval_s: float = 10.0,
        rejoin_timeout_s: float = 120.0,
        adapter: Callable[..., str | None] | None = None,
        models: dict[str, VLLMClient] | None = None,
    ):
        self.pool = ServerPool(endpoints, max_concurrency=max_concurrency, timeout_s=timeout_s,
                               max_retries=max_retries, on_failure=on_failure, on_rejoin=on_rejoin, out=out,
                               health_interval_s=health_interval_s, rejoin_timeout_s=rejoin_timeout_s,
                               transport=transport)  # fmt: skip
        self.gate = WeightGate(policy_version, self.pool.weights_lock)
        self.endpoints = self.pool.endpoints
        self.tokenizer = tokenizer
        self.model = model
        # a LoRA run: the name version v's adapter is served under, adapter(v) the policy's and adapter(v, ROLE) a
        # role's own (None: the base model's own name)
        self.adapter = adapter
        self.extra_body = dict(extra_body or {})  # more vLLM sampling fields, e.g. {"ignore_eos": True}
        # the frozen models roles are bound to, each on servers of its own (agent.roles): binding -> its client
        self.models = dict(models or {})

    async def aclose(self) -> None:
        await self.pool.aclose()
        for client in self.models.values():
            await client.aclose()

    async def __aenter__(self) -> VLLMClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # -- what the loop asks of it: the pool's and the gate's, here for one object to hold ---------------

    @property
    def policy_version(self) -> int:
        return self.gate.policy_version

    @property
    def held_s(self) -> float:
        """Seconds calls were held back by weight swaps."""
        return self.gate.held_s

    @property
    def in_flight(self) -> int:
        return self.gate.in_flight

    @property
    def requests(self) -> int:
        return self.pool.requests

    @property
    def retries(self) -> int:
        return self.pool.retries

    @property
    def taken_out(self) -> int:
        return self.pool.taken_out

    async def swap_weights(self, reload: Callable[[], Awaitable[Any]], version: int, mode: str = DRAIN) -> float:
        """`WeightGate.swap_weights`: `reload()` puts `version` on the servers while calls run."""
        return await self.gate.swap_weights(reload, version, mode)

    def mark_versions(self, endpoint: Endpoint, lengths: dict[str, int], version: int) -> int:
        return self.gate.mark_versions(endpoint, lengths, version)

    async def version_idle(self, version: int) -> None:
        await self.gate.version_idle(version)

    def take_out(self, endpoint: Endpoint, reason: Exception | None = None) -> None:
        self.pool.take_out(endpoint, reason)

    def up_endpoints(self) -> list[Endpoint]:
        return self.pool.up_endpoints()

    def requests_per_server(self) -> list[int]:
        return self.pool.requests_per_server()

    # -- calls ------------------------------------------------------------------------------------

    async def complete_ids(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt_text: str = "",
        base: bool = False,
        role: str | None = None,
    ) -> LLMCall:
        """One completion of `prompt_ids`, by the policy's current version (its adapter, on a LoRA run), or with
        `base` by the servers' base model (a LoRA run's initial policy: `base_model`), recorded as version 0, or
        with `role` by the current version of that role's own adapter (`role_model`)."""
        payload: dict[str, Any] = {
            "prompt": prompt_ids,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": True,
        }
        if sampling.seed is not None:
            payload["seed"] = sampling.seed
        if sampling.stop:
            # the stop string stays in the output: a tool call ends with its closing tag, and the next
            # prompt continues from exactly the tokens sampled
            payload["stop"] = sampling.stop
            payload["include_stop_str_in_output"] = True
        payload.update(self.extra_body)
        version = await self.gate.enter()
        adapter = None
        if self.adapter is not None and not base:
            adapter = self.adapter(version) if role is None else self.adapter(version, role)
        if adapter:
            payload["model"] = adapter  # instead of the server's base name
        start = time.perf_counter()
        flight = Flight()
        self.gate.flights.add(flight)
        try:
            body = await self.pool.post(payload, flight)
        finally:
            self.gate.flights.discard(flight)
            self.gate.leave(version)
        choice = body["choices"][0]
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        values = logprobs.get("token_logprobs") or []
        if len(tokens) != len(values) or any(v is None for v in values):
            raise LLMError(f"vLLM returned {len(tokens)} tokens but {len(values)} log-probs")
        output_ids = [_token_id(t) for t in tokens]
        return LLMCall(
            model=f"{self.model} + adapter {adapter}" if adapter else self.model,
            policy_version=0 if base else version,
            version_changes=[] if base else [c for c in flight.changes if c.token < len(output_ids)],
            messages=list(messages or []),
            prompt_text=prompt_text,
            prompt_token_ids=prompt_ids,
            output_text=choice.get("text", ""),
            output_token_ids=output_ids,
            logprobs=[float(v) for v in values],
            finish_reason=choice.get("finish_reason"),
            sampling=sampling,
            latency_s=time.perf_counter() - start,
        )

    def base_model(self) -> ServedModel:
        """The servers' base model without the adapter, as an LLM of its own (a LoRA run's initial policy,
        frozen: the roles bound to `base`, agent.roles)."""
        if self.adapter is None and self.policy_version == 0:
            return self  # it serves the initial policy itself (a LoRA run's version 0, as eval serves it)
        if self.adapter is None:
            raise ValueError("base_model: this client serves version "
                             f"{self.policy_version}'s own weights, not a LoRA run's adapters beside its base")  # fmt: skip
        return ServedModel(self)

    def role_model(self, role: str) -> ServedModel:
        """Role `role`'s own adapter on the servers, as an LLM of its own (agent.roles bound to `adapter`: each
        version's ROLE adapter beside the policy's; version 0 is the base model, as the policy's)."""
        if self.adapter is None and self.policy_version:
            raise ValueError(f"role_model: this client serves version {self.policy_version}'s own weights, not a "
                             "LoRA run's adapters beside its base")  # fmt: skip
        return ServedModel(self, role=role)

    def model_of(self, binding: str) -> VLLMClient:
        """The client of the frozen model `binding` names (a role bound to a model: agent.roles), served beside
        the policy; its calls record it as their model, version 0."""
        if binding not in self.models:
            raise ValueError(f"model_of: no server of {binding!r} was started beside this client's "
                             f"({', '.join(self.models) or 'none'})")  # fmt: skip
        return self.models[binding]

    async def score(self, token_ids: list[int], n_prompt: int) -> list[float]:
        """Log-probs of token_ids[n_prompt:] given what precedes them (reference scoring).

        Uses echo + prompt_logprobs on the token-id prompt and checks that every
        returned entry is for the token that was sent: a missing or misaligned
        log-prob is an error, never a zero.
        """
        return (await self._score(token_ids, n_prompt, 0)).logprobs

    async def score_top(self, token_ids: list[int], n_prompt: int, k: int) -> Scores:
        """`score`, and at each scored position the model's k most likely tokens with their log-probs, most
        likely first (a teacher's top-k, --teacher.topk). Fewer than k at a position is an error."""
        if k < 1:
            raise ValueError(f"k={k}: score_top needs k >= 1 (score() gives the sampled tokens' alone)")
        return await self._score(token_ids, n_prompt, k)

    async def _score(self, token_ids: list[int], n_prompt: int, k: int) -> Scores:
        if not 0 < n_prompt <= len(token_ids):
            raise ValueError(f"n_prompt={n_prompt} for {len(token_ids)} tokens")
        body = await self.pool.post(
            {"prompt": token_ids, "max_tokens": 0, "echo": True, "temperature": 1.0, "prompt_logprobs": k}
        )
        entries = body["choices"][0].get("prompt_logprobs")
        if entries is None or len(entries) != len(token_ids):
            got = None if entries is None else len(entries)
            raise LLMError(f"reference scoring: expected {len(token_ids)} prompt log-probs, got {got}")
        out, top_ids, top_logprobs = [], [], []
        for position in range(n_prompt, len(token_ids)):
            entry = entries[position] or {}
            found = entry.get(str(token_ids[position]))
            if found is None:
                raise LLMError(f"reference scoring: no log-prob for token {token_ids[position]} at {position}")
            out.append(float(found["logprob"]))
            if k:
                # vLLM gives the sent token (whatever its rank) and the k most likely, each with its rank
                top = sorted((v["rank"], int(t), float(v["logprob"])) for t, v in entry.items()
                             if v.get("rank") is not None and v["rank"] <= k)  # fmt: skip
                if len(top) != k:
                    raise LLMError(f"reference scoring: {len(top)} of the top {k} log-probs at {position}")
                top_ids.append([t for _, t, _ in top])
                top_logprobs.append([lp for _, _, lp in top])
        return Scores(out, top_ids if k else None, top_logprobs if k else None)


class ServedModel:
    """Another model a LoRA run's policy servers serve beside the policy: the base model (`VLLMClient.base_model`),
    calls without an adapter; or, given a `role`, that role's own adapter (`VLLMClient.role_model`)."""

    def __init__(self, client: VLLMClient, role: str | None = None):
        self.client, self.role = client, role

    async def complete_ids(self, prompt_ids, sampling, *, messages=None, prompt_text: str = "") -> LLMCall:
        return await self.client.complete_ids(prompt_ids, sampling, messages=messages, prompt_text=prompt_text,
                                              base=self.role is None, role=self.role)  # fmt: skip


class Scores(NamedTuple):
    """What scoring gives for the scored positions: the sent tokens' log-probs and, when asked (top-k), each
    position's k most likely token ids and their log-probs, most likely first (else None)."""

    logprobs: list[float]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
