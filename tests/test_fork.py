"""Forks (`python -m orchestrate.after.fork`): a tape's first K calls replayed strictly, the rest sampled live, n times;
the built-in agent and an agent program, against scripted LLMs on the embedded model's real tokenizer; the
command's refusals; one fork sampled by a real vLLM server."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from agents.agent import AgentConfig, ChatAgent
from agents.chat import ChatTokens
from agents.env_spec import EnvSpec
from agents.tools import RecordedTool, ToolCall
from orchestrate.after import fork as fork_command
from orchestrate.gateway.agent import ProgramAgent
from orchestrate.loop.command_line import resolve
from orchestrate.loop.forks import fork_sampling, fork_tape, replayed_part
from orchestrate.loop.rollouts import RolloutContext, run_rollouts
from orchestrate.serving.recorded import ForkDiverged, ForkLLM
from tapes.store import read_tapes, write_tapes
from tapes.tape import LLMCall, SamplingParams, Tape, ToolCallAction, ToolResultObservation
from tests.scripted import scripted_call

GAME = EnvSpec("game:guess_the_number", {"low": 1, "high": 10, "max_turns": 4}, "train", 0)
SAMPLING = SamplingParams(temperature=0.7, max_tokens=16)


class ScriptedLLM:
    """Answers with the next text of `texts` (tokenised, end of turn appended), as policy version `version`."""

    def __init__(self, tokenizer, texts, version=0):
        self.tokenizer, self.texts, self.version = tokenizer, list(texts), version
        self.prompts: list[list[int]] = []

    async def complete_ids(self, prompt_ids, sampling, *, messages=None, prompt_text=""):
        self.prompts.append(list(prompt_ids))
        text = self.texts.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not any(text.endswith(s) for s in sampling.stop):
            ids = ids + [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        call = scripted_call(text, ids, prompt_ids, sampling, messages=messages, prompt_text=prompt_text, logprob=-0.3)
        call.policy_version = self.version
        return call


def game_agent(tokenizer, instruction=""):
    return ChatAgent(AgentConfig(max_turns=6, instruction=instruction), SAMPLING, ChatTokens(tokenizer))


def numbers(spec):
    return range(spec.options.get("low", 1), spec.options.get("high", 10) + 1)


def answer(spec, seed):
    """The number the game of `seed` hides."""

    def wins(n):
        env = spec.make()
        env.reset(seed)
        return env.step(f"\\boxed{{{n}}}")[1] == 1.0

    return next(n for n in numbers(spec) if wins(n))


def played(agent, spec, texts, tokenizer, seed=0):
    """One episode of `spec` from `seed` by `agent` with scripted answers, as a run records it."""
    context = RolloutContext(agent, spec, ScriptedLLM(tokenizer, texts), iteration=3, policy_version=2)
    (tape,) = asyncio.run(run_rollouts(context, [seed], 1, progress=False))
    for call in tape.llm_calls:
        call.policy_version = 2
    return tape


def wrong_guesses(spec, seed, count):
    right = answer(spec, seed)
    return [f"\\boxed{{{n}}}" for n in numbers(spec) if n != right][:count]


# -- ForkLLM and fork_tape: the built-in agent ------------------------------------------------------------


def test_a_fork_replays_the_first_calls_as_recorded_and_samples_the_rest_live(tokenizer):
    tape = played(game_agent(tokenizer), GAME, wrong_guesses(GAME, 0, 3) + ["\\boxed{1}"], tokenizer)
    assert len(tape.llm_calls) == 4 and tape.metadata.turns == 4
    right = answer(GAME, 0)
    live = ScriptedLLM(tokenizer, [f"\\boxed{{{right}}}"] * 3, version=7)
    sampling = fork_sampling(tape, SAMPLING, temperature=1.0)
    forks = asyncio.run(fork_tape(tape, game_agent(tokenizer), 2, 3, live, sampling, policy_version=7))
    assert len(forks) == 3 and len({f.metadata.id for f in forks}) == 3
    for fork in forks:
        m = fork.metadata
        assert m.parent_id == tape.metadata.id and m.branch_at == 2 and m.id != tape.metadata.id
        assert m.group_id == f"{tape.metadata.id}@2" and m.task_id == tape.metadata.task_id
        assert m.policy_version == 7 and m.iteration == 3 and fork.context == tape.context
        # the replayed calls as recorded (id, version, log-probs, sampling); the live one new, from the fork's
        # prompt: the recorded prefix + what the environment answered
        assert [c.model_dump(exclude={"turn", "extends_previous"}) for c in fork.llm_calls[:2]] == [
            c.model_dump(exclude={"turn", "extends_previous"}) for c in tape.llm_calls[:2]]  # fmt: skip
        assert [c.policy_version for c in fork.llm_calls] == [2, 2, 7]
        assert fork.llm_calls[2].prompt_token_ids == tape.llm_calls[2].prompt_token_ids
        assert fork.llm_calls[2].sampling.temperature == 1.0 and fork.llm_calls[2].extends_previous is True
        assert [c.turn for c in fork.llm_calls] == [1, 2, 3]
        assert m.reward == 1.0 and m.success and m.terminated and len(fork.llm_calls) == 3
        assert [s.text for s in fork.steps[:5]] == [s.text for s in tape.steps[:5]]
    assert len(live.prompts) == 3  # one live call per fork


def test_a_fork_at_zero_is_all_live_and_at_the_end_is_all_replayed(tokenizer):
    tape = played(game_agent(tokenizer), GAME, wrong_guesses(GAME, 0, 2) + ["nothing to read"], tokenizer)
    n = len(tape.llm_calls)
    live = ScriptedLLM(tokenizer, ["\\boxed{4}"] * 8)
    (first,) = asyncio.run(fork_tape(tape, game_agent(tokenizer), 0, 1, live, SAMPLING))
    assert first.metadata.branch_at == 0 and first.llm_calls[0].id != tape.llm_calls[0].id
    assert first.llm_calls[0].prompt_token_ids == tape.llm_calls[0].prompt_token_ids
    (whole,) = asyncio.run(fork_tape(tape, game_agent(tokenizer), n, 1, ScriptedLLM(tokenizer, []), SAMPLING))
    assert [c.id for c in whole.llm_calls] == [c.id for c in tape.llm_calls]
    assert whole.metadata.reward == tape.metadata.reward and whole.metadata.branch_at == n


def test_a_fork_whose_agent_renders_another_prompt_fails_naming_the_call(tokenizer):
    tape = played(game_agent(tokenizer), GAME, wrong_guesses(GAME, 0, 3), tokenizer)
    live = ScriptedLLM(tokenizer, ["\\boxed{4}"] * 4)
    with pytest.raises(ForkDiverged, match=r"^fork at call 2: call #1 prompt differs .* token \d+ was \d+, now \d+"):
        asyncio.run(fork_tape(tape, game_agent(tokenizer, instruction="Be quick."), 2, 2, live, SAMPLING))
    assert live.prompts == []  # nothing went live
    # a tape whose first answer now wins: the episode ends before the branch point
    edited = tape.model_copy(deep=True)
    edited.llm_calls[0].output_text = f"\\boxed{{{answer(GAME, 0)}}}"
    with pytest.raises(ForkDiverged, match=r"the episode ended after 1 call, before the branch point \(.+\)"):
        asyncio.run(fork_tape(edited, game_agent(tokenizer), 2, 1, live, SAMPLING))


def test_fork_llm_counts_and_refuses_a_branch_past_the_tape(tokenizer):
    tape = played(game_agent(tokenizer), GAME, wrong_guesses(GAME, 0, 2), tokenizer)
    with pytest.raises(ValueError, match="at=9"):
        ForkLLM(tape, 9, None)
    llm = ForkLLM(tape, 1, ScriptedLLM(tokenizer, ["x"]))
    first = tape.llm_calls[0]
    call = asyncio.run(llm.complete_ids(first.prompt_token_ids, SAMPLING))
    assert call.id == first.id and llm.replayed == 1 and llm.live_calls == 0
    asyncio.run(llm.complete_ids([1, 2, 3], SAMPLING))
    assert llm.replayed == 1 and llm.live_calls == 1


def test_fork_sampling_keeps_the_tapes_and_takes_the_changes(tokenizer):
    tape = played(game_agent(tokenizer), GAME, wrong_guesses(GAME, 0, 2), tokenizer)
    assert fork_sampling(tape, SamplingParams()) == SamplingParams(temperature=0.7, max_tokens=16)
    assert fork_sampling(tape, SamplingParams(), 0.0, 99) == SamplingParams(temperature=0.0, max_tokens=99)
    assert fork_sampling(Tape(), SAMPLING, max_tokens=5) == SamplingParams(temperature=0.7, max_tokens=5)


class Echo:
    name, stop, answered_from_tape = "search", "</search>", True

    def execute(self, call):
        return f"live: {call.text}", {"tool": "search", "tool_error": False}


def test_tools_answered_from_the_tape_answer_the_replayed_part_then_go_live():
    steps = [ToolCallAction(text="<search>a</search>", turn=1, tool="search", call="a"),
             ToolResultObservation(text="recorded: a", turn=1, tool="search", info={"tool": "search"}),
             ToolCallAction(text="<search>b</search>", turn=2, tool="search", call="b"),
             ToolResultObservation(text="recorded: b", turn=2, tool="search", info={"tool": "search"})]  # fmt: skip
    steps[0].metadata.prompt_id, steps[2].metadata.prompt_id = "first", "second"
    tape = Tape(steps=steps, llm_calls=[LLMCall(id="first"), LLMCall(id="second")])
    part = replayed_part(tape, 1)
    assert len(part.steps) == 2 and [c.id for c in part.llm_calls] == ["first"]
    tool = RecordedTool(Echo(), part, live_after=True)
    assert tool.execute(ToolCall("search", "a"))[0] == "recorded: a"
    assert tool.execute(ToolCall("search", "b"))[0] == "live: b"
    assert replayed_part(tape, 2).steps == tape.steps and replayed_part(tape, 0).steps == []


def test_a_search_fork_answers_the_replayed_searches_from_the_tape_and_the_live_ones_from_the_corpus(
    tokenizer, tmp_path
):
    """The recorded search result comes back from the tape even though the corpus changed since; the fork's
    own search reads the corpus as it is now."""
    from tests.test_search import FACTS, QUESTIONS, episode_of, write_corpus, write_questions

    qa = {"questions": str(write_questions(tmp_path / "questions.jsonl")), "test_fraction": 0.5}
    corpus = write_corpus(tmp_path / "passages.jsonl")
    question, answer_text, _ = QUESTIONS[8]
    inner, seed = episode_of(qa, question)
    spec = EnvSpec("qa", qa, "test" if inner.test_size else "train", 0, ["search"],
                   search={"corpus": str(corpus), "top_k": 2})  # fmt: skip
    agent = ChatAgent(AgentConfig(max_turns=4), SamplingParams(max_tokens=64), ChatTokens(tokenizer))
    texts = [f"<search>{question}</search>", "<search>Ostric sea</search>", f"So \\boxed{{{answer_text}}}"]
    tape = played(agent, spec, texts, tokenizer, seed=seed)
    assert tape.metadata.reward == 1.0 and "purple" not in tape.steps[4].text
    write_corpus(corpus, [(t, x.replace("is shallow", "is purple")) for t, x in FACTS])
    live = ScriptedLLM(tokenizer, texts[1:])
    (fork,) = asyncio.run(fork_tape(tape, agent, 1, 1, live, fork_sampling(tape, agent.sampling)))
    assert [s.kind for s in fork.steps] == [s.kind for s in tape.steps] and fork.metadata.reward == 1.0
    # replayed: from the tape (the corpus now answers that search with the purple sea too)
    assert fork.steps[2].text == tape.steps[2].text and "is shallow" in fork.steps[2].text
    assert "purple" in fork.steps[4].text and fork.steps[4].info["query"] == "Ostric sea"  # live: the corpus now


# -- an agent program --------------------------------------------------------------------------------------


class FakeSandbox:
    def run(self, code):
        import contextlib
        import io

        from agents.sandbox import SandboxResult

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code, {})  # the test's own code
        return SandboxResult(stdout=out.getvalue(), stderr="", exit_code=0)


ARITHMETIC = EnvSpec("math:arithmetic", {"digits": 3, "operands": 2, "operations": ["*"]}, "train", 0)


def product_of(seed):
    question, _ = ARITHMETIC.make().reset(seed=seed)
    a, b = [int(x) for x in question.removeprefix("What is ").rstrip("?").split(" * ")]
    return a, b


def tool_reply(a, b):
    code = json.dumps({"code": f"print({a} * {b})"})
    return f'<tool_call>\n{{"name": "python", "arguments": {code}}}\n</tool_call>'


@pytest.fixture
def program_agent(tokenizer):
    made = []

    def make(program="agents.programs.openai_tools:play"):
        made.append(ProgramAgent(program, SamplingParams(temperature=0.7, max_tokens=64), tokenizer,
                                 max_context=1024, sandbox=FakeSandbox()))  # fmt: skip
        return made[-1]

    yield make
    for agent in made:
        agent.close()


def test_an_agent_program_forks_after_its_tool_call(tokenizer, program_agent):
    a, b = product_of(3)
    agent = program_agent()
    tape = played(agent, ARITHMETIC, [tool_reply(a, b), "\\boxed{1}"], tokenizer, seed=3)
    assert tape.metadata.error is None and tape.metadata.reward == 0.0 and len(tape.llm_calls) == 2
    live = ScriptedLLM(tokenizer, [f"The answer is \\boxed{{{a * b}}}.", "\\boxed{2}"], version=5)
    forks = asyncio.run(fork_tape(tape, agent, 1, 2, live, fork_sampling(tape, agent.sampling), policy_version=5))
    rewards = sorted(f.metadata.reward for f in forks)
    assert rewards == [0.0, 1.0], [f.metadata.error for f in forks]
    for fork in forks:
        assert fork.metadata.error is None and fork.metadata.parent_id == tape.metadata.id
        assert fork.metadata.branch_at == 1
        assert fork.llm_calls[0].id == tape.llm_calls[0].id and fork.llm_calls[0].policy_version == 2
        # the program ran its tool again (the sandbox), and the live call continues the replayed one exactly
        results = [s for s in fork.steps if isinstance(s, ToolResultObservation)]
        assert [r.text for r in results] == [str(a * b)]
        assert fork.llm_calls[1].prompt_token_ids == tape.llm_calls[1].prompt_token_ids
        assert fork.llm_calls[1].extends_previous is True and fork.llm_calls[1].policy_version == 5

    # another program (another system message): the first replayed call's prompt differs, named
    async def other(task, client):
        await client.chat.completions.create(model=task.model, messages=[{"role": "user", "content": "hi"}])
        return 0.0

    with pytest.raises(ForkDiverged, match="fork at call 1: call #1 prompt differs"):
        asyncio.run(fork_tape(tape, program_agent(other), 1, 1, live, SAMPLING))


# -- the command ------------------------------------------------------------------------------------------


def game_run(tmp_path, tokenizer, *overrides, tapes=2):
    """A run directory of the game preset with one iteration's tapes, played by its own agent (scripted)."""
    from orchestrate.loop.setup import agent_from_run_config

    run = tmp_path / "run"
    (run / "tapes").mkdir(parents=True)
    config = resolve("game", dict(overrides))
    (run / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
    spec = EnvSpec.from_config(config, "train")
    with agent_from_run_config(run / "config.json") as agent:
        made = [played(agent, spec, wrong_guesses(spec, seed, 2) + ["no guess"], tokenizer, seed=seed)
                for seed in range(tapes)]  # fmt: skip
    write_tapes(run / "tapes" / "iter_000001.jsonl", made)
    return run, made


def command(*args, capsys):
    try:
        code = fork_command.main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


class StandIn:
    """What the command starts instead of vLLM: a server that is never asked, and a client that answers from a
    script."""

    served_model_name = "policy"

    def stop(self):
        pass


@pytest.fixture
def scripted_server(monkeypatch, tokenizer):
    """The command's server and client replaced: every live call answered `\\boxed{7}` as the client's
    version; the policies it was asked to serve are kept."""
    asked = []

    class Client(ScriptedLLM):
        def __init__(self, endpoints, tokenizer_=None, *, model="", policy_version=0, adapter=None, **kw):
            super().__init__(tokenizer, ["\\boxed{7}"] * 100, version=policy_version)
            self.model = model

        async def complete_ids(self, *args, **kw):
            call = await super().complete_ids(*args, **kw)
            call.model = self.model
            return call

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            pass

    def start(self):
        asked.append(self.policy)
        self.server = StandIn()
        return self

    monkeypatch.setattr("orchestrate.loop.setup.PolicyServer.start", start)
    monkeypatch.setattr("orchestrate.serving.llm.VLLMClient", Client)
    return asked


def test_the_command_writes_the_forks_beside_the_tapes(tmp_path, tokenizer, scripted_server, capsys):
    run, tapes = game_run(tmp_path, tokenizer)
    path = run / "tapes" / "iter_000001.jsonl"
    code, out, err = command(path, "--index", 1, "--at", 1, "--n", 3, "--max-tokens", 8, capsys=capsys)
    assert code == 0, err
    written = run / "tapes" / "forks" / f"{tapes[1].metadata.id}_at1.jsonl"
    forks = list(read_tapes(written))
    assert len(forks) == 3 and all(f.metadata.parent_id == tapes[1].metadata.id for f in forks)
    assert all(f.metadata.branch_at == 1 and f.llm_calls[1].sampling.max_tokens == 8 for f in forks)
    lines = out.strip().splitlines()
    assert lines[0] == "policy: the initial policy smollm2 (the run has no checkpoint yet); temperature 0.7, max_tokens 8"  # fmt: skip
    for line in lines[1:4]:
        assert re.fullmatch(r"fork \d: reward -?[\d.]+(, success)?, \d calls \(1 replayed, \d live\), (terminated|truncated.*)",
                            line), line  # fmt: skip
    assert lines[-1] == f"3 forks of tape {tapes[1].metadata.id} (iter_000001.jsonl, index 1) at call 1: {written}"
    (policy,) = scripted_server
    assert policy.version == 0 and policy.name == "smollm2"
    from orchestrate.after import show

    assert show.main([str(written), "--index", "2", "--no-color"]) in (0, None)
    assert f"fork of tape {tapes[1].metadata.id}: its first 1 LLM calls replayed" in capsys.readouterr().out
    # again: a file of its own; and the run's newest checkpoint with weights is the policy now
    for version, files in ((1, ["learner.json", "config.json"]), (2, ["learner.json", "transfer.json"])):
        folder = run / "checkpoints" / f"{version:06d}"
        folder.mkdir(parents=True)
        for name in files:
            (folder / name).write_text("{}")
    code, out, err = command(path, "--index", 1, "--at", 0, "--n", 1, capsys=capsys)
    assert code == 0, err
    assert out.startswith(f"policy: version 1 ({run / 'checkpoints' / '000001'}; version 2 is newer, its weights "
                          "went in memory)")  # fmt: skip
    assert scripted_server[-1].model.resolve() == (run / "checkpoints" / "000001").resolve()
    assert scripted_server[-1].version == 1
    (fork,) = read_tapes(run / "tapes" / "forks" / f"{tapes[1].metadata.id}_at0.jsonl")
    assert fork.metadata.policy_version == 1 and fork.llm_calls[0].policy_version == 1
    assert fork.llm_calls[0].model == "smollm2"
    # a fork of a fork: beside it
    forked = run / "tapes" / "forks" / f"{tapes[1].metadata.id}_at0.jsonl"
    code, out, err = command(forked, "--index", 0, "--at", 1, "--n", 1, "--out", tmp_path / "mine.jsonl",
                             capsys=capsys)  # fmt: skip
    assert code == 0, err
    (again,) = read_tapes(tmp_path / "mine.jsonl")
    assert again.metadata.parent_id == fork.metadata.id


async def guess_sevens(task, client):
    """A program for the command's test: guesses until the game ends."""
    for _ in range(3):
        reply = await client.chat.completions.create(model=task.model, messages=[
            {"role": "user", "content": task.observation}])  # fmt: skip
        result = await task.step(reply.choices[0].message.content)
        if result.terminated or result.truncated:
            return None
    return None


def test_the_command_forks_an_agent_programs_tape(tmp_path, tokenizer, scripted_server, capsys):
    run, tapes = game_run(tmp_path, tokenizer, ("agent.program", "tests.test_fork:guess_sevens"), tapes=1)
    assert tapes[0].metadata.author == "tests.test_fork:guess_sevens" and len(tapes[0].llm_calls) == 3
    code, out, err = command(run / "tapes" / "iter_000001.jsonl", "--index", 0, "--at", 2, "--n", 2, capsys=capsys)
    assert code == 0, err
    forks = list(read_tapes(run / "tapes" / "forks" / f"{tapes[0].metadata.id}_at2.jsonl"))
    assert [len(f.llm_calls) for f in forks] == [3, 3] and all(f.metadata.error is None for f in forks)
    assert all(f.llm_calls[2].output_text == "\\boxed{7}" for f in forks)


def one_line(code, err, *words):
    assert code == 2, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    for word in words:
        assert word in line, line
    return line


def test_bad_input_is_one_line_and_starts_nothing(tmp_path, tokenizer, scripted_server, capsys, monkeypatch):
    run, tapes = game_run(tmp_path, tokenizer, tapes=1)
    path = run / "tapes" / "iter_000001.jsonl"
    calls = len(tapes[0].llm_calls)
    key = tmp_path / "key"
    key.write_text("secret")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    cases = [
        ([tmp_path / "none.jsonl", "--index", 0, "--at", 0], ["file", "not a file"]),
        ([path, "--index", 1, "--at", 0], ["--index 1", "holds 1 tapes"]),
        ([path, "--index", 0, "--at", calls + 1], [f"--at {calls + 1}", f"made {calls} LLM calls: 0 to {calls - 1}"]),
        # every call replayed, none live: n copies of the tape, refused before a server starts
        ([path, "--index", 0, "--at", calls], [f"--at {calls}", "none sampled live", f"0 to {calls - 1}", "replay"]),
        ([path, "--index", 0, "--at", -1], ["--at -1"]),
        ([path, "--index", 0, "--at", 0, "--n", 0], ["--n 0"]),
        ([path, "--index", 0, "--at", 0, "--temperature", -1], ["--temperature -1"]),
        ([path, "--index", 0, "--at", 0, "--temperature", "nan"], ["--temperature nan"]),
        ([path, "--index", 0, "--at", 0, "--max-tokens", 0], ["--max-tokens 0"]),
        ([path, "--index", 0, "--at", 0, "--n", 100000000], ["--n 100000000", "at most 1024"]),  # started a server
        ([path, "--index", 0, "--at", 0, "--max-tokens", 10**7], ["--max-tokens 10000000", "max_model_len"]),
        ([path, "--index", 0, "--at", 0, "--model", "smollm2", "--url", "http://127.0.0.1:9"], ["--url", "once"]),
        ([path, "--index", 0, "--at", 0, "--key-file", path], ["--key-file", "--url"]),
        ([path, "--index", 0, "--at", 0, "--model", tmp_path / "no-model"], ["--model", "no-model"]),
        ([path, "--index", 0, "--at", 0, "--config", tmp_path / "none.json"], ["--config", "not found"]),
        ([path, "--index", 0, "--at", 0, "--config", path], ["--config", "not a run config"]),
        ([path, "--index", 0, "--at", 0, "--out", path], ["--out", "exists"]),
        ([path, "--index", 0, "--at", 0, "--url", "http://127.0.0.1:9"], ["--key-file", "$VLLM_API_KEY"]),
        ([path, "--index", 0, "--at", 0, "--url", "http://127.0.0.1:9", "--key-file", key], ["--url", "does not answer"]),
        ([path, "--index", 0], ["--at"]),
    ]  # fmt: skip
    for args, words in cases:
        one_line(*command(*args, capsys=capsys)[::2], *words)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not a tape\n")
    one_line(*command(bad, "--index", 0, "--at", 0, "--config", run / "config.json", capsys=capsys)[::2],
             "file", "bad.jsonl:1")  # fmt: skip
    no_env = tmp_path / "no_env.jsonl"
    write_tapes(no_env, [Tape()])
    one_line(*command(no_env, "--index", 0, "--at", 0, "--config", run / "config.json", capsys=capsys)[::2], "--index 0",
             "context.env")  # fmt: skip
    # checkpoints, none with its weights on disk: the policy must be named
    (run / "checkpoints" / "000001").mkdir(parents=True)
    (run / "checkpoints" / "000001" / "learner.json").write_text("{}")
    one_line(*command(path, "--index", 0, "--at", 0, capsys=capsys)[::2], "--model", "in memory")
    assert scripted_server == [] and not (run / "tapes" / "forks").exists()


def test_a_fork_that_does_not_come_back_exits_1_and_writes_nothing(tmp_path, tokenizer, scripted_server, capsys):
    run, tapes = game_run(tmp_path, tokenizer, tapes=1)
    config = json.loads((run / "config.json").read_text())
    config["agent"]["instruction"] = "Think first."
    (run / "config.json").write_text(json.dumps(config))
    code, out, err = command(run / "tapes" / "iter_000001.jsonl", "--index", 0, "--at", 2, capsys=capsys)
    assert code == 1, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: fork at call 2: call #1 prompt differs from the recorded one: message 7 was ")
    assert not (run / "tapes" / "forks").exists()


# -- a real server ------------------------------------------------------------------------------------------


@pytest.mark.vllm
def test_a_fork_sampled_by_a_real_server(tmp_path, tokenizer, policy_server, capsys):
    """Two continuations of a game after its first call, sampled by the embedded model on the session's server
    (by URL, as `orchestrate.serve` lends one)."""
    run, tapes = game_run(tmp_path, tokenizer, tapes=1)
    key = tmp_path / "server.key"
    key.write_text(policy_server.api_key)
    code, out, err = command(run / "tapes" / "iter_000001.jsonl", "--index", 0, "--at", 1, "--n", 2,
                             "--max-tokens", 6, "--url", policy_server.base_url, "--key-file", key, capsys=capsys)  # fmt: skip
    assert code == 0, err
    forks = list(read_tapes(run / "tapes" / "forks" / f"{tapes[0].metadata.id}_at1.jsonl"))
    assert len(forks) == 2
    for fork in forks:
        assert fork.metadata.error is None and fork.metadata.branch_at == 1
        assert fork.llm_calls[0].model_dump(exclude={"turn", "extends_previous"}) == tapes[0].llm_calls[0].model_dump(
            exclude={"turn", "extends_previous"})  # fmt: skip
        live = fork.llm_calls[1:]
        assert live and all(c.output_token_ids and len(c.logprobs) == len(c.output_token_ids) for c in live)
        assert all(c.sampling.max_tokens == 6 and c.model == str(policy_server.model) for c in live)
        assert live[0].prompt_token_ids == tapes[0].llm_calls[1].prompt_token_ids
    assert out.count("\nfork ") == 2
