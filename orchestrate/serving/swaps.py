"""New weights while calls run (the asynchronous pipeline): the gate a client's calls pass, and what each call
records of the versions that served it.

`swap_weights` puts a new version on the servers while episodes run: new calls wait, and those in flight
either finish first ("drain"), so that each call records the one policy version that produced all of its
tokens, or ("keep", in-flight swaps) are paused between two engine steps and go on under the new weights,
the call recording the token where its version changed (`mark_versions`); LoRA adapters ("adapter") need
neither: calls in flight go on under the old adapter's name. Used by orchestrate.serving.llm.VLLMClient.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from contract.weight_paths import ADAPTER, DRAIN, KEEP
from tapes.tape import VersionChange


class Flight:
    """A call being generated: the server and request id of its current attempt, and the versions that took
    over during it (mark_versions)."""

    __slots__ = ("endpoint", "request", "changes")

    def __init__(self):
        self.endpoint: Any = None  # orchestrate.serving.pool.Endpoint
        self.request: str | None = None
        self.changes: list[VersionChange] = []


class WeightGate:
    """The calls in flight, per version, and the gate a weight swap closes. `weights_lock` is the pool's (a
    server rejoining loads the weights under it: never during a swap)."""

    def __init__(self, policy_version: int, weights_lock: Callable[[], asyncio.Lock]):
        self.policy_version = policy_version
        self.weights_lock = weights_lock
        # closed while servers reload; `_idle` is set when no call is in flight
        self._gate = asyncio.Event()
        self._gate.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._active = 0
        self._by_version: dict[int, int] = {}  # calls in flight per version that serves them
        self._version_left = asyncio.Event()  # set when a call leaves (version_idle checks again)
        self.held_s = 0.0  # seconds calls were held back by weight swaps (drain + reload)
        self.flights: set[Flight] = set()  # generating calls: their server and request id, versions

    async def swap_weights(self, reload: Callable[[], Awaitable[Any]], version: int, mode: str = DRAIN) -> float:
        """New weights while calls run: `reload()` puts `version` on the servers, and calls started from then
        on are served by it. Returns the seconds calls were held back. `mode`:

        - "drain": new calls wait, the calls in flight finish, `reload()` runs, calls go on. One version per
          call, so a call's log-probs are exactly its version's; the cost is the longest call in flight.
        - "keep": new calls wait only while `reload()` runs; it pauses the servers between two engine steps
          with the calls in flight kept, swaps the weights, says with `mark_versions` how many tokens each
          call had sampled, and resumes them: a call may span two versions (LLMCall.version_changes).
        - "adapter" (a LoRA run: each version an adapter of its own name, the older one still loaded):
          nothing waits; calls go on under the old version while `reload()` loads the new one, then new
          calls name the new one; the old one may be unloaded once `version_idle` says so.
        """
        if mode not in (DRAIN, KEEP, ADAPTER):
            raise ValueError(f"swap mode {mode!r}: drain, keep or adapter")
        start = time.perf_counter()
        if mode == ADAPTER:
            async with self.weights_lock():
                await reload()
                self.policy_version = version
            return 0.0
        self._gate.clear()
        try:
            if mode == DRAIN:
                await self._idle.wait()
            async with self.weights_lock():  # a server rejoining meanwhile loads the weights after this
                await reload()
                self.policy_version = version
        finally:
            self._gate.set()
        held = time.perf_counter() - start
        self.held_s += held
        return held

    def mark_versions(self, endpoint: Any, lengths: dict[str, int], version: int) -> int:
        """`endpoint` now serves `version` under the calls it had in flight (paused: "keep" above), which had
        sampled `lengths` tokens each (by vLLM's request id, which holds ours: orchestrate.serving.vllm_plugin.worker_ext). A
        call the engine had not started is not in `lengths`, nor is one it finished: recorded as they began
        (the older version, the cautious side for the learner's lag). Returns the calls marked."""
        marked = 0
        for flight in self.flights:
            if flight.endpoint is not endpoint or flight.request is None:
                continue
            mine = f"cmpl-{flight.request}-"
            n = next((n for request, n in lengths.items() if request.startswith(mine)), None)
            if n is not None:
                flight.changes.append(VersionChange(token=n, version=version))
                marked += 1
        return marked

    async def version_idle(self, version: int) -> None:
        """Return once no call served by `version` is in flight (new calls name a newer one)."""
        while self._by_version.get(version, 0) > 0:
            self._version_left.clear()
            await self._version_left.wait()

    @property
    def in_flight(self) -> int:
        """Calls sent and not yet answered."""
        return self._active

    async def enter(self) -> int:
        """Wait for an open gate and count the call in flight; returns the version that serves it."""
        while not self._gate.is_set():
            await self._gate.wait()
        self._active += 1
        self._idle.clear()
        version = self.policy_version
        self._by_version[version] = self._by_version.get(version, 0) + 1
        return version

    def leave(self, version: int) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()
        self._by_version[version] -= 1
        self._version_left.set()
