"""Methods added to vLLM's workers (`--worker-extension-cls`), asked through vLLM's `/collective_rpc` route:
`output_lengths` for new weights swapped in while calls are in flight (`--run.in_flight_swaps`,
orchestrate.loop.servers), `drop_weight_group` for a weight-transfer group dropped after a failure,
`model_runner_kind` for the record (bench/check_gpu_path.py).

With the engine paused between two steps (`POST /pause?mode=keep`), `output_lengths` says how many tokens
each request has sampled so far: those came from the weights served until then, the rest of the call will
come from the new ones. The orchestrator asks it through vLLM's `/collective_rpc` route and records the
token where each call changed version (tapes.tape.LLMCall.version_changes). The worker's request states are
its model runner's, from a request's first scheduled step until the step after it finishes, so a request
still waiting for its first step is absent: it has sampled nothing. vLLM has two runners and picks one per
server (0.26: V2 for dense models where Triton runs, so on CUDA; `VLLM_USE_V2_MODEL_RUNNER` overrides); they
keep the states apart, alike from vLLM 0.26 to 0.32:
- V1 (`vllm/v1/worker/gpu_model_runner.py`, and the CPU runner built on it): `requests`, each request's state
  with its `output_token_ids`;
- V2 (`vllm/v1/worker/gpu/model_runner.py`): `req_states`, a slot per request (`req_id_to_index`) in tables
  of lengths: `total_len` (prompt and sampled tokens, kept on the device) less `prompt_len`.
The worker logs, at its first answer, which runner it read.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.tapeloop")  # vLLM's handlers: the server's log


def runner_kind(runner) -> str:
    """'V1' or 'V2', by the attributes the runner keeps its requests in; TypeError for neither."""
    if hasattr(runner, "req_states"):
        return "V2"
    if hasattr(runner, "requests"):
        return "V1"
    raise TypeError(f"{type(runner).__name__} keeps neither `requests` (vLLM's V1 model runner) nor "
                    "`req_states` (V2): output lengths cannot be read")  # fmt: skip


def v1_lengths(runner) -> dict[str, int]:
    # -1: a placeholder for a token still being sampled (asynchronous scheduling); none once paused
    return {rid: sum(t >= 0 for t in state.output_token_ids) for rid, state in runner.requests.items()}


def v2_lengths(runner) -> dict[str, int]:
    states = runner.req_states
    total = states.total_len.gpu.tolist()  # one read from the device for every slot
    prompt = states.prompt_len.np
    return {rid: int(total[i] - prompt[i]) for rid, i in states.req_id_to_index.items()}


class WorkerExtension:
    """Mixed into vLLM's worker class by `--worker-extension-cls orchestrate.serving.vllm_plugin.worker_ext.WorkerExtension`."""

    def output_lengths(self) -> dict[str, int]:
        """Tokens sampled so far by each request the worker holds, by vLLM's internal request id."""
        runner = self.model_runner  # type: ignore[attr-defined]  # the worker's, at call time
        kind = runner_kind(runner)
        if not getattr(self, "_runner_logged", False):
            logger.info("in-flight swaps: output lengths read from vLLM's %s model runner (%s)",
                        kind, type(runner).__name__)  # fmt: skip
            self._runner_logged = True
        return v2_lengths(runner) if kind == "V2" else v1_lengths(runner)

    def model_runner_kind(self) -> str:
        """'V1' or 'V2': the model runner vLLM chose for this worker (runner_kind), for the record."""
        return runner_kind(self.model_runner)  # type: ignore[attr-defined]

    def drop_weight_group(self) -> bool:
        """Drop this worker's end of the weight-transfer group (its engine's `shutdown`), so that a broadcast
        to it fails at once instead of waiting out its timeout. vLLM 0.32 has a route for it
        (`/shutdown_weight_transfer_engine`); 0.26-0.31 have none, so the orchestrator asks this method there.
        False: the worker has no weight-transfer engine (started without `--weight-transfer-config`)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            return False
        engine.shutdown()
        return True
