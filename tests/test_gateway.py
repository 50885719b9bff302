"""The gateway and agent programs (orchestrate.gateway, agents.program), against a scripted LLM: the embedded
model's real tokenizer and chat template, the plain `openai` client over real HTTP, no vLLM server."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
from pathlib import Path

import httpx
import pytest

from agents.agent import turn_rewards
from agents.env_spec import EnvSpec
from agents.program import ProgramError, load_program
from agents.tool_format import ToolFormat, ToolFormatError, check_tools
from orchestrate.gateway.agent import MODEL_NAME, ProgramAgent
from orchestrate.loop.samples import tape_samples
from orchestrate.serving.llm import LLMError
from orchestrate.serving.recorded import ReplayLLM
from tapes.tape import AgentMessage, ProgramMessage, Tape, ToolCallAction, ToolResultObservation
from tests.programs import SAMPLING, ScriptedLLM, answer_of, arithmetic, play
from tests.scripted import scripted_call


def tool_reply(a, b):
    body = json.dumps({"name": "python", "arguments": {"code": f"print({a} * {b})"}})
    return f"<tool_call>\n{body}\n</tool_call>"


def assert_steps_of_the_tool_example(tape, a, b, product):
    """The program's messages (its worked example's among them), then what the model did and the tool said."""
    roles = [(type(s).__name__, getattr(s, "role", None)) for s in tape.steps]
    assert roles == [("EnvObservation", None)] + [("ProgramMessage", r) for r in (
        "system", "user", "assistant", "tool", "assistant", "user")] + [
        ("ToolCallAction", None), ("ToolResultObservation", None), ("AgentMessage", None), ("EnvObservation", None)]  # fmt: skip
    call, result = tape.steps[7], tape.steps[8]
    assert isinstance(call, ToolCallAction) and call.tool == "python"
    assert json.loads(call.call) == {"code": f"print({a} * {b})"}
    assert isinstance(result, ToolResultObservation) and result.text == str(product)
    assert result.tool == "python" and call.metadata.prompt_id == tape.llm_calls[0].id
    assert turn_rewards(tape) == [0.0, 1.0]


def test_the_shipped_example_is_recorded_token_exactly_and_scored_by_the_environment(tokenizer, agent_for):
    a, b, product = answer_of()
    llm = ScriptedLLM(tokenizer, [tool_reply(a, b), f"The answer is \\boxed{{{product}}}."])
    agent = agent_for("agents.programs.openai_tools:play")
    tape = play(agent, llm)
    assert tape.metadata.error is None, tape.metadata.error
    assert tape.metadata.reward == 1.0 and tape.metadata.success is True and tape.metadata.turns == 2
    first, second = tape.llm_calls
    # the second prompt is the first prompt + the sampled ids + the rendered tool result: never re-rendered
    assert second.extends_previous is True and agent.mismatches == 0
    assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(first.output_token_ids)] == (
        first.prompt_token_ids + first.output_token_ids
    )
    added = tokenizer.decode(second.prompt_token_ids[len(first.prompt_token_ids) + len(first.output_token_ids) :])
    assert added == f"<|im_end|>\n<|im_start|>tool\n{product}<|im_end|>\n<|im_start|>assistant\n"
    # the tools reach a template that does not render them (SmolLM2's) in the Hermes format, the example's
    # call written into its content; sampling stops after a call
    assert '<tools>\n{"type": "function", "function": {"name": "python"' in first.prompt_text
    assert (
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(123 * 45)"}}\n</tool_call>' in first.prompt_text
    )
    assert "</tool_call>" in first.sampling.stop and first.sampling.temperature == 0.7
    assert_steps_of_the_tool_example(tape, a, b, product)
    (sample,) = tape_samples(tape, require_ref=False)  # one sample: the calls chain
    assert [t["index"] for t in sample["turns"]] == [0, 1]
    assert sample["reward"] == 1.0


def test_a_history_that_does_not_extend_starts_a_new_sample_of_the_same_episode(tokenizer, agent_for):
    async def summarising(task, client):
        first = await client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": "A"}])
        # a summarised history: not the previous messages + reply
        await client.chat.completions.create(model=task.model, messages=[
            {"role": "user", "content": "Summary: " + first.choices[0].message.content}])  # fmt: skip
        return 0.5

    tape = play(agent_for(summarising), ScriptedLLM(tokenizer, ["one", "two"]))
    assert [c.extends_previous for c in tape.llm_calls] == [None, False]
    assert [type(s).__name__ for s in tape.steps] == ["EnvObservation", "ProgramMessage", "AgentMessage",
                                                      "ProgramMessage", "AgentMessage", "EnvObservation"]  # fmt: skip
    assert isinstance(tape.steps[3], ProgramMessage) and tape.steps[3].text == "Summary: one"
    samples = tape_samples(tape, require_ref=False)
    assert len(samples) == 2 and len({s["episode_id"] for s in samples}) == 1
    assert [s["turns"][0]["reward"] for s in samples] == [0.0, 0.5]


def test_a_user_message_after_a_reply_extends_it(tokenizer, agent_for):
    async def chatty(task, client):
        messages = [{"role": "user", "content": task.observation}]
        for _ in range(3):
            reply = await client.chat.completions.create(model=task.model, messages=messages)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "Are you sure?"}]  # fmt: skip
        return 1.0

    llm = ScriptedLLM(tokenizer, ["x", "y", "z"])
    tape = play(agent_for(chatty), llm)
    assert [c.extends_previous for c in tape.llm_calls] == [None, True, True]
    assert len(tape_samples(tape, require_ref=False)) == 1


def test_a_program_that_raises_or_hangs_is_an_infrastructure_failure(tokenizer, agent_for):
    async def raises(task, client):
        await client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": "A"}])
        raise KeyError("oops")

    tape = play(agent_for(raises), ScriptedLLM(tokenizer, ["x"]))
    assert tape.metadata.error.startswith("the program raised KeyError: 'oops'")
    assert tape_samples(tape, require_ref=False) == []  # never a zero reward

    async def hangs(task, client):
        await asyncio.sleep(30)

    tape = play(agent_for(hangs, time_limit_s=0.2), ScriptedLLM(tokenizer, []))
    assert "time limit of 0.2 s" in tape.metadata.error


def test_the_programs_faults_get_readable_http_errors_and_stay_on_the_tape(tokenizer, agent_for):
    import openai

    seen = {}

    async def faulty(task, client):
        user = [{"role": "user", "content": "A"}]
        for name, kwargs in {
            "model": dict(model="gpt-4o", messages=user),
            "tools": dict(model=task.model, messages=user, tools=[{"type": "function", "function": {"name": ""}}]),
            "context": dict(model=task.model, messages=[{"role": "user", "content": "word " * 3000}]),
        }.items():
            try:
                await client.chat.completions.create(**kwargs)
            except openai.APIStatusError as exc:
                seen[name] = (exc.status_code, exc.message)
                seen[name + " code"] = exc.code
        try:  # chat completions stream; the legacy completions do not
            await client.completions.create(model=task.model, prompt="A", stream=True)
        except openai.APIStatusError as exc:
            seen["stream"] = (exc.status_code, exc.message)
        return 1.0

    tape = play(agent_for(faulty), ScriptedLLM(tokenizer, []))
    assert seen["model"][0] == 404 and "'gpt-4o' is not served" in seen["model"][1]
    assert seen["tools"][0] == 400 and "tools[0].function.name" in seen["tools"][1]
    assert seen["context"][0] == 400 and "the model's context is 1024" in seen["context"][1]
    assert seen["context code"] == "context_length_exceeded" and seen["tools code"] is None  # OpenAI's shape
    assert seen["stream"][0] == 400 and "/v1/completions is not streamed" in seen["stream"][1]
    assert tape.metadata.error.startswith("gateway: HTTP 404: model 'gpt-4o'")  # the first fault
    assert tape_samples(tape, require_ref=False) == []


def test_requests_without_the_key_for_other_episodes_or_after_the_end_are_refused(tokenizer, agent_for):
    kept = {}

    async def keeps_its_url(task, client):
        kept["url"], kept["key"] = task.base_url, task.api_key
        async with httpx.AsyncClient() as http:
            kept["no_key"] = (await http.get(task.base_url + "/models")).status_code
            kept["models"] = (await http.get(task.base_url + "/models", headers=auth(task.api_key))).json()
            other = task.base_url.replace("/episodes/", "/episodes/0")
            kept["other"] = (await http.get(other + "/models", headers=auth(task.api_key))).status_code
        return 1.0

    agent = agent_for(keeps_its_url)
    play(agent, ScriptedLLM(tokenizer, []))
    assert kept["no_key"] == 401 and kept["other"] == 404
    assert [m["id"] for m in kept["models"]["data"]] == [MODEL_NAME]
    late = httpx.post(kept["url"] + "/chat/completions", headers=auth(kept["key"]),
                      json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "A"}]})  # fmt: skip
    assert late.status_code == 409 and "has ended" in late.json()["error"]["message"]
    assert agent.gateway.host == "127.0.0.1"


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def test_a_server_failure_stops_the_run(tokenizer, agent_for):
    async def one_call(task, client):
        await client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": "A"}])

    with pytest.raises(LLMError):
        play(agent_for(one_call), ScriptedLLM(tokenizer, [LLMError("every server is gone")]))


def test_a_replay_answers_from_the_tape_and_gives_it_back(tokenizer, agent_for):
    a, b, product = answer_of()
    agent = agent_for("agents.programs.openai_tools:play")
    tape = play(agent, ScriptedLLM(tokenizer, [tool_reply(a, b), f"\\boxed{{{product}}}"]))
    again = play(agent, ReplayLLM(tape, strict=True))
    assert [c.prompt_token_ids for c in again.llm_calls] == [c.prompt_token_ids for c in tape.llm_calls]
    assert [s.model_dump(exclude={"metadata"}) for s in again.steps] == [
        s.model_dump(exclude={"metadata"}) for s in tape.steps
    ]


def test_many_concurrent_episodes_each_get_their_own_calls(tokenizer, agent_for):
    async def echo(task, client):
        reply = await client.chat.completions.create(model=task.model, messages=[
            {"role": "user", "content": task.observation}])  # fmt: skip
        return 1.0 if reply.choices[0].message.content == task.observation else 0.0

    class Echo:
        async def complete_ids(self, prompt_ids, sampling, *, messages=None, prompt_text=""):
            await asyncio.sleep(0.01)
            text = messages[-1]["content"]
            return scripted_call(text, tokenizer(text, add_special_tokens=False)["input_ids"], prompt_ids, sampling)

    agent = agent_for(echo)

    async def many():
        tapes = [Tape() for _ in range(80)]
        await asyncio.gather(*(agent.run_episode(arithmetic(), seed, Echo(), t) for seed, t in enumerate(tapes)))
        return tapes

    tapes = asyncio.run(many())
    assert all(t.metadata.reward == 1.0 for t in tapes), [t.metadata.error for t in tapes if t.metadata.reward != 1.0]


async def one_argument(task):
    return 1.0


@pytest.mark.parametrize(
    "path, words",
    [
        ("agents.programs.openai_tools", "expected MODULE:CALLABLE"),
        ("no.such.module:play", "does not import (ModuleNotFoundError"),
        ("agents.programs.openai_tools:nothing", "has no 'nothing'"),
        ("agents.programs.openai_tools:SYSTEM", "is not callable"),
        ("agents.programs.openai_tools:MAX_TURNS", "is not callable"),
        ("json:dumps", "must be an async function"),
        ("tests.test_gateway:one_argument", "must take 2 arguments (task, client); it takes (task)"),
    ],
)
def test_a_program_path_of_the_wrong_shape_is_refused_in_one_line(path, words):
    with pytest.raises(ProgramError, match=None) as info:
        load_program(path)
    assert words in str(info.value) and "\n" not in str(info.value)


PROGRAMS = sorted(p.stem for p in (Path(__file__).parent.parent / "agents" / "programs").glob("*.py")
                  if p.stem != "__init__")  # fmt: skip


@pytest.mark.parametrize("module", PROGRAMS)
def test_every_shipped_program_answers_a_task_through_the_gateway(tokenizer, agent_for, module):
    """Every program in agents/programs/ (a new one too: nothing registers it) plays an episode through the
    gateway: the model answering at once, its one call is recorded and the environment scores the answer."""
    a, b, product = answer_of()
    roles = getattr(importlib.import_module(f"agents.programs.{module}"), "ROLES", ())  # several agents' programs
    replies = [f"So \\boxed{{{product}}}."] * max(1, len(roles))
    tape = play(agent_for(f"agents.programs.{module}:play", roles=roles), ScriptedLLM(tokenizer, replies))
    assert tape.metadata.error is None, tape.metadata.error
    assert [c.role for c in tape.llm_calls] == (list(roles) or [None])
    assert turn_rewards(tape)[0] == 1.0  # the environment scored the first call's answer
    if not roles:
        assert tape.metadata.reward == 1.0 and tape.metadata.success is True


def test_tools_are_checked_and_parsed_by_vllms_parser(tokenizer):
    with pytest.raises(ToolFormatError, match=r"tools\[1\].function.parameters"):
        check_tools([{"type": "function", "function": {"name": "a"}},
                     {"type": "function", "function": {"name": "b", "parameters": "x"}}])  # fmt: skip
    tools = [{"type": "function", "function": {"name": "python"}}]
    content, calls = ToolFormat(tokenizer).parse(
        'Let me. <tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>', tools
    )
    assert content == "Let me. " and calls[0]["function"] == {"name": "python", "arguments": '{"code": "1"}'}
    assert ToolFormat(tokenizer).parse("no call", tools) == ("no call", [])
    with pytest.raises(ToolFormatError, match="unknown tool parser 'nope'"):
        ToolFormat(tokenizer, "nope").parse("<tool_call>{}</tool_call>", tools)


def test_agent_message_steps_read_back(tokenizer):
    tape = Tape()
    tape.append(AgentMessage(text="hi", turn=1))
    tape.append(ProgramMessage(role="user", text="more", turn=1))
    assert Tape.model_validate_json(tape.model_dump_json()).steps == tape.steps


def constant_reward(tape):
    return 0.25


def test_rewards_per_turn_from_the_program_or_from_a_reward_function_of_the_tape(tokenizer, agent_for):
    async def two_turns(task, client):
        messages = [{"role": "user", "content": "A"}]
        for value in (0.5, 1.0):
            reply = await client.chat.completions.create(model=task.model, messages=messages)
            task.reward(value)  # the latest call's turn
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "again"}]  # fmt: skip

    tape = play(agent_for(two_turns), ScriptedLLM(tokenizer, ["x", "y"]))
    assert turn_rewards(tape) == [0.5, 1.0] and tape.metadata.reward == 1.5
    (sample,) = tape_samples(tape, require_ref=False)
    assert [t["reward"] for t in sample["turns"]] == [0.5, 1.0]

    async def leaves_it(task, client):
        await client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": "A"}])

    tape = play(agent_for(leaves_it, reward="tests.test_gateway:constant_reward"), ScriptedLLM(tokenizer, ["x"]))
    assert tape.metadata.reward == 0.25 and tape.metadata.reward_reason == "the reward function's"


def test_program_options_are_refused_without_a_program_and_checked_with_one(rl_cli):
    code, err = rl_cli(["--program.reward", "tests.test_gateway:constant_reward"])
    assert code == 2 and "--program.reward: is an agent program's option" in err
    code, err = rl_cli(["--program.time_limit_s", "5"])
    assert code == 2 and "--program.time_limit_s: is an agent program's option" in err
    code, err = rl_cli(["--agent.program", "agents.programs.openai_tools:play", "--program.tool_parser", "nope"])
    assert code == 2 and "--program.tool_parser: 'nope' is not one of vLLM's tool parsers" in err
    bad = "agents.programs.openai_tools:run_tool"  # (task, name, arguments)
    code, err = rl_cli(["--agent.program", "agents.programs.openai_tools:play", "--program.reward", bad])
    assert code == 2 and "--program.reward" in err and "'run_tool' must take one argument (tape)" in err
    code, err = rl_cli(["--agent.reward", "tests.test_gateway:constant_reward"])  # the option's old place
    assert code == 2 and "--agent.reward" in err
    code, err = rl_cli(["--agent.program", "no_such_module:play"])
    assert code == 2 and "module 'no_such_module' does not import" in err


def test_the_replay_command_gives_a_programs_tapes_back_and_names_the_first_call_that_differs(
    tokenizer, agent_for, tmp_path, capsys
):
    from orchestrate.after import replay
    from orchestrate.loop.config import RLConfig
    from orchestrate.loop.rollouts import new_tape
    from orchestrate.loop.samples import save_tapes

    config = RLConfig.model_validate({"env": {"id": "math:arithmetic", "options": {"digits": 3, "operations": ["*"]}},
                                      "agent": {"program": "agents.programs.openai_tools:play"}})  # fmt: skip
    (tmp_path / "config.json").write_text(config.model_dump_json())
    spec = EnvSpec.from_config(config, "train")
    env = spec.make()
    question, _ = env.reset(seed=5)
    a, b = [int(x) for x in question.removeprefix("What is ").rstrip("?").split(" * ")]
    tape = new_tape(spec, 5, iteration=1, group_id="g", policy_version=0)
    agent = agent_for("agents.programs.openai_tools:play")
    asyncio.run(
        agent.run_episode(spec.make(), 5, ScriptedLLM(tokenizer, [tool_reply(a, b), f"\\boxed{{{a * b}}}"]), tape)
    )
    assert tape.metadata.reward == 1.0
    path = save_tapes(tmp_path / "tapes" / "iter_000001.jsonl", [tape])
    assert replay.main([str(path)]) == 0  # the python tool runs again in the real sandbox: the same tape
    assert "1 identical, 0 differ" in capsys.readouterr().out
    tape.llm_calls[1].prompt_token_ids[-3] += 1  # as if the program had sent something else the second time
    changed = save_tapes(tmp_path / "tapes" / "iter_000002.jsonl", [tape])
    assert replay.main([str(changed)]) == 1
    assert "call #2 prompt differs from the recorded one" in capsys.readouterr().out


EXTERNAL = """
import os, openai
client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
reply = client.chat.completions.create(model=os.environ["MODEL"], messages=[{"role": "user", "content": "A"}])
print(reply.choices[0].message.content)
"""


def test_a_program_in_another_process_uses_the_gateway_by_url(tokenizer, agent_for):
    import sys

    async def external(task, client):
        env = {**os.environ, "OPENAI_BASE_URL": task.base_url, "OPENAI_API_KEY": task.api_key, "MODEL": task.model}
        child = await asyncio.create_subprocess_exec(sys.executable, "-c", EXTERNAL, env=env,
                                                     stdout=asyncio.subprocess.PIPE)  # fmt: skip
        out, _ = await child.communicate()
        return 1.0 if out.decode().strip() == "from a child" else 0.0

    tape = play(agent_for(external), ScriptedLLM(tokenizer, ["from a child"]))
    assert tape.metadata.reward == 1.0 and len(tape.llm_calls) == 1


def test_the_completions_endpoint_takes_text_or_ids_and_chains_calls_that_extend(tokenizer, agent_for):
    async def raw(task, client):
        first = await client.completions.create(model=task.model, prompt="Q: 2+2?\nA:")
        ids = tokenizer("Q: 2+2?\nA:", add_special_tokens=False)["input_ids"]
        extended = ids + tokenizer(first.choices[0].text, add_special_tokens=False)["input_ids"] + [198]
        await client.completions.create(model=task.model, prompt=extended)  # token ids, extending the first
        await client.completions.create(model=task.model, prompt="unrelated")
        return 1.0

    tape = play(agent_for(raw), ScriptedLLM(tokenizer, [" 4", " ok", " no"], eos=False))
    assert [c.extends_previous for c in tape.llm_calls] == [None, True, False]
    assert tape.llm_calls[0].prompt_text == "Q: 2+2?\nA:" and tape.metadata.turns == 3
    assert len(tape_samples(tape, require_ref=False)) == 2


def test_episodes_share_one_sandbox_and_a_sandbox_failure_is_an_infrastructure_failure(tokenizer, tmp_path):
    import threading
    import time

    from agents.sandbox import SandboxResult

    made = []

    class Broken:
        def run(self, code):
            return SandboxResult(stdout="", stderr="", exit_code=None, infra_error="could not start")

    def make():  # slow to build: episodes that reach their first tool call together must not build two
        time.sleep(0.2)
        made.append(threading.get_ident())
        return Broken()

    async def calls_the_tool(task, client):
        return await task.run_python("print(1)")

    agent = ProgramAgent(calls_the_tool, SAMPLING, tokenizer, sandbox=make)
    try:

        async def many():
            tapes = [Tape() for _ in range(4)]
            await asyncio.gather(
                *(agent.run_episode(arithmetic(), s, ScriptedLLM(tokenizer, []), t) for s, t in enumerate(tapes))
            )
            return tapes

        tapes = asyncio.run(many())
    finally:
        agent.close()
    assert len(made) == 1
    assert all(
        "SandboxInfraError: the sandbox could not run the code: could not start" in t.metadata.error for t in tapes
    )


def test_offline_rescore_refuses_a_programs_tapes_before_writing_anything(tokenizer, agent_for, tmp_path, capsys):
    from orchestrate.after.offline import main as offline
    from orchestrate.loop.rollouts import new_tape
    from orchestrate.loop.samples import save_tapes

    spec = EnvSpec("math:arithmetic", {"digits": 3, "operations": ["*"]}, "train", 0)
    tape = new_tape(spec, 3, iteration=1, group_id="g", policy_version=0)
    a, b, product = answer_of()
    agent = agent_for("agents.programs.openai_tools:play")
    asyncio.run(
        agent.run_episode(spec.make(), 3, ScriptedLLM(tokenizer, [tool_reply(a, b), f"\\boxed{{{product}}}"]), tape)
    )
    path = save_tapes(tmp_path / "tapes" / "iter_000001.jsonl", [tape])
    with pytest.raises(SystemExit) as exc:
        offline(
            ["--tapes", str(path), "--out", str(tmp_path / "out"), "--rescore", "--model", "smollm2", "--no-progress"]
        )
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.startswith("error: --rescore: 1 tapes were played by an agent program"), err
    assert not (tmp_path / "out").exists()


def test_the_built_in_agent_and_a_program_share_one_interface(tokenizer):
    """start, run_episode, close: `with agent:` starts a program's gateway and stops it; the built-in agent's
    start and close do nothing (the loop, fork and replay treat both alike)."""
    from agents.agent import Agent, AgentConfig, ChatAgent
    from agents.chat import ChatTokens

    with ChatAgent(AgentConfig(), SAMPLING, ChatTokens(tokenizer)) as chat:
        assert isinstance(chat, Agent)
    program = ProgramAgent("agents.programs.openai_tools:play", SAMPLING, tokenizer)
    assert isinstance(program, Agent)
    with program as agent:
        assert agent is program and agent.gateway._server.started
        httpx.get(agent.gateway.url + "/episodes/x/v1/models", timeout=5)  # it answers
    with pytest.raises(httpx.ConnectError):
        httpx.get(program.gateway.url + "/episodes/x/v1/models", timeout=5)


def test_a_program_that_blocks_its_thread_stalls_no_other_episode_and_is_bounded(tokenizer, agent_for):
    """Each program runs on its own thread's loop: one that blocks it (a synchronous sleep or HTTP call, here a
    wait that would never end) neither holds up the episodes beside it nor escapes its time limit; its
    episode is a failure (left out of training), not the reward it would have returned."""
    import threading
    import time

    release = threading.Event()

    async def blocks(task, client):
        if task.seed == 1:
            release.wait(60)  # synchronous: the thread is held, no await
            return 1.0
        await client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": "A"}])
        return 0.5

    agent = agent_for(blocks, time_limit_s=1.5)
    llm = ScriptedLLM(tokenizer, ["x"])
    ended = {}

    async def both():
        async def one(seed):
            tape = await agent.run_episode(arithmetic(), seed, llm, Tape())
            ended[seed] = time.monotonic() - start
            return tape

        start = time.monotonic()
        return await asyncio.gather(one(1), one(2))

    try:
        blocked, other = asyncio.run(both())
    finally:
        release.set()
    assert other.metadata.error is None and other.metadata.reward == 0.5
    assert ended[2] < 1.0, f"the other episode waited for the blocked one ({ended[2]:.2f} s)"
    assert "time limit of 1.5 s" in blocked.metadata.error and ended[1] < 5
    assert tape_samples(blocked, require_ref=False) == []

    async def sleeps_past_its_limit(task, client):
        time.sleep(0.6)  # a synchronous sleep past the limit: the episode does not get its reward
        return 1.0

    tape = play(agent_for(sleeps_past_its_limit, time_limit_s=0.2), ScriptedLLM(tokenizer, []))
    assert "time limit of 0.2 s" in tape.metadata.error and tape.metadata.reward is None


def test_a_failure_inside_the_openai_client_is_located_at_the_programs_own_line(tokenizer, agent_for):
    import inspect

    async def asks_for_another_model(task, client):
        await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "A"}])

    line = inspect.getsourcelines(asks_for_another_model)[1] + 1
    tape = play(agent_for(asks_for_another_model), ScriptedLLM(tokenizer, []))
    assert tape.metadata.error.startswith("the program raised NotFoundError"), tape.metadata.error
    assert tape.metadata.error.endswith(f"({os.path.realpath(__file__)}:{line})"), tape.metadata.error
    assert "_base_client.py" not in tape.metadata.error


def test_rewards_must_be_finite_numbers_and_an_episode_without_a_call_is_a_failure(tokenizer, agent_for):
    import numpy as np

    user = [{"role": "user", "content": "A"}]

    def returning(value):
        async def program(task, client):
            await client.chat.completions.create(model=task.model, messages=user)
            return value

        return program

    tape = play(agent_for(returning(float("nan"))), ScriptedLLM(tokenizer, ["x"]))
    assert tape.metadata.error == "ValueError: the program's return: nan is not a finite number"
    assert tape_samples(tape, require_ref=False) == []
    tape = play(agent_for(returning(np.float32(0.5))), ScriptedLLM(tokenizer, ["x"]))  # a numpy scalar is a number
    assert tape.metadata.error is None and tape.metadata.reward == 0.5

    async def gives_inf(task, client):
        await client.chat.completions.create(model=task.model, messages=user)
        task.reward(float("inf"))

    tape = play(agent_for(gives_inf), ScriptedLLM(tokenizer, ["x"]))
    assert "the program raised ValueError: task.reward: inf is not a finite number" in tape.metadata.error

    async def no_call(task, client):  # e.g. a client of its own, pointed elsewhere
        return 1.0

    tape = play(agent_for(no_call), ScriptedLLM(tokenizer, []))
    assert tape.metadata.error.startswith("the program made no call through the gateway") and not tape.llm_calls


def test_an_answer_returned_after_the_programs_own_steps_ended_the_episode_is_not_sent_again(tokenizer, agent_for):
    a, b, product = answer_of()

    async def steps_then_returns(task, client):
        reply = await client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": "A"}])
        await task.step(reply.choices[0].message.content)  # the environment's one turn: its episode ends
        return reply.choices[0].message.content

    tape = play(agent_for(steps_then_returns), ScriptedLLM(tokenizer, [f"\\boxed{{{product}}}"]))
    assert tape.metadata.error is None and tape.metadata.reward == 1.0


def test_stop_strings_tool_choice_late_calls_and_template_errors_as_an_openai_client_expects(tokenizer, agent_for):
    import openai

    a, b, product = answer_of()
    tools = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]
    user = [{"role": "user", "content": "A"}]
    seen = {}

    async def program(task, client):
        reply = await client.chat.completions.create(model=task.model, messages=user, stop=["Observation:"])
        seen["content"] = reply.choices[0].message.content  # the stop string left out, as OpenAI does
        text = await client.completions.create(model=task.model, prompt="Say:", stop=["END"])
        seen["text"] = text.choices[0].text
        for choice in ("required", {"type": "function", "function": {"name": "python"}}):
            reply = await client.chat.completions.create(model=task.model, messages=user, tools=tools,
                                                         tool_choice=choice)  # fmt: skip
            seen.setdefault("calls", []).append(reply.choices[0].message.tool_calls[0].function.name)
        try:
            await client.chat.completions.create(model=task.model, messages=user, tools=tools,
                                                 tool_choice={"type": "function", "function": {"name": "nope"}})  # fmt: skip
        except openai.BadRequestError as exc:
            seen["named"] = exc.message
        return 1.0

    llm = ScriptedLLM(tokenizer, ["I will act.\nObservation:", "hello END", tool_reply(a, b), tool_reply(a, b)])
    tape = play(agent_for(program), llm)
    assert seen["content"] == "I will act.\n" and seen["text"] == "hello "
    assert tape.llm_calls[0].output_text.endswith("Observation:")  # the tape keeps what was sampled
    assert seen["calls"] == ["python", "python"] and "names function 'nope'" in seen["named"]

    # a template that refuses a message (as Gemma's refuses a system role): a 400 the program reads, not a 500
    from transformers import AutoTokenizer

    strict = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    strict.chat_template = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system "
                            "role') }}{% endif %}{{ m.content }}{% endfor %}")  # fmt: skip

    async def with_system(task, client):
        try:
            await client.chat.completions.create(model=task.model, messages=[{"role": "system", "content": "S"}])
        except openai.APIStatusError as exc:
            seen["template"] = (exc.status_code, exc.message, exc.response.headers.get("x-should-retry"))
        return 1.0

    agent = ProgramAgent(with_system, SAMPLING, strict, max_context=1024)
    try:
        play(agent, ScriptedLLM(strict, []))
    finally:
        agent.close()
    status, message, retry = seen["template"]
    assert status == 400 and "no system role" in message and retry == "false"


def test_a_call_in_flight_when_its_episode_ends_is_refused_and_not_recorded(tokenizer, agent_for):
    """A program past its time limit whose call was still being answered: the call's reply comes after the
    tape was written, and is neither recorded nor returned as a success."""
    import threading

    answered = threading.Event()
    outcome = {}

    class SlowLLM(ScriptedLLM):
        async def complete_ids(self, prompt_ids, sampling, **kw):
            await asyncio.sleep(0.6)
            return await super().complete_ids(prompt_ids, sampling, **kw)

    async def program(task, client):
        def call():  # from a thread the time limit does not cancel, as a program's blocking client would
            r = httpx.post(task.base_url + "/chat/completions", headers=auth(task.api_key), timeout=10,
                           json={"model": task.model, "messages": [{"role": "user", "content": "A"}]})  # fmt: skip
            outcome["status"] = r.status_code
            answered.set()

        threading.Thread(target=call, daemon=True).start()
        await asyncio.sleep(30)

    agent = agent_for(program, time_limit_s=0.3)
    llm = SlowLLM(tokenizer, ["x"])

    async def episode_then_wait():
        tape = await agent.run_episode(arithmetic(), 3, llm, Tape())
        for _ in range(50):  # the episode's loop goes on (as the run's does) while the late call finishes
            if answered.is_set():
                break
            await asyncio.sleep(0.1)
        return tape

    tape = asyncio.run(episode_then_wait())
    assert "time limit" in tape.metadata.error and outcome["status"] == 409
    assert tape.llm_calls == [] and not any(type(s).__name__ == "AgentMessage" for s in tape.steps)


def test_a_program_whose_calls_ask_for_fewer_tokens_replays_identical(tokenizer, agent_for):
    """The first call asks for 8 tokens, the second for the run's: a replay plays it at the run's sampling (the
    largest its calls had), not at the first call's narrowed one, and finds nothing that differs."""
    from orchestrate.after.replay import replay_tape
    from orchestrate.loop.rollouts import new_tape

    async def short_then_long(task, client):
        messages = [{"role": "user", "content": "A"}]
        reply = await client.chat.completions.create(model=task.model, messages=messages, max_tokens=8)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "more"}]  # fmt: skip
        await client.chat.completions.create(model=task.model, messages=messages)
        return 1.0

    spec = EnvSpec("math:arithmetic", {"digits": 3, "operands": 2, "operations": ["*"]}, "train", 0)
    tape = new_tape(spec, 3, iteration=1, group_id="g", policy_version=0)
    agent = agent_for(short_then_long)
    asyncio.run(agent.run_episode(spec.make(), 3, ScriptedLLM(tokenizer, ["x", "y"]), tape))
    assert [c.sampling.max_tokens for c in tape.llm_calls] == [8, 64]
    _, diff = asyncio.run(replay_tape(tape, agent))
    assert not diff.notes and diff.identical, diff.notes


def test_a_template_that_writes_todays_date_renders_the_same_on_any_day(tokenizer):
    """Llama 3's template writes "Today Date:" from strftime_now unless given a date: an episode's prompts would
    change with the day it is replayed or forked on. The date is fixed (agents.chat.TEMPLATE_DATE)."""
    from transformers import AutoTokenizer

    from agents.chat import TEMPLATE_DATE, ChatTokens

    dated = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    dated.chat_template = ("{% if not date_string is defined %}{% set date_string = strftime_now('%d %b %Y') %}"
                           "{% endif %}Today Date: {{ date_string }}\n{% for m in messages %}{{ m.content }}\n"
                           "{% endfor %}")  # fmt: skip
    text, _ = ChatTokens(dated).first_prompt([{"role": "user", "content": "A"}])
    assert text == f"Today Date: {TEMPLATE_DATE}\nA\n"


def test_fields_a_client_sends_as_null_are_unset(tokenizer, agent_for):
    """Some clients send every field, null where unset: n null is one choice, and a null
    max_completion_tokens leaves max_tokens in effect."""

    async def nulls(task, client):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=agent.gateway.asgi)) as http:
            reply = await http.post(task.base_url + "/chat/completions", headers=auth(task.api_key), json={
                "model": task.model, "messages": [{"role": "user", "content": "A"}], "n": None,
                "max_completion_tokens": None, "max_tokens": 4, "stop": None})  # fmt: skip
        assert reply.status_code == 200, reply.text
        return 1.0

    agent = agent_for(nulls)
    tape = play(agent, ScriptedLLM(tokenizer, ["x"]))
    assert tape.metadata.error is None and tape.llm_calls[0].sampling.max_tokens == 4


def test_the_sampled_tokens_log_probs_are_served_when_asked_and_alternatives_refused(tokenizer, agent_for):
    import openai

    seen = {}

    async def program(task, client):
        user = [{"role": "user", "content": "A"}]
        reply = await client.chat.completions.create(model=task.model, messages=user, logprobs=True)
        seen["chat"] = [(t.token, t.logprob) for t in reply.choices[0].logprobs.content]
        plain = await client.chat.completions.create(model=task.model, messages=user)
        seen["plain"] = plain.choices[0].logprobs
        text = await client.completions.create(model=task.model, prompt="Say:", logprobs=0)
        seen["text"] = (text.choices[0].logprobs.tokens, text.choices[0].logprobs.token_logprobs)
        try:
            await client.chat.completions.create(model=task.model, messages=user, logprobs=True, top_logprobs=2)
        except openai.BadRequestError as exc:
            seen["top"] = exc.message
        return 1.0

    agent = agent_for(program)
    tape = play(agent, ScriptedLLM(tokenizer, ["hello there", "again", "words"]))
    first, third = tape.llm_calls[0], tape.llm_calls[2]
    assert [lp for _, lp in seen["chat"]] == first.logprobs and "".join(t for t, _ in seen["chat"]).startswith(
        "hello there")  # fmt: skip
    assert seen["plain"] is None and seen["text"][1] == third.logprobs and "".join(seen["text"][0]).startswith("words")
    assert "top_logprobs" in seen["top"]


def test_the_ended_episodes_the_gateway_remembers_are_bounded(tokenizer, monkeypatch):
    from orchestrate.gateway import server

    monkeypatch.setattr(server, "CLOSED_KEPT", 3)
    gateway = server.Gateway()
    try:
        for _ in range(5):
            session = gateway.open(tape=Tape(), llm=None, chat=None, tool_format=None, sampling=SAMPLING,
                                   model_name=MODEL_NAME, max_context=None, loop=None)  # fmt: skip
            gateway.close(session)
        assert len(gateway._closed) == 3 and session.id in gateway._closed
    finally:
        gateway.stop()


def test_replay_and_fork_take_any_free_port_not_the_runs(tmp_path):
    """A run with --program.gateway_port P holds P while it runs: a replay or fork of its tapes beside it binds
    another port (it failed with 'address in use')."""
    import socket

    from orchestrate.loop.config import RLConfig
    from orchestrate.loop.setup import agent_from_run_config

    held = socket.create_server(("127.0.0.1", 0))
    port = held.getsockname()[1]
    config = RLConfig.model_validate({"env": {"id": "math:arithmetic"},
                                      "agent": {"program": "agents.programs.openai_tools:play"},
                                      "program": {"gateway_port": port}})  # fmt: skip
    (tmp_path / "config.json").write_text(config.model_dump_json())
    try:
        with agent_from_run_config(tmp_path / "config.json") as agent:
            assert agent.gateway.port not in (0, port)
    finally:
        held.close()
