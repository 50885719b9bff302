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


def legacy_tape(i: int, answered: bool) -> dict:
    """A tape as the math agent wrote it before episodes (2026-11-21): a task step, then from its one call a
    reasoning thought and a final answer, or a parse failure; the reward on the metadata only."""
    call = {"id": f"call{i}", "model": "smollm2", "policy_version": 2, "prompt_token_ids": [1, 2, 3],
            "output_text": "7 + 5 = 12. \\boxed{12}" if answered else "twelve", "output_token_ids": [10, 11],
            "logprobs": [-0.5, -0.25], "ref_logprobs": None, "finish_reason": "stop",
            "sampling": {"temperature": 0.7, "top_p": 1.0, "max_tokens": 64, "seed": None, "stop": []},
            "created": 1.0}  # fmt: skip
    made = {"id": f"s{i}", "prompt_id": f"call{i}", "node": "math", "agent": "math_agent", "other": {}}
    answer = (
        [{"metadata": made, "kind": "reasoning_thought", "reasoning": "7 + 5 = 12."},
         {"metadata": {**made, "id": f"s{i}b"}, "kind": "final_answer_action", "answer": "12"}]
        if answered else [{"metadata": made, "kind": "parse_failure", "error": "no \\boxed{}", "output": "twelve"}]
    )  # fmt: skip
    return {
        "metadata": {"id": f"tape{i}", "task_id": f"t{i}", "group_id": "g", "iteration": 2, "policy_version": 2,
                     "reward": 1.0 if answered else 0.0, "reward_reason": "correct" if answered else "no answer"},
        "context": {"task": {"id": f"t{i}", "question": "What is 7 + 5?"}},
        "steps": [{"metadata": {"id": f"task{i}", "prompt_id": "", "node": "", "agent": "", "other": {}},
                   "kind": "task", "text": "What is 7 + 5?", "data": {"answer": "12"}}, *answer],
        "llm_calls": [call],
    }  # fmt: skip


def test_a_tape_written_before_episodes_reads_as_an_episode_and_is_written_back_as_one(tmp_path):
    from orchestrate.browse import summarize
    from orchestrate.loop.metrics import rollout_metrics

    path = tmp_path / "iter_000002.jsonl"
    path.write_text("".join(json.dumps(legacy_tape(i, answered=i == 0)) + "\n" for i in range(2)))
    solved, failed = read_tapes(path)
    assert [type(s) for s in solved.steps] == [EnvObservation, EnvAction, EnvObservation]
    first, action, answer = solved.steps
    assert (first.turn, first.text, first.info) == (0, "What is 7 + 5?", {"answer": "12"})
    assert (action.turn, action.text, action.metadata.prompt_id) == (1, "7 + 5 = 12. \\boxed{12}", "call0")
    # the old steps are kept whole on the action they became
    assert [s["kind"] for s in action.metadata.other["legacy_steps"]] == ["reasoning_thought", "final_answer_action"]
    assert action.metadata.other["legacy_steps"][1]["answer"] == "12"
    assert (answer.turn, answer.reward, answer.terminated, answer.info) == (1, 1.0, True, {"reason": "correct"})
    assert solved.llm_calls[0].turn == 1 and solved.metadata.turns == 1 and solved.metadata.terminated
    assert failed.steps[2].info == {"reason": "no answer", "format_error": True}
    assert failed.steps[1].text == "twelve"

    # the viewers and the metrics read the same episode
    lines = path.read_bytes().splitlines()
    assert summarize(json.loads(lines[1]), path.name, 1, "train")["format_error"] is True
    assert summarize(json.loads(lines[0]), path.name, 0, "train")["question"] == "What is 7 + 5?"
    assert rollout_metrics([solved, failed])["parse_failure_rate"] == 0.5

    # written back in today's shape, and read again unchanged
    again = write_tapes(tmp_path / "again.jsonl", [solved, failed])
    assert [s["kind"] for s in json.loads(again.read_text().splitlines()[0])["steps"]] == [
        "env_observation", "env_action", "env_observation"
    ]  # fmt: skip
    assert list(read_tapes(again)) == [solved, failed]
