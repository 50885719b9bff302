"""What vLLM's servers need on CUDA, checked on CPU with stand-ins (issue 56): the environment a server on a
GPU starts with, and the worker extension reading either model runner's request states."""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest
import torch

from orchestrate.serving import vllm_server
from orchestrate.serving.vllm_plugin.worker_ext import WorkerExtension, runner_kind
from orchestrate.serving.vllm_server import VLLMServer


@pytest.mark.parametrize("installed", [False, True])
def test_servers_on_cuda_sample_without_flashinfer_unless_it_is_installed(tmp_path, monkeypatch, installed):
    """vLLM's sampler imports flashinfer on CUDA while VLLM_USE_FLASHINFER_SAMPLER is on (its default): a
    server on a GPU without flashinfer has it off, unless its user set it; on CPU it is left alone."""
    monkeypatch.setattr(vllm_server, "flashinfer_installed", lambda: installed)
    server = VLLMServer("model", log_path=tmp_path / "policy.log")
    server.on_gpu = True  # as cuda_available() says on a GPU machine
    assert server.environment({}).get("VLLM_USE_FLASHINFER_SAMPLER") == (None if installed else "0")
    assert server.environment({"VLLM_USE_FLASHINFER_SAMPLER": "1"})["VLLM_USE_FLASHINFER_SAMPLER"] == "1"
    server.on_gpu = False
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in server.environment({})


def v1_runner():
    """vLLM's V1 model runner as the extension reads it: `requests`, each state with its `output_token_ids`
    (-1: a token still being sampled)."""
    state = types.SimpleNamespace
    return types.SimpleNamespace(requests={"a": state(output_token_ids=[5, 6, 7]), "b": state(output_token_ids=[]),
                                           "c": state(output_token_ids=[9, -1])})  # fmt: skip


def v2_runner():
    """vLLM's V2 model runner as the extension reads it (vllm/v1/worker/gpu/states.py RequestState, 0.26 and
    0.32): slots by request id, prompt lengths in host memory, prompt + sampled lengths on the device."""
    slots, prompt, total = {}, np.zeros(4, dtype=np.int32), torch.zeros(4, dtype=torch.int32)
    for rid, slot, prompt_len, sampled in [("a", 3, 10, 3), ("b", 0, 7, 0), ("c", 1, 4, 1)]:
        slots[rid], prompt[slot], total[slot] = slot, prompt_len, prompt_len + sampled
    states = types.SimpleNamespace(req_id_to_index=slots, prompt_len=types.SimpleNamespace(np=prompt),
                                   total_len=types.SimpleNamespace(gpu=total))  # fmt: skip
    return types.SimpleNamespace(req_states=states)


@pytest.mark.parametrize("runner, kind", [(v1_runner, "V1"), (v2_runner, "V2")])
def test_output_lengths_are_read_from_either_model_runner_and_the_worker_says_which(runner, kind, caplog):
    class Worker(WorkerExtension):  # vLLM mixes the extension into its worker class, which holds the runner
        def __init__(self):
            self.model_runner = runner()

    worker = Worker()
    with caplog.at_level(logging.INFO, logger="vllm.tapeloop"):
        assert worker.output_lengths() == {"a": 3, "b": 0, "c": 1}
        worker.output_lengths()
    said = [r.getMessage() for r in caplog.records if "model runner" in r.getMessage()]
    assert len(said) == 1 and f"vLLM's {kind} model runner" in said[0]  # once per worker
    assert worker.model_runner_kind() == kind  # what the GPU check records


def test_a_runner_with_neither_attribute_is_refused_by_name():
    with pytest.raises(TypeError, match="neither `requests`"):
        runner_kind(types.SimpleNamespace(input_batch=None))
