"""Replay (`python -m orchestrate.after.replay`): every episode of a real run, played again against a fresh
environment with the recorded LLM outputs, comes back the same; a changed agent, prompt or environment
is reported at the first step that differs."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from agents.agent import AgentConfig, ChatAgent
from agents.chat import ChatTokens
from agents.env_spec import EnvSpec
from orchestrate.after.replay import replay_tape
from orchestrate.loop.rollouts import RolloutContext, run_rollouts
from orchestrate.loop.setup import agent_from_run_config
from tapes.store import read_tapes, write_tapes
from tapes.tape import SamplingParams
from tests.scripted import scripted_call

vllm = pytest.mark.vllm  # these use the tapes of the real run made by the `tiny_run` fixture


class ScriptedLLM:
    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts = tokenizer, list(texts)

    async def complete_ids(self, prompt_ids, sampling, *, messages=None, prompt_text=""):
        text = self.texts.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return scripted_call(text, ids, prompt_ids, sampling, messages=messages, prompt_text=prompt_text, logprob=-0.1)


def game_agent(tokenizer, instruction=""):
    return ChatAgent(
        AgentConfig(max_turns=6, instruction=instruction),
        SamplingParams(temperature=0.7, max_tokens=16),
        ChatTokens(tokenizer),
    )


def test_multi_turn_replay_and_diff_without_servers(tokenizer):
    """Scripted games: identical replays; a changed prompt, a changed environment, a shorter episode named."""
    spec = EnvSpec("game:guess_the_number", {"low": 1, "high": 10, "max_turns": 4}, "train", 0)
    guesses = [
        "\\boxed{5}",
        "\\boxed{3}",
        "\\boxed{8}",
        "\\boxed{1}",
        "\\boxed{2}",
        "\\boxed{9}",
        "\\boxed{10}",
        "\\boxed{4}",
    ]
    tapes = asyncio.run(
        run_rollouts(
            RolloutContext(game_agent(tokenizer), spec, ScriptedLLM(tokenizer, guesses), iteration=1, policy_version=0),
            [0, 1],
            1,
            progress=False,
        )
    )
    assert max(t.metadata.turns for t in tapes) > 1
    for tape in tapes:
        replayed, diff = asyncio.run(replay_tape(tape, game_agent(tokenizer)))
        assert diff.identical, diff.report()
        assert replayed.metadata.reward == tape.metadata.reward and replayed.metadata.parent_id == tape.metadata.id
        assert [c.prompt_token_ids for c in replayed.llm_calls] == [c.prompt_token_ids for c in tape.llm_calls]

    long = max(tapes, key=lambda t: t.metadata.turns)
    # a changed instruction: the first prompt differs (named, with the token), the recorded answers go on
    _, diff = asyncio.run(replay_tape(long, game_agent(tokenizer, instruction="Be quick.")))
    assert any("call #1 prompt differs" in note and "token " in note for note in diff.notes), diff.notes
    # a changed environment (another range): its first observation differs, step 1
    other = long.model_copy(deep=True)
    other.context["env"]["options"]["high"] = 20
    _, diff = asyncio.run(replay_tape(other, game_agent(tokenizer)))
    assert diff.steps[0].index == 0 and "text" in diff.steps[0].fields
    # a tape whose recorded answer now wins sooner: the replay stops early and says so
    edited = long.model_copy(deep=True)
    seed = edited.context["env"]["seed"]
    answer = None
    for n in range(1, 11):
        probe = spec.make()
        probe.reset(seed)
        if probe.step(f"\\boxed{{{n}}}")[1] == 1.0:
            answer = n
            break
    edited.llm_calls[0].output_text = f"\\boxed{{{answer}}}"
    edited.steps[1].text = edited.llm_calls[0].output_text
    _, diff = asyncio.run(replay_tape(edited, game_agent(tokenizer)))
    assert not diff.identical and diff.steps[0].index == 2 and "terminated" in diff.steps[0].fields
    assert any("the agent made 1 calls" in note for note in diff.notes)


@vllm
def test_every_tape_of_a_run_replays_identically(tiny_run):
    agent = agent_from_run_config(tiny_run / "config.json")
    files = sorted((tiny_run / "tapes").glob("*.jsonl"))
    assert [f.name for f in files] == [
        "eval_000000.jsonl",
        "eval_000002.jsonl",
        "iter_000001.jsonl",
        "iter_000002.jsonl",
    ]
    count = 0
    for path in files:
        for tape in read_tapes(path):
            replayed, diff = asyncio.run(replay_tape(tape, agent))
            assert diff.identical, diff.report()
            assert [s.kind for s in replayed.steps] == [s.kind for s in tape.steps]
            assert replayed.metadata.reward == tape.metadata.reward
            assert replayed.metadata.reward_reason == tape.metadata.reward_reason
            assert [c.output_token_ids for c in replayed.llm_calls] == [c.output_token_ids for c in tape.llm_calls]
            count += 1
    assert count == 24

    out = subprocess.run([sys.executable, "-m", "orchestrate.after.replay", *map(str, files), "--quiet"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("24 tapes replayed: 24 identical, 0 differ")


@vllm
def test_replay_command_names_the_first_differing_step(tiny_run, tmp_path):
    """A tape whose recorded output is edited to hold the right \\boxed{} answer (as if the model had said
    it) gets another reward from the environment: reported step by step, exit status 1."""
    (tmp_path / "tapes").mkdir()
    (tmp_path / "config.json").write_text((tiny_run / "config.json").read_text())
    tapes = list(read_tapes(tiny_run / "tapes" / "iter_000001.jsonl"))[:3]
    spec, seed = EnvSpec.of(tapes[1])
    _, info = spec.make().reset(seed)
    tapes[1].llm_calls[0].output_text = f"so \\boxed{{{info['answer']}}}"
    tapes[1].llm_calls[0].finish_reason = "stop"
    path = write_tapes(tmp_path / "tapes" / "iter_000001.jsonl", tapes)

    out = subprocess.run([sys.executable, "-m", "orchestrate.after.replay", str(path)], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert sum("identical" in line and "differs" not in line for line in lines[:-1]) == 2
    i = next(i for i, line in enumerate(lines) if f"tape {tapes[1].metadata.id}: differs" in line)
    assert lines[i + 1].startswith("  step 2 (env_action) differs in text")
    assert f"reward: recorded {tapes[1].metadata.reward}, replayed 1.0" in out.stdout
    assert lines[-1] == "3 tapes replayed: 2 identical, 1 differ"

    out = subprocess.run([sys.executable, "-m", "orchestrate.after.replay", str(path), "--index", "9"],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and "--index 9" in out.stderr


def test_the_command_replays_each_file_with_its_own_runs_config_forks_included(tmp_path, tokenizer, capsys):
    """Files of two runs (another instruction each) in one command: each replayed with its own run's agent, so
    both come back identical; a fork's file (RUN/tapes/forks/) finds its run's config; --config for files of
    several runs is refused in one line."""
    import shutil

    from orchestrate.after import replay
    from tests.test_fork import game_run

    def command(*args):
        try:
            code = replay.main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code
        out = capsys.readouterr()
        return code, out.out, out.err

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    run_a, _ = game_run(tmp_path / "a", tokenizer, ("agent.instruction", "Guess."), tapes=1)
    run_b, _ = game_run(tmp_path / "b", tokenizer, ("agent.instruction", "Guess well, in few turns."), tapes=1)
    a, b = (run / "tapes" / "iter_000001.jsonl" for run in (run_a, run_b))
    fork_file = run_b / "tapes" / "forks" / "x_at1.jsonl"
    fork_file.parent.mkdir()
    shutil.copy(b, fork_file)
    code, out, err = command(a, b, fork_file)
    assert code == 0, out + err
    assert out.strip().endswith("3 tapes replayed: 3 identical, 0 differ"), out
    code, out, err = command(a, b, "--config", run_a / "config.json")
    assert code == 2 and "error: --config: the files are of 2 runs" in err.strip().splitlines()[-1], err
    code, out, err = command(b, "--config", run_a / "config.json")  # one run's file, another's config: it differs
    assert code == 1 and "0 identical, 1 differ" in out
