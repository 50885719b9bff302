import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from orchestrate.serving import models
from orchestrate.serving.models import ModelNotAvailable, resolve_model


def test_embedded_model_is_a_plain_hf_folder(embedded_model_dir):
    names = {p.name for p in embedded_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not any(name.endswith(".gguf") for name in names)
    # built once, then reused
    assert resolve_model("smollm2") == embedded_model_dir


def test_embedded_model_answers_7_plus_5(embedded_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32)
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    messages = [{"role": "user", "content": "What is 7 + 5?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nWhat is 7 + 5?<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "12" in answer, answer


def test_llama_cpp_is_not_installed():
    import importlib.util

    assert importlib.util.find_spec("llama_cpp") is None
    assert importlib.util.find_spec("torchvision") is None


def test_local_folder_and_bad_names(tmp_path):
    with pytest.raises(ModelNotAvailable, match="config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ModelNotAvailable, match="smollm2"):
        resolve_model("./no/such/folder")
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path.resolve()


def test_hub_unreachable_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailable, match="local-dir") as refused:
        resolve_model("nobody-org/no-such-model-xyz")
    assert "no such folder here" in str(refused.value)  # a mistyped folder "runs/exp1" reads as a hub id too


def test_missing_package_says_what_to_do(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotAvailable, match="uv sync"):
        models.embedded_model_dir()


def test_untied_copy_is_the_same_model_with_its_head_written_out(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TAPELOOP_CACHE", str(tmp_path / "cache"))
    assert models.ties_output_head(tiny_model_dir)
    copy = models.untied_copy(tiny_model_dir)
    assert copy != tiny_model_dir and not models.ties_output_head(copy)
    assert models.untied_copy(tiny_model_dir) == copy  # built once
    assert models.untied_copy(copy) == copy  # an untied folder is served as it is
    tied = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    untied = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        torch.testing.assert_close(untied(ids).logits, tied(ids).logits, atol=0, rtol=0)
    assert AutoTokenizer.from_pretrained(copy).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    ) == AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )
