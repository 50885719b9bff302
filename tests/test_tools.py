"""The python tool and the tool environment wrapper, with the real sandbox and scripted agent turns."""

from __future__ import annotations

import shutil

import pytest

from agents.envs.registry import make_env
from agents.sandbox import Sandbox, SandboxConfig, SandboxResult
from agents.tools import PythonTool, ToolEnv, ToolInfraError
from tests.scripted import scripted_call


class ScriptedLLM:
    """A model that answers each call with the next of `texts` (its token ids from `tokenizer`)."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer, self.texts, self.calls = tokenizer, texts, 0

    async def complete_ids(self, prompt_ids, sampling, *, messages=None, prompt_text=""):

        text = self.texts[self.calls]
        self.calls += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return scripted_call(text, ids, prompt_ids, sampling, messages=messages, prompt_text=prompt_text)


@pytest.fixture(scope="module")
def tool():
    if shutil.which("bwrap") is None:
        pytest.fail("bwrap is missing: install bubblewrap (`apt-get install bubblewrap`; .ci/run does)")
    return PythonTool(Sandbox(SandboxConfig(timeout_s=5)))


def test_parse_takes_the_first_complete_block(tool):
    assert tool.parse("Let me compute.\n<python>\nprint(123 * 45)\n</python>").text == "print(123 * 45)"
    assert tool.parse("<python>print(1)</python> and <python>print(2)</python>").text == "print(1)"
    assert tool.parse("<python>print(1)") is None and tool.parse("The answer is \\boxed{5}.") is None


def test_a_scripted_episode_calls_the_tool_then_answers(tool):
    env = ToolEnv(make_env("math:arithmetic"), [tool])
    question, info = env.reset(seed=3)
    assert "<python>" in question and env.stop == ["</python>", "</tool_call>"]
    answer = info["answer"]
    obs, reward, terminated, truncated, info = env.step("I will compute it.\n<python>\nprint(2 ** 10)\n</python>")
    assert obs == "<output>\n1024\n</output>" and reward == 0.0 and not terminated and not truncated
    assert info["tool"] == "python" and info["exit_code"] == 0 and info["tool_calls"] == 1 and not info["tool_error"]
    obs, reward, terminated, truncated, info = env.step("<python>\n1 / 0\n</python>")
    assert "ZeroDivisionError" in obs and "[exit code 1]" in obs and info["tool_error"] and info["tool_errors"] == 1
    obs, reward, terminated, truncated, info = env.step("<python>\nwhile True: pass\n</python>")
    assert "[timed out" in obs or "[killed by" in obs
    obs, reward, terminated, truncated, info = env.step(f"The answer is \\boxed{{{answer}}}.")
    assert terminated and reward == 1.0 and info["success"]
    assert info["tool_calls"] == 3 and info["tool_errors"] == 2


def test_a_sandbox_that_cannot_start_is_an_infrastructure_failure(tool, monkeypatch):
    monkeypatch.setattr(tool.sandbox, "run", lambda code, stdin="": SandboxResult("", "", None, infra_error="boom"))
    env = ToolEnv(make_env("math:arithmetic"), [tool])
    env.reset(seed=0)
    with pytest.raises(ToolInfraError, match="boom"):
        env.step("<python>print(1)</python>")


def test_the_agent_stops_sampling_at_the_end_of_a_tool_call_and_reads_its_output(tool, tokenizer):
    """A scripted model through the real ChatAgent: sampling stops at `</python>` (the environment's stop
    string reaches the LLM call), the tool's output is the next observation, prompts chain token-exactly."""
    import asyncio

    from agents.agent import AgentConfig, ChatAgent
    from agents.chat import ChatTokens
    from tapes.tape import EnvObservation, SamplingParams, Tape

    env = ToolEnv(make_env("math:arithmetic"), [tool])
    answer = env.env._problem_at(5).answer
    texts = [("Let me compute.\n<python>print(6 * 7)</python>", False), (f"So \\boxed{{{answer}}}", True)]
    seen = []

    class LLM:
        async def complete_ids(self, prompt_ids, sampling, *, messages=None, prompt_text=""):
            seen.append(sampling.stop)
            text, eos = texts[len(seen) - 1]
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
            return scripted_call(text, ids, prompt_ids, sampling, messages=messages, prompt_text=prompt_text)

    agent = ChatAgent(AgentConfig(max_turns=4), SamplingParams(max_tokens=64), ChatTokens(tokenizer))
    tape = asyncio.run(agent.run_episode(env, 5, LLM(), Tape()))
    assert seen == [["</python>", "</tool_call>"]] * 2
    observations = [s for s in tape.steps if isinstance(s, EnvObservation)]
    assert observations[1].text == "<output>\n42\n</output>" and observations[1].info["tool"] == "python"
    assert tape.metadata.success and tape.metadata.turns == 2
    assert tape.llm_calls[1].extends_previous is True


def test_tool_runs_do_not_block_other_episodes(tool):
    """Two episodes whose tool calls each take ~1 s run side by side: astep leaves the event loop free."""
    import asyncio
    import time

    from orchestrate.loop.rollouts import EnvClock, TimedEnv

    async def both():
        clock = EnvClock()
        envs = [TimedEnv(ToolEnv(make_env("math:arithmetic"), [tool]), clock) for _ in range(2)]
        for env in envs:
            env.reset(seed=0)
        start = time.monotonic()
        program = "<python>import time; a = time.time(); time.sleep(1); print(a, time.time())</python>"
        results = await asyncio.gather(*(env.astep(program) for env in envs))
        return time.monotonic() - start, results, clock

    seconds, results, clock = asyncio.run(both())
    spans = [[float(x) for x in r[0].removeprefix("<output>").removesuffix("</output>").split()] for r in results]
    (a0, a1), (b0, b1) = spans
    assert a0 < b1 and b0 < a1, spans  # the two ran at the same time (their sleeps overlap)
    assert clock.busy_s >= 2.0  # each one's time counted
    # the wall time inside the environment counts the overlap once: never more than the rollouts' wall time
    assert 1.0 <= clock.wall_s <= seconds + 0.3 and clock.wall_s < clock.busy_s


def test_tools_from_the_command_line(tmp_path):
    """--env.tools python wraps the environment (and is recorded on the tape's context for replay); a sandbox
    that cannot run here is refused before anything starts, naming the option."""
    import subprocess
    import sys
    from pathlib import Path

    from agents.env_spec import EnvSpec
    from orchestrate.loop.command_line import resolve
    from tapes.tape import Tape

    config = resolve("embedded", {"env.tools": "python", "env.sandbox.timeout_s": "3"})
    spec = EnvSpec.from_config(config, "train")
    env = spec.make()
    assert isinstance(env, ToolEnv) and env.tools[0].sandbox.config.timeout_s == 3
    context = spec.context(4)["env"]
    assert context["tools"] == ["python"] and context["sandbox"] == {"timeout_s": 3.0}
    again, seed = EnvSpec.of(Tape(context={"env": context}))
    assert seed == 4 and isinstance(again.make(), ToolEnv) and again.sandbox_options == {"timeout_s": 3.0}
    assert "tools" not in EnvSpec.from_config(resolve("embedded", {}), "train").context(0)["env"]

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-m", "orchestrate.rl", "--env.tools", "python", "--env.sandbox.python",
                          "/usr/bin/no-python", "--run-dir", str(tmp_path / "run")], cwd=root, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
        "error: --env.sandbox.python: /usr/bin/no-python is not an executable file"
    )
    assert not (tmp_path / "run").exists()
    out = subprocess.run(
        [sys.executable, "-m", "orchestrate.rl", "--env.tools", "perl"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--env.tools" in out.stderr


def test_tool_turns_are_typed_steps_on_the_tape_and_show_as_such(tool, tokenizer, tmp_path):
    """A tool call is a ToolCallAction (tool, code) and its answer a ToolResultObservation; the tape
    round-trips through JSON, orchestrate.after.show names the tool and the browser's episode view carries it."""
    import asyncio
    import subprocess
    import sys

    from agents.agent import AgentConfig, ChatAgent
    from agents.chat import ChatTokens
    from orchestrate.after.episode_view import episode_view
    from tapes.store import read_tapes, write_tapes
    from tapes.tape import EnvAction, EnvObservation, SamplingParams, Tape, ToolCallAction, ToolResultObservation

    env = ToolEnv(make_env("math:arithmetic"), [tool])
    texts = ["<python>print(6 * 7)</python>", "<python>1 / 0</python>", "\\boxed{42}"]

    agent = ChatAgent(AgentConfig(max_turns=4), SamplingParams(max_tokens=64), ChatTokens(tokenizer))
    tape = asyncio.run(
        agent.run_episode(env, 1, ScriptedLLM(tokenizer, texts), Tape(context={"env": {"id": "math:arithmetic"}}))
    )
    kinds = [s.kind for s in tape.steps]
    assert kinds == [
        "env_observation",
        "tool_call",
        "tool_result",
        "tool_call",
        "tool_result",
        "env_action",
        "env_observation",
    ]
    call, result = tape.steps[1], tape.steps[2]
    assert isinstance(call, ToolCallAction) and isinstance(call, EnvAction) and call.call == "print(6 * 7)"
    assert isinstance(result, ToolResultObservation) and isinstance(result, EnvObservation)
    assert result.tool == "python" and result.info["stdout"] == "42\n" and result.reward == 0.0
    path = tmp_path / "iter_000001.jsonl"
    write_tapes(path, [tape])
    (again,) = read_tapes(path)
    assert [s.kind for s in again.steps] == kinds and again.steps[1].call == "print(6 * 7)"

    turns = episode_view(again, None)["turns"]
    assert [(t["tool"], t["tool_call"]) for t in turns] == [
        ("python", "print(6 * 7)"),
        ("python", "1 / 0"),
        (None, None),
    ]
    out = subprocess.run([sys.executable, "-m", "orchestrate.after.show", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "[agent] turn 1 (python call)" in text and "[python tool] result of turn 1" in text
    assert "[python tool] result of turn 2  tool error" in text and "[environment] answer to turn 3" in text


def test_replay_reruns_the_code_and_says_so(tool, tokenizer):
    """An episode with tool calls replays identically from its tape: the code runs again in the sandbox (the
    tape's context names the tools), and the report says so."""
    import asyncio

    from agents.agent import AgentConfig, ChatAgent
    from agents.chat import ChatTokens
    from agents.env_spec import EnvSpec
    from orchestrate.after.replay import replay_tape
    from tapes.tape import SamplingParams, Tape

    spec = EnvSpec("math:arithmetic", {}, "train", 0, ["python"], {"timeout_s": 5})
    answer = spec.make().env._problem_at(2).answer
    texts = [
        "<python>print(sum(range(10)))</python>",
        "<python>import sys; sys.exit(3)</python>",
        f"\\boxed{{{answer}}}",
    ]

    agent = ChatAgent(AgentConfig(max_turns=4), SamplingParams(max_tokens=64), ChatTokens(tokenizer))
    tape = asyncio.run(agent.run_episode(spec.make(), 2, ScriptedLLM(tokenizer, texts), Tape(context=spec.context(2))))
    assert tape.metadata.success and tape.steps[2].text == "<output>\n45\n</output>"
    replayed, diff = asyncio.run(replay_tape(tape, agent))
    assert diff.identical, diff.report()
    assert diff.how == ["re-ran 2 python tool calls (deterministic, in the sandbox)"]
    assert "identical (re-ran 2 python tool calls" in diff.report()


def test_a_call_in_the_chat_templates_format_runs_the_tool_it_names(tool):
    """Qwen2.5's and Hermes's `<tool_call>` JSON, as a model tuned for its template writes it: the arguments as an
    object or a JSON string; a call naming no tool of the episode, or malformed, goes to the environment."""
    env = ToolEnv(make_env("math:arithmetic"), [tool])
    env.reset(seed=3)
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(2 ** 10)"}}\n</tool_call>'
    obs, reward, terminated, _, info = env.step(f"Let me compute.\n{call}")
    assert obs == "<output>\n1024\n</output>" and reward == 0.0 and not terminated and info["tool_calls"] == 1
    assert env.tool_call(call).text == "print(2 ** 10)"
    as_string = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(3)\\"}"}</tool_call>'
    assert env.tool_call(as_string).text == "print(3)"
    for other in ('<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>',
                  "<tool_call>{not json}</tool_call>", '<tool_call>{"name": "python", "arguments": {}}</tool_call>'):  # fmt: skip
        assert env.tool_call(other) is None
    obs, reward, terminated, _, info = env.step("<tool_call>{not json}</tool_call>")
    assert terminated and reward < 1.0 and info["tool_calls"] == 1  # the environment's answer: no answer in it
