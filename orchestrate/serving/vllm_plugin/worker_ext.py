"""A method added to vLLM's workers (`--worker-extension-cls`), for new weights swapped in while calls are
in flight (`--run.in_flight_swaps`, orchestrate.loop.servers).

With the engine paused between two steps (`POST /pause?mode=keep`), `output_lengths` says how many tokens
each request has sampled so far: those came from the weights served until then, the rest of the call will
come from the new ones. The orchestrator asks it through vLLM's `/collective_rpc` route and records the
token where each call changed version (tapes.tape.LLMCall.version_changes). The worker's request states are
vLLM's (`model_runner.requests`: a request is there from its first scheduled step until the step after it
finishes), so a request still waiting for its first step is absent: it has sampled nothing.
"""

from __future__ import annotations


class OutputLengths:
    """Mixed into vLLM's worker class by `--worker-extension-cls orchestrate.serving.vllm_plugin.worker_ext.OutputLengths`."""

    def output_lengths(self) -> dict[str, int]:
        """Tokens sampled so far by each request the worker holds, by vLLM's internal request id."""
        runner = self.model_runner  # type: ignore[attr-defined]  # the worker's, at call time
        # -1: a placeholder for a token still being sampled (asynchronous scheduling); none once paused
        return {rid: sum(t >= 0 for t in state.output_token_ids) for rid, state in runner.requests.items()}
