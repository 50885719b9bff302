"""Roles bound to a model of their own (agent.roles: a model name, folder, run directory or a vLLM server's URL):
frozen, served on a server of their own beside the policy's, asked by their role's calls, recorded as that model
at version 0, never trained; checked before anything starts (a model that cannot be had, another tokenizer, a
URL that does not answer or tokenizes otherwise), counted in the memory plan."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from orchestrate.loop.command_line import resolve
from orchestrate.loop.config_checks import ConfigError, local_role_models, servers_here
from orchestrate.loop.policy import role_models
from orchestrate.serving.recorded import ForkLLM, ReplayLLM
from tests.programs import ScriptedLLM, play
from tests.test_distill import copy_model
from tests.test_roles import asked_models, debate
from tests.test_server_pool import fake_server  # noqa: F401 - a fixture

JUDGE_FROZEN = {"agent.roles": '{"solver": "policy", "judge": "smollm2"}'}


def test_a_role_bound_to_a_model_is_served_apart_and_never_trained():
    config = resolve("solver_judge", JUDGE_FROZEN)
    assert config.trained_roles == ["solver"]  # the learner's train.roles: the judge's samples are dropped
    assert role_models(config) == {"judge": "smollm2"} and role_models(config, urls=True) == {}
    assert local_role_models(config) == ["smollm2"]
    # policy servers elsewhere, the judge's here: a vLLM server still starts on this machine
    assert servers_here(config.model_copy(update={"server": config.server.model_copy(
        update={"policy_urls": ["http://a:1"]})}))  # fmt: skip
    # two roles bound to one model share its server; a URL is a server by URL
    both = resolve("solver_judge", {"agent.roles": '{"solver": "policy", "judge": "smollm2", "critic": "smollm2", '
                                                   '"other": "http://node7:8000"}'})  # fmt: skip
    assert role_models(both) == {"judge": "smollm2"} and role_models(both, urls=True) == {"other": "http://node7:8000"}
    with pytest.raises(ConfigError, match="--train.roles: 'judge' is bound to 'smollm2', which is not trained"):
        resolve("solver_judge", {**JUDGE_FROZEN, "train.roles": "judge"})
    with pytest.raises(ConfigError, match="judge: bound to nothing"):
        resolve("solver_judge", {"agent.roles": '{"solver": "policy", "judge": " "}'})
    with pytest.raises(ConfigError, match="has spaces around it"):
        resolve("solver_judge", {"agent.roles": '{"solver": "policy", "judge": " smollm2"}'})


class WithModels(ScriptedLLM):
    """A client as an agent sees it, with the frozen models roles are bound to (`model_of`)."""

    def __init__(self, tokenizer, replies, models: dict):
        super().__init__(tokenizer, replies)
        self.models = {binding: ScriptedLLM(tokenizer, said) for binding, said in models.items()}

    def model_of(self, binding):
        return self.models[binding]


def test_a_model_bound_role_is_answered_by_its_model_and_replays_and_forks(tokenizer, agent_for):
    agent = agent_for(debate, roles={"solver": "policy", "judge": "smollm2"})
    llm = WithModels(tokenizer, ["s1", "s2"], {"smollm2": ["j1", "j2"]})
    tape = play(agent, llm)
    assert tape.metadata.error is None, tape.metadata.error
    assert [(c.role, c.output_text) for c in tape.llm_calls] == [("solver", "s1"), ("judge", "j1"),
                                                                 ("solver", "s2"), ("judge", "j2")]  # fmt: skip
    assert len(llm.prompts) == 2 and len(llm.models["smollm2"].prompts) == 2
    again = play(agent, ReplayLLM(tape, strict=True))  # a replay answers every role from the tape
    assert [c.output_text for c in again.llm_calls] == ["s1", "j1", "s2", "j2"]
    # a fork at the judge's second call: the first three replayed, the judge's then asked of its model, live
    live = WithModels(tokenizer, [], {"smollm2": ["J2"]})
    forked = play(agent, ForkLLM(tape, 3, live))
    assert [c.output_text for c in forked.llm_calls] == ["s1", "j1", "s2", "J2"]
    assert live.prompts == [] and len(live.models["smollm2"].prompts) == 1


def test_the_client_asks_a_frozen_model_on_its_own_server_recorded_as_version_0():
    from orchestrate.serving.llm import VLLMClient
    from tapes.tape import SamplingParams
    from tests.test_agents import Endpoint

    asked, closed = [], []
    transport = httpx.MockTransport(asked_models(asked))
    server = Endpoint("judge")
    server.served_model_name = "role-judge"
    judge = VLLMClient([server], transport=transport, model="smollm2")

    async def go():
        client = VLLMClient([Endpoint("policy")], transport=transport, policy_version=4, model="m",
                            models={"smollm2": judge})  # fmt: skip
        policy = await client.complete_ids([1], SamplingParams())
        frozen = await client.model_of("smollm2").complete_ids([1], SamplingParams())
        judge.pool.aclose = lambda: closed.append("judge") or asyncio.sleep(0)
        await client.aclose()  # its models' clients with it
        return client, policy, frozen

    client, policy, frozen = asyncio.run(go())
    assert asked == ["policy", "role-judge"]
    assert (policy.model, policy.policy_version) == ("m", 4) and (frozen.model, frozen.policy_version) == ("smollm2", 0)
    assert closed == ["judge"]
    with pytest.raises(ValueError, match="no server of 'qwen' was started beside this client's"):
        client.model_of("qwen")


# -- checked before anything starts ---------------------------------------------------------------


def refused(rl_cli, tmp_path, policy, judge, words):
    run_dir = tmp_path / "run"
    roles = json.dumps({"solver": "policy", "judge": str(judge)})
    code, line = rl_cli(["--preset", "solver_judge", "--run-dir", run_dir, "--model.policy", policy,
                         "--agent.roles", roles])  # fmt: skip
    assert code == 2, line
    assert all(w in line for w in words), line
    assert not run_dir.exists()


def test_a_model_that_cannot_be_had_or_tokenizes_otherwise_is_refused(tmp_path, rl_cli, tiny_model_dir):
    from transformers import AutoTokenizer

    refused(rl_cli, tmp_path, tiny_model_dir, "polcy", ["--agent.roles judge", "'polcy'",
                                                        "or bind the role to one of policy, base, adapter"])  # fmt: skip
    refused(rl_cli, tmp_path, tiny_model_dir, tmp_path / "gone", ["--agent.roles judge"])
    other = copy_model(tiny_model_dir, tmp_path / "other")
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    refused(rl_cli, tmp_path, tiny_model_dir, other, ["--agent.roles judge", "the model", "another vocabulary"])


def test_a_role_server_by_url_is_checked(tmp_path, rl_cli, tiny_model_dir, fake_server, monkeypatch):  # noqa: F811
    """It answers, with its key, and tokenizes a chat into the policy's ids."""
    from transformers import AutoTokenizer

    from orchestrate.loop.preflight import PreflightError, check_role_server

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    url = fake_server(model="judge-model", key="k", tokenizer=tok)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    refused(rl_cli, tmp_path, tiny_model_dir, url, ["--agent.roles judge", "API key"])
    monkeypatch.setenv("VLLM_API_KEY", "k")
    refused(rl_cli, tmp_path, tiny_model_dir, "http://127.0.0.1:9", ["--agent.roles judge", "does not say which model"])
    assert check_role_server(url, tiny_model_dir, "tiny", "--agent.roles judge", "k") == "judge-model"
    with pytest.raises(PreflightError, match="--agent.roles judge: .* does not say which model"):
        check_role_server(url, tiny_model_dir, "tiny", "--agent.roles judge", "wrong key")
    other = fake_server(model="judge-model", key="k", tokenizer=tok, shift=1)
    with pytest.raises(PreflightError, match=r"--agent.roles judge: .* \(judge-model\) tokenizes a chat otherwise"):
        check_role_server(other, tiny_model_dir, "tiny", "--agent.roles judge", "k")
    refused(rl_cli, tmp_path, tiny_model_dir, other, ["--agent.roles judge", "tokenizes a chat otherwise"])


def test_the_memory_plan_counts_a_server_for_each_model_a_role_is_bound_to():
    from orchestrate.loop.memory_plan import MemoryPlanError, Shape, check_cpu, cpu_plan, cpu_server_gib

    config = resolve("solver_judge", JUDGE_FROZEN)
    shape = Shape(parameters=135_000_000, layers=30, hidden=576, intermediate=1536)
    alone, with_judge = cpu_plan(config, shape), cpu_plan(config, shape, roles=[shape])
    assert with_judge["servers"] - alone["servers"] == pytest.approx(cpu_server_gib(shape, config.server.kv_cache_gib))
    big = Shape(parameters=7_000_000_000, layers=28, hidden=3584, intermediate=18944)
    with pytest.raises(MemoryPlanError, match="^--agent.roles: .* the servers of the models roles are bound to"):
        check_cpu(config, shape, 24.0, roles=[big])
