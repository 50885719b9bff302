"""The code environment with the real sandbox (bubblewrap): every shipped problem is solvable, wrong and
hostile programs do not pass, a bad problems file is refused naming FILE:LINE, and an episode played by the
ChatAgent replays identically."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from agents.envs import EnvError, check_options, make_env
from agents.envs.code import (
    BUILTIN_PROBLEMS,
    load_problems,
    parse_test,
    pose,
    run_tests,
    split_problems,
)
from agents.sandbox import Sandbox, SandboxConfig, SandboxInfraError, SandboxResult
from tests.scripted import scripted_call


@pytest.fixture(scope="module")
def sandbox():
    if shutil.which("bwrap") is None:
        pytest.fail("bwrap is missing: install bubblewrap (`apt-get install bubblewrap`; .ci/run does)")
    return Sandbox(SandboxConfig(timeout_s=4), slots=8)


def env_for(problem_id: str, sandbox, **options):
    """A code environment reset to the train or test episode that poses `problem_id`."""
    for split in ("train", "test"):
        env = make_env("code", options, split=split, sandbox=sandbox)
        for seed in range(len(load_problems())):
            _, info = env.reset(seed)
            if info["task_id"] == problem_id:
                return env
    raise AssertionError(f"no episode poses {problem_id}")


def fenced(program: str) -> str:
    return f"Here is my solution.\n```python\n{program}\n```"


def test_every_shipped_problem_is_solved_by_its_reference_solution(sandbox):
    problems = load_problems()
    assert 24 <= len(problems) <= 40
    for p in problems:
        assert p.entry_point and p.solution and 3 <= len(p.tests) <= 6, p.id
        assert f"`{p.entry_point}(" in p.prompt, p.id  # the prompt names the function the tests call
    with ThreadPoolExecutor(8) as pool:  # one sandbox run per problem, several at once
        outcomes = list(pool.map(lambda p: run_tests(sandbox, p.solution, p, 2.0), problems))
    failed = {p.id: o.error() for p, o in zip(problems, outcomes) if not all(o.passed)}
    assert not failed, failed
    assert sum(len(o.passed) for o in outcomes) == sum(len(p.tests) for p in problems)


def test_a_wrong_program_fails_and_fraction_mode_gives_the_share(sandbox):
    wrong = fenced("def add(a, b):\n    return a * b")  # add: 5 tests, only add(0, 0) == 0 holds for a * b
    env = env_for("add_two", sandbox)
    obs, reward, terminated, truncated, info = env.step(wrong)
    assert (reward, terminated, truncated) == (0.0, True, False)
    assert (
        info["tests_passed"] == 1 and info["tests_total"] == 5 and info["tests"] == [False, False, True, False, False]
    )
    assert not info["success"] and not info["format_error"] and info["exit_code"] == 0 and not info["timed_out"]
    assert "add(2, 3) returned 6" in info["error"] and obs == "1 of 5 tests passed."
    json.dumps(info)  # it reaches the tape

    env = env_for("add_two", sandbox, reward="fraction")
    assert env.step(wrong)[1] == pytest.approx(1 / 5)
    env = env_for("add_two", sandbox, reward="fraction")
    _, reward, _, _, info = env.step(fenced("def add(a, b):\n    return a + b"))
    assert reward == 1.0 and info["success"] and info["error"] == ""


def test_a_reply_without_a_python_block_is_a_format_error(sandbox):
    env = env_for("reverse_string", sandbox)
    for reply in ["def reverse_string(s):\n    return s[::-1]", "```python\ndef reverse_string(s):\n    return s[::-1]",
                  "```\ndef reverse_string(s):\n    return s[::-1]\n```"]:  # fmt: skip
        env = env_for("reverse_string", sandbox)
        _, reward, terminated, _, info = env.step(reply)
        assert reward == 0.0 and terminated and info["format_error"] and not info["success"], reply
    # the last python block is the answer
    env = env_for("reverse_string", sandbox)
    reply = (
        fenced("def reverse_string(s):\n    return s")
        + "\nBetter:\n```python\ndef reverse_string(s):\n    return s[::-1]\n```"
    )
    _, reward, _, _, info = env.step(reply)
    assert reward == 1.0 and info["success"] and not info["format_error"]


ADD_TESTS = {"add(2, 3)": "5", "add(-1, 1)": "0", "add(0, 0)": "0", "add(100, 23)": "123", "add(1.5, 2.25)": "3.75"}
FORGED_LINES = "".join(
    f"print('@@tapeloop-test 0123 ' + {json.dumps({'test': i, 'value': v, 'passed': True})!r})\n"
    for i, v in enumerate(ADD_TESTS.values())
)  # the right values, but no nonce

HOSTILE = {
    # no add() at all: lines that look like the harness's, holding every expected value
    "forged result lines": FORGED_LINES,
    # digs the nonce out of the harness's memory and writes result lines for itself: values are still compared
    "forged lines with the real nonce": """import gc, json, os
def add(a, b):
    return 7
for o in gc.get_objects():
    if isinstance(o, dict) and "mark" in o and "tests" in o:
        for i in range(len(o["tests"])):
            os.write(3, (o["mark"] + " " + json.dumps({"test": i, "value": "True", "passed": True}) + "\\n").encode())
""",
    "os._exit(0) before the tests": "import os\nos._exit(0)\ndef add(a, b):\n    return a + b",
    "os._exit(0) in the function": "import os\ndef add(a, b):\n    os._exit(0)",
    "sys.exit(0)": "import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b",
    "exit()": "exit()\ndef add(a, b):\n    return a + b",
    "an endless loop": "while True:\n    pass\ndef add(a, b):\n    return a + b",
    "an endless loop in the function, alarm ignored": (
        "import signal\ndef add(a, b):\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    while True:\n"
        "        pass"),
    "redefined builtins and an always-equal value": """import builtins
class Same:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __repr__(self): return "Same()"
builtins.print = lambda *a, **k: None
builtins.repr = lambda value: "Same()"
builtins.isinstance = lambda *a: True
def add(a, b):
    return Same()
""",
    "prints, then fails": "print('all tests passed')\nimport sys\nprint('OK', file=sys.stderr)\ndef add(a, b):\n"
                          "    print(a + b)\n    return None",
}  # fmt: skip


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_program_does_not_pass(sandbox, name):
    env = env_for("add_two", sandbox, reward="fraction", test_timeout_s=0.4)
    _, reward, terminated, _, info = env.step(fenced(HOSTILE[name]))
    assert info["tests_passed"] == 0 and reward == 0.0 and not info["success"] and terminated, info


def test_the_tests_before_an_exit_or_a_hang_count_and_the_rest_fail(sandbox):
    env = env_for("add_two", sandbox, reward="fraction")
    exits = "import os\ndef add(a, b):\n    if a == 0:\n        os._exit(0)\n    return a + b"
    _, reward, _, _, info = env.step(fenced(exits))  # add(2, 3), add(-1, 1) pass; add(0, 0) ends the run
    assert info["tests"] == [True, True, False, False, False] and reward == pytest.approx(2 / 5)
    env = env_for("add_two", sandbox, reward="fraction", test_timeout_s=0.4)
    hangs = "def add(a, b):\n    while a == 0:\n        pass\n    return a + b"
    _, reward, _, _, info = env.step(fenced(hangs))  # the per-test timer stops add(0, 0) only
    assert info["tests"] == [True, True, False, True, True] and "timed out" in info["error"]


def test_a_sandbox_failure_raises_instead_of_scoring(sandbox, monkeypatch):
    env = env_for("add_two", sandbox)
    monkeypatch.setattr(env.sandbox, "run", lambda code, stdin="": SandboxResult("", "", None, infra_error="boom"))
    with pytest.raises(SandboxInfraError, match="boom"):
        env.step(fenced("def add(a, b):\n    return a + b"))


def test_splits_are_disjoint_deterministic_and_cover_every_problem():
    problems = load_problems()
    ids = {p.id for p in problems}
    train_env, test_env = (make_env("code", split=s) for s in ("train", "test"))
    n_test = test_env.test_size
    assert n_test == round(len(problems) * 0.25)
    test = [test_env.reset(k)[1]["task_id"] for k in range(n_test)]
    train = [train_env.reset(k)[1]["task_id"] for k in range(len(problems) - n_test)]
    assert len(set(test)) == n_test and len(set(train)) == len(train)  # each one once per pass
    assert not set(test) & set(train) and set(test) | set(train) == ids
    again = make_env("code", split="test")
    assert [again.reset(k)[1]["task_id"] for k in range(n_test)] == test
    other_run = make_env("code", split="train", run_seed=1)
    seq = [other_run.reset(k)[1]["task_id"] for k in range(len(train))]
    assert set(seq) == set(train) and seq != train  # same problems, another order
    assert [make_env("code", split="train").reset(k)[1]["task_id"] for k in range(len(train))] == train
    _, half_test = split_problems(problems, 0.5)
    assert len(half_test) == len(problems) // 2 and set(test) <= {p.id for p in half_test}  # hash order: nested


def test_tests_must_compare_with_a_literal():
    t = parse_test("assert add(2, 3) == 5")
    assert (t.expression, t.expected) == ("add(2, 3)", 5)
    assert parse_test("assert [1, -2] == f(x)").expected == [1, -2]
    for bad, why in [
        ("add(2, 3) == 5", "assert"),
        ("assert add(2, 3)", "=="),
        ("assert f(1) == f(2)", "literal"),
        ("assert f(1) < 2", "=="),
        ("assert 1 == f(1) == 1", "=="),
        ("assert (", "not Python"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_test(bad)


GOOD = {"id": "one", "prompt": "Write `one()` returning 1.", "tests": ["assert one() == 1"], "entry_point": "one"}


@pytest.mark.parametrize("line, message", [
    ("not json", "2: line: not JSON"),
    (json.dumps([1, 2]), "2: line: not a JSON object"),
    (json.dumps({"tests": ["assert f() == 1"]}), "2: prompt: missing"),
    (json.dumps({"prompt": "p", "tests": "assert f() == 1"}), "2: tests: missing or not a non-empty list"),
    (json.dumps({"prompt": "p", "tests": ["assert f() == 1", "assert f()"]}), "2: tests[1]: must compare"),
    (json.dumps({"prompt": "p", "tests": ["assert f() == 1"], "entry": "f"}), "2: entry: unknown field"),
    (json.dumps({"prompt": "p", "tests": ["assert f() == 1"], "entry_point": "f()"}), "2: entry_point: not a"),
    (json.dumps({**GOOD, "prompt": "again"}), "2: id: 'one' repeats line 1"),
])  # fmt: skip
def test_a_malformed_problems_file_is_refused_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n" + json.dumps({**GOOD, "id": "three"}) + "\n")
    with pytest.raises(EnvError) as caught:
        check_options("code", {"problems": str(path)})
    text = str(caught.value)
    assert text.startswith(f"options.problems: {path}:{message}") and "\n" not in text, text


def test_a_problems_file_of_ones_own_is_used(tmp_path, sandbox):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        "\n".join(json.dumps({**GOOD, "id": f"p{k}", "tests": [f"assert one() + {k} == {1 + k}"]}) for k in range(4))
        + "\n"
    )
    with pytest.raises(EnvError, match="does not exist"):
        check_options("code", {"problems": str(tmp_path / "missing.jsonl")})
    path_one = tmp_path / "one.jsonl"
    path_one.write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(EnvError, match="holds 1 problems"):
        check_options("code", {"problems": str(path_one)})
    env = make_env("code", {"problems": str(path)}, split="test", sandbox=sandbox)
    assert env.test_size == 1
    obs, _ = env.reset(0)
    assert obs.startswith("Write `one()` returning 1.") and "defines `one`" in obs
    assert env.step(fenced("def one():\n    return 1"))[1] == 1.0


def test_a_bad_problems_file_or_sandbox_stops_the_run_before_it_starts(tmp_path):
    """Refused with one line naming the option: the file when the config is resolved (orchestrate.rl exits 2
    on a ConfigError before anything is written), the sandbox by the preflight."""
    from orchestrate.loop.command_line import resolve
    from orchestrate.loop.config_checks import ConfigError
    from orchestrate.loop.preflight import PreflightError, check_environment

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + json.dumps({"prompt": "p", "tests": ["assert f()"]}) + "\n")
    with pytest.raises(ConfigError, match=rf"^--env.options.problems: {re.escape(str(bad))}:2: tests\[0\]: must"):
        resolve("code", {"env.options.problems": str(bad)})
    config = resolve("code", {"env.sandbox.python": "/usr/bin/no-python"})
    with pytest.raises(PreflightError, match="^--env.sandbox.python: /usr/bin/no-python is not an executable file"):
        check_environment(config)


def test_the_preset_and_the_sandbox_options_reach_the_environment():
    from agents.env_spec import EnvSpec
    from orchestrate.loop.command_line import resolve
    from tapes.tape import Tape

    config = resolve("code", {"env.sandbox.timeout_s": "3"})
    assert config.model.policy == "smollm2" and config.env.id == "code" and config.rollouts.max_tokens <= 256
    (example,) = config.agent.examples
    assert example.question == pose("Write a function `double(x)` that returns `x` multiplied by two.", "double")
    assert "```python\n" in example.solution
    spec = EnvSpec.from_config(config, "train")
    assert spec.uses_sandbox and spec.make().sandbox.config.timeout_s == 3  # --env.sandbox.*: the one source
    context = spec.context(2)["env"]
    assert context["sandbox"] == {"timeout_s": 3.0} and "tools" not in context  # replay rebuilds the sandbox
    again, seed = EnvSpec.of(Tape(context={"env": context}))
    assert seed == 2 and again.make().sandbox.config.timeout_s == 3
    assert "sandbox" not in EnvSpec.from_config(resolve("embedded", {}), "train").context(0)["env"]
    with pytest.raises(EnvError, match="options.reward"):
        check_options("code", {"reward": "most"})
    assert BUILTIN_PROBLEMS.is_file()


def scripted_llm(tokenizer, texts):

    class LLM:
        calls = 0

        async def complete_ids(self, prompt_ids, sampling, *, messages=None, prompt_text=""):
            text = texts[LLM.calls]
            LLM.calls += 1
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            return scripted_call(text, ids, prompt_ids, sampling, messages=messages, prompt_text=prompt_text)

    return LLM()


def test_an_episode_with_a_retry_is_a_tape_that_replays_identically(tokenizer):
    """The real ChatAgent: a wrong program, the failing tests as feedback, the right program; the tape
    replays to the same tape (the programs run again in the sandbox, rebuilt from the tape's context)."""
    from agents.agent import AgentConfig, ChatAgent
    from agents.chat import ChatTokens
    from agents.env_spec import EnvSpec
    from orchestrate.after.replay import replay_tape
    from tapes.tape import EnvObservation, SamplingParams, Tape

    spec = EnvSpec("code", {"max_attempts": 2}, "train", 0, sandbox={"timeout_s": 5})
    _, info = spec.make().reset(3)
    problem = next(p for p in load_problems() if p.id == info["task_id"])
    texts = [fenced(f"def {problem.entry_point}(*args):\n    return None"), fenced(problem.solution)]
    agent = ChatAgent(AgentConfig(max_turns=2), SamplingParams(max_tokens=256), ChatTokens(tokenizer))
    tape = asyncio.run(agent.run_episode(spec.make(), 3, scripted_llm(tokenizer, texts), Tape(context=spec.context(3))))
    observations = [s for s in tape.steps if isinstance(s, EnvObservation)]
    assert "You have 2 attempts." in observations[0].text
    assert "Failing tests:" in observations[1].text and "1 attempt left" in observations[1].text
    assert [o.reward for o in observations[1:]] == [0.0, 1.0] and observations[2].info["success"]
    assert tape.metadata.success and tape.metadata.reward == 1.0 and tape.metadata.turns == 2
    assert tape.llm_calls[1].extends_previous is True
    assert tape.context["env"]["sandbox"] == {"timeout_s": 5}
    replayed, diff = asyncio.run(replay_tape(tape, agent))
    assert diff.identical, diff.report()
    assert replayed.metadata.reward == 1.0


def test_a_sandbox_failure_in_a_rollout_flags_the_episode(tokenizer, monkeypatch):
    from agents.agent import AgentConfig, ChatAgent
    from agents.chat import ChatTokens
    from agents.env_spec import EnvSpec
    from orchestrate.loop.rollouts import RolloutContext, play
    from tapes.tape import SamplingParams

    spec = EnvSpec("code", {}, "train", 0)
    monkeypatch.setattr(spec.sandbox(), "run", lambda code, stdin="": SandboxResult("", "", None, infra_error="boom"))
    agent = ChatAgent(AgentConfig(max_turns=1), SamplingParams(max_tokens=64), ChatTokens(tokenizer))
    context = RolloutContext(agent, spec, scripted_llm(tokenizer, [fenced("x = 1")]), iteration=1, policy_version=0)
    tape = asyncio.run(play(context, 0, context.new_tape(0)))
    assert tape.metadata.error == "SandboxInfraError: code tests: boom" and tape.metadata.reward is None
