import json

import pytest

from contract.durable import PARTIAL_SUFFIX, AtomicFile
from tapes import (
    EnvAction,
    EnvObservation,
    LLMCall,
    SamplingParams,
    Tape,
    TapeFileError,
    TapeMetadata,
    TapeWriter,
    ToolCallAction,
    ToolResultObservation,
    read_tapes,
    write_tapes,
)
from tapes.store import line_offsets, read_tape_at


def make_tape(i: int = 0) -> Tape:
    call = LLMCall(
        model="smollm2",
        policy_version=3,
        messages=[{"role": "user", "content": "What is 7 + 5?"}],
        prompt_text="<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n",
        prompt_token_ids=[1, 2, 3],
        output_text="7 + 5 = 12. \\boxed{12}",
        output_token_ids=[10, 11, 12, 13],
        logprobs=[-0.5, -0.25, -1.0, -0.125],
        ref_logprobs=[-0.5, -0.3, -1.1, -0.1],
        finish_reason="stop",
        sampling=SamplingParams(temperature=0.7, max_tokens=64, seed=i),
    )
    tape = Tape(
        metadata=TapeMetadata(
            task_id=f"t{i}", group_id="g0", iteration=2, policy_version=3, reward=1.0, reward_reason="correct"
        ),
        context={"source": "test"},
    )
    tape.append(EnvObservation(text="What is 7 + 5?", info={"answer": "12"}))
    tape.append(ToolCallAction(text="<python>print(7 + 5)</python>", tool="python", call="print(7 + 5)"), llm_call=call)
    tape.append(ToolResultObservation(text="12", turn=1, reward=0.0, tool="python", info={"exit_code": 0}))
    tape.append(EnvAction(text=call.output_text, turn=2), llm_call=call)
    tape.append(EnvObservation(text="correct", turn=2, reward=1.0, terminated=True))
    return tape


def test_save_load_roundtrip_every_step_kind(tmp_path):
    tapes = [make_tape(i) for i in range(3)]
    path = write_tapes(tmp_path / "iter_000002.jsonl", tapes)
    loaded = list(read_tapes(path))
    assert loaded == tapes
    # the classes come back, not dicts
    assert [type(s) for s in loaded[0].steps] == [
        EnvObservation, ToolCallAction, ToolResultObservation, EnvAction, EnvObservation
    ]  # fmt: skip
    # the call is stored once and referenced by every step it produced
    assert len(loaded[0].llm_calls) == 1
    assert loaded[0].steps[1].metadata.prompt_id == loaded[0].llm_calls[0].id
    assert loaded[0].llm_call(loaded[0].steps[3].metadata.prompt_id).output_token_ids == [10, 11, 12, 13]


def test_json_shape_is_tapeagents_like(tmp_path):
    data = json.loads(make_tape().model_dump_json())
    assert set(data) >= {"metadata", "context", "steps"}
    assert {"id", "parent_id", "author", "n_added_steps", "error", "result"} <= set(data["metadata"])
    for step in data["steps"]:
        assert set(step["metadata"]) >= {"id", "prompt_id", "node", "agent", "other"}
        assert isinstance(step["kind"], str)
    assert data["steps"][2]["tool"] == "python"  # subclass fields are serialized


def test_unknown_kind_names_file_and_line(tmp_path):
    good = make_tape().model_dump_json()
    bad = json.loads(good)
    bad["steps"][1]["kind"] = "teleport"
    path = tmp_path / "tapes.jsonl"
    path.write_text(good + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TapeFileError) as err:
        list(read_tapes(path))
    assert f"{path}:2" in str(err.value)
    assert "teleport" in str(err.value)


def test_corrupt_line_names_file_and_line(tmp_path):
    good = make_tape().model_dump_json()
    path = tmp_path / "tapes.jsonl"
    path.write_text(good + "\n" + good + "\n" + good[: len(good) // 2] + "\n")
    reader = read_tapes(path)
    assert next(reader) == next(read_tapes(path))
    next(reader)
    with pytest.raises(TapeFileError) as err:
        next(reader)
    assert f"{path}:3" in str(err.value)
    assert "JSON" in str(err.value)


def test_missing_field_is_refused(tmp_path):
    bad = json.loads(make_tape().model_dump_json())
    del bad["steps"][2]["tool"]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(TapeFileError, match=r"t\.jsonl:1: steps"):
        list(read_tapes(path))


def test_tape_files_of_a_run_are_atomic_and_written_once(tmp_path):
    """The run writes tape files through contract.durable.AtomicFile: readable while they grow under
    .partial, complete only when renamed; a crash leaves no complete-looking file."""
    path = tmp_path / "iter.jsonl"
    f = AtomicFile(path)
    writer = TapeWriter(f)
    writer.write(make_tape(0))
    writer.write(make_tape(1))
    assert not path.exists()
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    assert [t.metadata.task_id for t in read_tapes(partial)] == ["t0", "t1"]
    f.commit()
    assert path.exists() and not partial.exists() and writer.count == 2
    with pytest.raises(FileExistsError):
        AtomicFile(path)
    with pytest.raises(FileExistsError):  # a plain tape file is written once too
        write_tapes(path, [make_tape(2)])

    crashed = tmp_path / "crashed.jsonl"
    with pytest.raises(RuntimeError):
        with AtomicFile(crashed) as f, TapeWriter(f) as writer:
            writer.write(make_tape(0))
            raise RuntimeError("crash")
    assert not crashed.exists()


def test_random_access_by_offset(tmp_path):
    tapes = [make_tape(i) for i in range(5)]
    path = write_tapes(tmp_path / "t.jsonl", tapes)
    offsets = line_offsets(path)
    assert len(offsets) == 5
    assert read_tape_at(path, offsets[3]).metadata.task_id == "t3"
