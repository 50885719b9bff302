"""Whatever the tape writer accepts, the reader returns unchanged: every step kind, with extreme values
(NaN, +-inf, -0.0, the largest and smallest floats, huge ints, unicode, empty strings), written to a file,
read back, compared value by value (NaN as NaN, -0.0 as -0.0, int as int) and written again byte for byte.
A seeded randomized test (hypothesis is not a dependency): each seed is one reproducible case."""

from __future__ import annotations

import json
import math
import random
import types
import typing

import pytest
from pydantic import BaseModel, ValidationError

from tapes.store import read_tapes, write_tapes
from tapes.tape import EnvObservation, LLMCall, SamplingParams, Step, StepMetadata, Tape, TapeMetadata

FLOATS = [float("-inf"), float("inf"), float("nan"), -0.0, 0.0, 1e308, -1e308, 5e-324, -5e-324,
          2.2250738585072014e-308, 0.1, 1 / 3, -2.5]  # fmt: skip
INTS = [0, -1, 2**63 - 1, -(2**63), 2**64, 10**40, -(10**30)]
STRINGS = ["", " ", "\x00", "\n\r\t", '"\\', "\u2028\u2029", "\x7f\x1b[31m", "é", "日本語", "😀🧪", "\ufeff",
           "a" * 5000, "null", "NaN", "Infinity"]  # fmt: skip


def rand_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice(INTS)
    if kind == 3:
        return rng.choice(FLOATS)
    if kind == 4:
        return rng.choice(STRINGS)
    if kind == 5:
        return [rand_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(STRINGS) + str(i): rand_json(rng, depth + 1) for i in range(rng.randrange(4))}


def value_for(annotation, rng: random.Random):
    """A random extreme value of a field's type (the step kinds use these few types)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return None if rng.random() < 0.2 else value_for(rng.choice(options), rng)
    if origin is dict:
        return {rng.choice(STRINGS) + str(i): rand_json(rng) for i in range(rng.randrange(5))}
    if origin is list:
        return [value_for(args[0], rng) for _ in range(rng.randrange(6))]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return random_model(annotation, rng)
    if annotation is bool:
        return rng.choice([True, False])
    if annotation is int:
        return rng.choice(INTS)
    if annotation is float:
        return rng.choice(FLOATS)
    if annotation is str:
        return rng.choice(STRINGS)
    return rand_json(rng)  # JsonValue


def random_model(cls, rng: random.Random, **fixed):
    values = {name: value_for(field.annotation, rng) for name, field in cls.model_fields.items()
              if name not in fixed and field.annotation is not typing.ClassVar}  # fmt: skip
    for name, field in cls.model_fields.items():  # a bounded int (ge=0) at its extremes within the bound
        if field.annotation is int and name in values and any(type(m).__name__ == "Ge" for m in field.metadata):
            values[name] = abs(values[name])
    return cls(**values, **fixed)


def random_tape(rng: random.Random) -> Tape:
    calls = [random_model(LLMCall, rng, sampling=random_model(SamplingParams, rng)) for _ in range(rng.randrange(1, 3))]
    steps = []
    for kind, cls in sorted(Step.registry.items()):  # every step kind, the registered custom ones too
        steps.append(random_model(cls, rng, kind=kind, metadata=random_model(StepMetadata, rng)))
    return Tape(metadata=random_model(TapeMetadata, rng), context=rand_json(rng), steps=steps, llm_calls=calls)


def same(a, b, where="tape") -> None:
    """a and b are the same value: NaN equals NaN, -0.0 differs from 0.0, 1 differs from 1.0."""
    assert type(a) is type(b), f"{where}: {a!r} ({type(a).__name__}) came back as {b!r} ({type(b).__name__})"
    if isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), \
            f"{where}: {a!r} came back as {b!r}"  # fmt: skip
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} came back as {list(b)}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), f"{where}: {len(a)} items came back as {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} came back as {b!r}"


@pytest.mark.parametrize("seed", range(40))
def test_every_step_kind_with_extreme_values_reads_back_identical(tmp_path, seed):
    rng = random.Random(seed)
    tapes = [random_tape(rng) for _ in range(3)]
    path = write_tapes(tmp_path / "iter_000001.jsonl", tapes)
    back = list(read_tapes(path))
    assert len(back) == len(tapes)
    for i, (tape, got) in enumerate(zip(tapes, back)):
        assert [type(s) for s in got.steps] == [type(s) for s in tape.steps]
        same(tape.model_dump(), got.model_dump(), f"tape {i}")
    again = write_tapes(tmp_path / "iter_000002.jsonl", back)
    assert again.read_bytes() == path.read_bytes()
    # Python's json reads the file too (NaN and Infinity are its constants); finite values are plain JSON
    for line in path.read_text(encoding="utf-8").split("\n")[:-1]:  # not splitlines(): it splits at U+2028
        assert isinstance(json.loads(line), dict)


def test_the_constants_cover_every_non_finite_float_and_finite_json_is_unchanged():
    tape = Tape(
        metadata=TapeMetadata(reward=float("nan")),
        llm_calls=[LLMCall(logprobs=[float("-inf"), -0.5], ref_logprobs=[float("inf"), -0.0])],
    )
    line = tape.model_dump_json()
    assert '"reward":NaN' in line and '"logprobs":[-Infinity,-0.5]' in line and '"ref_logprobs":[Infinity,-0.0]' in line
    assert "null" not in json.dumps(json.loads(line)["llm_calls"][0]["logprobs"])
    finite = Tape(metadata=TapeMetadata(reward=1.0), llm_calls=[LLMCall(logprobs=[-0.5])]).model_dump_json()
    json.loads(finite, parse_constant=lambda c: pytest.fail(f"{c} in a finite tape"))  # strict JSON


@pytest.mark.parametrize("bad", [(1, 2), {1, 2}, b"bytes", object()])
def test_a_value_that_would_not_come_back_is_refused_naming_the_field(bad):
    with pytest.raises(ValidationError) as err:
        EnvObservation(text="x", info={"detail": bad})
    assert "info.detail" in str(err.value)
    with pytest.raises(ValidationError) as err:
        Tape(context={"env": [bad]})
    assert "context" in str(err.value)
    with pytest.raises(ValidationError, match="info"):
        EnvObservation(text="x", info={1: "int key would come back as '1'"})


# -- fields this version does not know ------------------------------------------------------------------------


def newer_line(where_extras: str) -> tuple[str, dict]:
    """A tape line as a newer version might write it: unknown fields on the tape, its metadata, every LLM call
    and its sampling parameters, and every step's metadata; at the end of each object or in the middle."""
    tape = random_tape(random.Random(7))
    data = json.loads(tape.model_dump_json())
    unknown = {"added_later": {"nested": [1, 2.5, None, "ü"], "flag": True}, "score": float("nan"), "empty": ""}

    def add(obj: dict) -> dict:
        if where_extras == "end":
            return {**obj, **unknown}
        keys = list(obj)
        return {**{k: obj[k] for k in keys[:1]}, **unknown, **{k: obj[k] for k in keys[1:]}}

    for call in data["llm_calls"]:
        call["sampling"] = add(call["sampling"])
    data["llm_calls"] = [add(call) for call in data["llm_calls"]]
    for step in data["steps"]:
        step["metadata"] = add(step["metadata"])
    data["metadata"] = add(data["metadata"])
    data = add(data)
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")), data


@pytest.mark.parametrize("where_extras", ["end", "middle"])
def test_unknown_fields_outside_the_steps_are_kept_and_written_back(tmp_path, where_extras):
    line, data = newer_line(where_extras)
    source = tmp_path / "newer.jsonl"
    source.write_text(line + "\n", encoding="utf-8")
    tape = next(read_tapes(source))
    assert tape.model_extra["added_later"] == {"nested": [1, 2.5, None, "ü"], "flag": True}
    assert math.isnan(tape.metadata.model_extra["score"]) and tape.llm_calls[0].sampling.model_extra["empty"] == ""
    rewritten = write_tapes(tmp_path / "rewritten.jsonl", [tape]).read_text(encoding="utf-8")
    # the same JSON: every key and value, NaN included (key order aside: unknown fields come after known ones)
    assert json.dumps(json.loads(rewritten), sort_keys=True) == json.dumps(data, sort_keys=True)
    if where_extras == "end":
        assert rewritten == line + "\n"  # byte for byte


def test_an_unknown_field_of_a_step_is_still_refused_naming_it(tmp_path):
    data = json.loads(random_tape(random.Random(1)).model_dump_json())
    data["steps"][0]["colour"] = "blue"
    with pytest.raises(ValidationError, match="colour"):
        Tape.model_validate_json(json.dumps(data))


@pytest.mark.parametrize("seed", range(5))
def test_a_tape_read_back_is_identical_to_diff_tapes(tmp_path, seed):
    """diff_tapes (replay's comparison) sees no difference in a tape read back, NaN rewards and infos included."""
    from tapes.diff import diff_tapes

    tape = random_tape(random.Random(seed))
    tape.metadata.reward = float("nan")
    back = next(read_tapes(write_tapes(tmp_path / "t.jsonl", [tape])))
    assert diff_tapes(tape, back).identical, diff_tapes(tape, back).report()
    back.metadata.reward = 1.0
    assert diff_tapes(tape, back).reward is not None
