"""Roles: several agents in one episode (agent.roles), each the `model` name a program sends through the gateway:
each role's conversation extends its own calls, each call records its role, rewards go to a role's turns, the
samples of a role are credited apart (returns and advantage groups per role), and --train.roles trains some."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from agents.agent import role_rewards, turn_rewards
from contract.batch import Sample, credit_ids
from finetune.batch_advantages import batch_advantages, keep_roles
from finetune.config import TrainConfig
from finetune.estimators import turn_advantages
from orchestrate.loop.command_line import resolve
from orchestrate.loop.config_checks import ConfigError
from orchestrate.loop.metrics import rollout_metrics
from orchestrate.loop.samples import tape_samples
from orchestrate.serving.recorded import ReplayLLM
from tests.programs import ScriptedLLM, WithBase, answer_of, play

ROLES = ("solver", "judge")


def two_roles_agent(agent_for, program):
    return agent_for(program, roles=ROLES)


async def debate(task, client):
    """Each role talks twice, interleaved: solver, judge, solver, judge."""
    chats = {role: [{"role": "user", "content": f"{task.observation} ({role})"}] for role in ROLES}
    for _ in range(2):
        for role in ROLES:
            reply = await client.chat.completions.create(model=role, messages=chats[role])
            assert reply.model == role  # the reply names the role asked for
            chats[role] += [{"role": "assistant", "content": reply.choices[0].message.content},
                            {"role": "user", "content": "Again."}]  # fmt: skip
    return {"solver": 1.0, "judge": 0.25}


def test_each_roles_calls_extend_its_own_conversation_and_record_the_role(tokenizer, agent_for):
    llm = ScriptedLLM(tokenizer, ["s1", "j1", "s2", "j2"])
    tape = play(two_roles_agent(agent_for, debate), llm)
    assert tape.metadata.error is None, tape.metadata.error
    calls = tape.llm_calls
    assert [c.role for c in calls] == ["solver", "judge", "solver", "judge"]
    assert [c.turn for c in calls] == [1, 2, 3, 4]
    # each role's second call extends that role's first (not the other role's call in between)
    assert [c.extends_previous for c in calls] == [None, None, True, True]
    for first, second in ((calls[0], calls[2]), (calls[1], calls[3])):
        assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(first.output_token_ids)] == (
            first.prompt_token_ids + first.output_token_ids
        )
    # the rewards the program returned by role, each on its role's last turn
    assert turn_rewards(tape) == [0.0, 0.0, 1.0, 0.25]
    assert role_rewards(tape) == {"solver": 1.0, "judge": 0.25}
    metrics = rollout_metrics([tape])
    assert metrics["reward_mean_solver"] == 1.0 and metrics["success_rate_judge"] == 1.0
    # one sample per role, its own turns only, credited as its own
    samples = tape_samples(tape, require_ref=False)
    assert [s["role"] for s in samples] == ["solver", "judge"]
    assert [[t["index"] for t in s["turns"]] for s in samples] == [[0, 2], [1, 3]]
    assert [s["reward"] for s in samples] == [1.0, 0.25]
    assert len({s["sample_id"] for s in samples}) == 2
    solver = samples[0]
    assert solver["prompt_ids"] == calls[0].prompt_token_ids
    assert solver["behaviour_logprobs"] == calls[0].logprobs + calls[2].logprobs


def test_an_episode_with_roles_replays_to_the_same_tape(tokenizer, agent_for):
    agent = two_roles_agent(agent_for, debate)
    tape = play(agent, ScriptedLLM(tokenizer, ["s1", "j1", "s2", "j2"]))
    again = play(agent, ReplayLLM(tape, strict=True))
    assert again.metadata.error is None, again.metadata.error
    assert [(c.role, c.prompt_token_ids) for c in again.llm_calls] == [
        (c.role, c.prompt_token_ids) for c in tape.llm_calls
    ]
    assert role_rewards(again) == role_rewards(tape)


def test_show_names_each_turns_role_and_the_learners_turns_of_every_role_are_found(tokenizer, agent_for):
    from orchestrate.after.episode_view import learner_turns
    from orchestrate.after.show import render

    tape = play(two_roles_agent(agent_for, debate), ScriptedLLM(tokenizer, ["s1", "j1", "s2", "j2"]))
    text = render(tape)
    heads = [line.split(" turn ")[0] for line in text.splitlines() if line.startswith("[") and " turn " in line]
    assert [h for h in heads if h != "[environment] answer to"] == ["[solver]", "[judge]", "[solver]", "[judge]"]
    samples = tape_samples(tape, require_ref=False)
    advantages = {s["sample_id"]: [{"index": t["index"], "advantage": 1.0} for t in s["turns"]] for s in samples}
    assert [t["index"] for t in learner_turns(advantages, tape.metadata.id)] == [0, 1, 2, 3]
    assert learner_turns(advantages, "another") is None


def test_evaluation_gives_each_roles_figures(tokenizer, agent_for):
    from orchestrate.loop.evaluation import task_results

    tape = play(two_roles_agent(agent_for, debate), ScriptedLLM(tokenizer, ["s1", "j1", "s2", "j2"]))
    (solver,) = task_results([tape], role="solver")
    (judge,) = task_results([tape, tape], role="judge")
    assert solver.rewards == [1.0] and solver.successes == [True] and solver.answers == [None]
    assert judge.rewards == [0.25, 0.25] and judge.n == 2
    assert task_results([tape], role="critic")[0].successes == [False]  # a role that made no call: 0


def test_a_model_name_that_is_not_a_role_is_a_404_in_each_protocols_shape(tokenizer, agent_for):
    seen = {}

    async def program(task, client):
        assert task.model == "solver" and task.roles == list(ROLES)
        headers = {"Authorization": f"Bearer {task.api_key}"}
        async with httpx.AsyncClient() as http:
            models = await http.get(task.base_url + "/models", headers=headers)
            seen["models"] = [m["id"] for m in models.json()["data"]]
            for name, (path, body) in {
                "chat": ("/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "A"}]}),
                "responses": ("/responses", {"model": "critic", "input": "A"}),
                "messages": ("/messages", {"model": "critic", "max_tokens": 8, "messages": [{"role": "user", "content": "A"}]}),
            }.items():  # fmt: skip
                response = await http.post(task.base_url + path, headers=headers, json=body)
                seen[name] = (response.status_code, response.json())
        return 1.0

    tape = play(two_roles_agent(agent_for, program), ScriptedLLM(tokenizer, []))
    assert seen["models"] == list(ROLES)
    for name in ("chat", "responses", "messages"):
        status, body = seen[name]
        assert status == 404, (name, body)
        assert "the run's roles are 'solver' or 'judge'" in body["error"]["message"]
    assert seen["messages"][1]["type"] == "error" and seen["messages"][1]["error"]["type"] == "not_found_error"
    assert "HTTP 404" in tape.metadata.error  # the program's fault: left out of training, the run goes on


def test_rewards_by_role_go_to_that_roles_turns_and_bad_ones_are_the_programs_fault(tokenizer, agent_for):
    async def judged(task, client):
        for role in ROLES:
            await client.chat.completions.create(model=role, messages=[{"role": "user", "content": role}])
        task.reward(0.5, role="solver")  # the solver's latest turn, though the judge called last
        task.reward(1.0)  # no role: the latest call's turn
        return None

    tape = play(two_roles_agent(agent_for, judged), ScriptedLLM(tokenizer, ["a", "b"]))
    assert tape.metadata.error is None and turn_rewards(tape) == [0.5, 1.0]
    assert role_rewards(tape) == {"solver": 0.5, "judge": 1.0}

    async def team(task, client):
        for role in ROLES:
            await client.chat.completions.create(model=role, messages=[{"role": "user", "content": role}])
        return 1.0  # a number: every role's reward

    tape = play(two_roles_agent(agent_for, team), ScriptedLLM(tokenizer, ["a", "b"]))
    assert role_rewards(tape) == {"solver": 1.0, "judge": 1.0} and tape.metadata.terminated

    async def scored_after(task, client):
        for role in ROLES:
            await client.chat.completions.create(model=role, messages=[{"role": "user", "content": role}])

    agent = agent_for(scored_after, roles=ROLES, reward=lambda tape: 0.5)  # --program.reward: every role's too
    assert role_rewards(play(agent, ScriptedLLM(tokenizer, ["a", "b"]))) == {"solver": 0.5, "judge": 0.5}

    async def silent_judge(task, client):
        await client.chat.completions.create(model="solver", messages=[{"role": "user", "content": "A"}])
        return {"solver": 1.0, "judge": 0.0}

    tape = play(two_roles_agent(agent_for, silent_judge), ScriptedLLM(tokenizer, ["a"]))
    assert "role 'judge', which made no call" in tape.metadata.error
    assert tape_samples(tape, require_ref=False) == []

    async def stranger(task, client):
        await client.chat.completions.create(model="solver", messages=[{"role": "user", "content": "A"}])
        return {"critic": 1.0}

    tape = play(two_roles_agent(agent_for, stranger), ScriptedLLM(tokenizer, ["a"]))
    assert "'critic', which is not a role of this run" in tape.metadata.error

    async def early(task, client):
        task.reward(1.0, role="judge")

    tape = play(two_roles_agent(agent_for, early), ScriptedLLM(tokenizer, []))
    assert "role 'judge' has made no call yet" in tape.metadata.error


def test_the_shipped_solver_and_judge_are_rewarded_apart(tokenizer, agent_for):
    a, b, product = answer_of()
    llm = ScriptedLLM(tokenizer, [f"\\boxed{{{product + 1}}}", "That is right: \\boxed{yes}"])
    tape = play(two_roles_agent(agent_for, "agents.programs.solver_judge:play"), llm)
    assert tape.metadata.error is None, tape.metadata.error
    assert role_rewards(tape) == {"solver": 0.0, "judge": 0.0}  # a wrong answer, judged right: both wrong
    llm = ScriptedLLM(tokenizer, [f"\\boxed{{{product + 1}}}", "\\boxed{no}"])
    tape = play(two_roles_agent(agent_for, "agents.programs.solver_judge:play"), llm)
    assert role_rewards(tape) == {"solver": 0.0, "judge": 1.0}
    assert f"Proposed answer: \\boxed{{{product + 1}}}" in tape.llm_calls[1].prompt_text


def sample(group, episode, role, reward, index=0):
    return Sample(prompt_ids=[1], completion_ids=[2], behaviour_logprobs=[-1.0], reward=reward, group_id=group,
                  episode_id=episode, role=role, turns=[{"index": index, "start": 0, "length": 1, "reward": reward}])  # fmt: skip


def test_advantages_are_grouped_by_task_and_role():
    # one task, two episodes, two roles: the solver succeeds in e1, the judge (its rewards 10x) in e2
    samples = [sample("g", "e1", "solver", 1.0), sample("g", "e1", "judge", 0.0, 1),
               sample("g", "e2", "solver", 0.0), sample("g", "e2", "judge", 10.0, 1)]  # fmt: skip
    episodes, groups = credit_ids(samples)
    assert episodes == ["e1/solver", "e1/judge", "e2/solver", "e2/judge"] and groups[0] == "g/solver"
    advantages = batch_advantages(samples, TrainConfig(), None, None).per_token  # the learner's, per token
    assert [round(float(a[0]), 3) for a in advantages] == [0.707, -0.707, -0.707, 0.707]
    # credited as one agent, the judge's reward would swamp the solver's: its success would look like a failure
    turns = [[(t.index, t.reward) for t in s.all_turns] for s in samples]
    _, mixed = turn_advantages(turns, ["e1", "e1", "e2", "e2"], ["g"] * 4, "group")
    assert mixed[0][0] < 0


def test_train_roles_keeps_the_named_roles_samples_only():
    samples = [sample("g", "e1", "solver", 1.0), sample("g", "e1", "judge", 1.0, 1)]
    kept, stats = keep_roles(samples, ["judge"])
    assert [s.role for s in kept] == ["judge"] and stats == {"role_dropped": 1}
    assert keep_roles(samples, None) == (samples, {})
    assert TrainConfig(roles="solver, judge").roles == ["solver", "judge"]
    assert TrainConfig(roles='["solver", "judge"]').roles == ["solver", "judge"]
    with pytest.raises(ValueError, match="none empty"):
        TrainConfig(roles="solver,")


def test_a_fork_of_an_episode_with_roles_is_refused_in_the_batch():
    with pytest.raises(ValueError, match="a fork's samples carry no role"):
        Sample(prompt_ids=[1], completion_ids=[2], behaviour_logprobs=[-1.0], reward=1.0, group_id="g", role="solver",
               turns=[{"index": 1, "start": 0, "length": 1, "reward": 1.0}],
               branch={"parent_id": "p", "turn": 1, "prefix_rewards": [0.0]})  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"agent.roles": '{"solver": "policy", "judge": ""}'}, "--agent.roles: judge: bound to nothing"),
        ({"agent.roles": '{"solver": "policy ", "judge": "policy"}'}, "'policy ' has spaces around it; one of: policy"),
        ({"agent.roles": '{"the solver": "policy"}'}, "is not a role name"),
        ({"train.roles": "critic"}, "--train.roles: 'critic' is not a role of this run; its roles are solver, judge"),
        ({"tree.width": "2"}, "--tree.width: tree rollouts of episodes with several roles"),
        ({"train.algorithm": "dapo"}, "--rollouts.dynamic_sampling"),
    ],
)
def test_bad_roles_are_refused_naming_the_option(overrides, message):
    with pytest.raises(ConfigError, match=None) as caught:
        resolve("solver_judge", overrides)
    assert message in str(caught.value)


def test_a_programs_declared_roles_must_be_bound_and_train_roles_need_roles():
    with pytest.raises(ConfigError, match="calls the roles solver, judge; 'judge' is not bound"):
        resolve("solver_judge", {"agent.roles": '{"solver": "policy"}'})
    with pytest.raises(ConfigError, match="it has no roles"):
        resolve("embedded", {"train.roles": "solver"})
    config = resolve("solver_judge", {"train.roles": "judge"})
    assert config.agent.roles == {"solver": "policy", "judge": "policy"} and config.train.roles == ["judge"]


def test_a_harness_is_told_the_roles(tmp_path):
    from agents.harness import harness_environment

    env = harness_environment("http://x/v1", "k", "solver", tmp_path, ["solver", "judge"])
    assert env["TAPELOOP_ROLES"] == "solver,judge" and env["TAPELOOP_MODEL"] == "solver"
    assert "TAPELOOP_ROLES" not in harness_environment("http://x/v1", "k", "policy", tmp_path)


def test_a_program_in_its_own_process_gives_rewards_by_role(tokenizer, agent_for):
    agent = agent_for("tests.programs:two_roles", roles=ROLES, isolation="process")
    tape = play(agent, ScriptedLLM(tokenizer, ["a", "b"]))
    assert tape.metadata.error is None, tape.metadata.error
    assert role_rewards(tape) == {"solver": 0.75, "judge": 0.5}
    assert json.loads(json.dumps(tape.model_dump(mode="json")))["llm_calls"][1]["role"] == "judge"


def test_a_role_bound_to_base_is_answered_by_the_base_model_and_not_trained(tokenizer, agent_for):
    agent = agent_for(debate, roles={"solver": "policy", "judge": "base"})
    llm = WithBase(tokenizer, ["s1", "s2"], ["j1", "j2"])
    tape = play(agent, llm)
    assert tape.metadata.error is None, tape.metadata.error
    assert [(c.role, c.output_text) for c in tape.llm_calls] == [("solver", "s1"), ("judge", "j1"),
                                                                 ("solver", "s2"), ("judge", "j2")]  # fmt: skip
    assert len(llm.prompts) == 2 and len(llm.base.prompts) == 2
    # a replay answers every role from the tape
    again = play(agent, ReplayLLM(tape, strict=True))
    assert [c.output_text for c in again.llm_calls] == ["s1", "j1", "s2", "j2"]
    config = resolve("solver_judge", {"agent.roles": '{"solver": "policy", "judge": "base"}', "train.lora.rank": "8"})
    assert config.trained_roles == ["solver"]  # the learner's train.roles: the judge's samples are dropped
    assert resolve("solver_judge", {}).trained_roles is None


def asked_models(asked: list):
    """A mock vLLM completions handler that records each request's `model` and answers one token."""

    def handler(request):
        asked.append(json.loads(request.content).get("model"))
        body = {"choices": [{"text": "x", "finish_reason": "stop",
                             "logprobs": {"tokens": ["token_id:7"], "token_logprobs": [-0.5]}}]}  # fmt: skip
        return httpx.Response(200, json=body)

    return handler


def test_the_client_serves_the_base_model_without_the_adapter_as_version_0():
    from orchestrate.serving.llm import VLLMClient
    from tapes.tape import SamplingParams
    from tests.test_agents import Endpoint

    asked = []
    handler = asked_models(asked)

    async def go():
        client = VLLMClient([Endpoint("a")], transport=httpx.MockTransport(handler), policy_version=3,
                            adapter=lambda v: f"policy-v{v}")  # fmt: skip
        policy = await client.complete_ids([1], SamplingParams())
        base = await client.base_model().complete_ids([1], SamplingParams())
        return policy, base

    policy, base = asyncio.run(go())
    assert asked == ["policy-v3", "policy"]  # the base: the server's own name, no adapter
    assert (policy.policy_version, base.policy_version) == (3, 0)
    plain = VLLMClient([Endpoint("a")])  # version 0 without adapters (eval's of a LoRA run's version 0): the base
    assert plain.base_model() is plain
    with pytest.raises(ValueError, match="serves version 2's own weights"):
        VLLMClient([Endpoint("a")], policy_version=2).base_model()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"agent.roles": '{"solver": "policy", "judge": "base"}'}, "'judge' is bound to 'base'"),
        ({"agent.roles": '{"solver": "base", "judge": "base"}', "train.lora.rank": "8"},
         "no role is bound to 'policy' or 'adapter'"),
        ({"agent.roles": '{"solver": "policy", "judge": "base"}', "train.lora.rank": "8", "train.roles": "judge"},
         "--train.roles: 'judge' is bound to 'base', which is not trained"),
        ({"agent.roles": '{"solver": "adapter", "judge": "policy"}'}, "'solver' is bound to 'adapter'"),
        ({"agent.roles": '{"solver": "adapter", "judge": "policy"}', "train.lora.rank": "8",
          "train.lora.roles": "judge"}, "--train.lora.roles: the roles with an adapter of their own"),
        ({"agent.roles": '{"solver": "adapter", "judge": "bogus"}', "train.lora.rank": "8", "train.roles": "judge"},
         "'judge' is bound to 'bogus', which is not trained"),
    ],
)  # fmt: skip
def test_bad_bindings_are_refused(overrides, message):
    with pytest.raises(ConfigError) as caught:
        resolve("solver_judge", overrides)
    assert message in str(caught.value)


def test_the_built_in_agent_takes_roles_for_the_agents_of_a_multi_agent_environment():
    config = resolve("hide_and_guess", {})
    assert config.agent.roles == {"hider": "adapter", "guesser": "adapter"} and config.agent.program is None
    assert config.adapter_roles == ["hider", "guesser"] and set(config.agent.role_examples) == {"hider", "guesser"}
    with pytest.raises(ConfigError, match="--agent.role_examples: the multi-agent agent's worked examples"):
        resolve("solver_judge", {"agent.role_examples": '{"solver": []}'})
    with pytest.raises(ConfigError, match="agents are hider, guesser; bind each of them and nothing else"):
        resolve("hide_and_guess", {"agent.roles": '{"hider": "policy"}'})
    with pytest.raises(ConfigError, match="math:arithmetic is an environment of one agent"):
        resolve("embedded", {"agent.roles": '{"hider": "policy"}'})
    with pytest.raises(ConfigError, match="is an environment of several agents; bind each"):
        resolve("hide_and_guess", {"agent.roles": "{}"})
    with pytest.raises(ConfigError, match="--agent.program: game:hide_and_guess is an environment of several agents"):
        resolve("hide_and_guess", {"agent.program": "agents.programs.openai_tools:play"})


def test_an_episodes_success_is_the_environments_verdict_not_a_later_roles_reward(tokenizer, agent_for):
    """The solver right, its judge wrong (a reward after the environment's step): the episode is solved."""
    a, b, product = answer_of()
    agent = agent_for("agents.programs.solver_judge:play", roles=ROLES)
    tape = play(agent, ScriptedLLM(tokenizer, [f"\\boxed{{{product}}}", "\\boxed{no}"]))
    assert tape.metadata.error is None, tape.metadata.error
    assert role_rewards(tape) == {"solver": 1.0, "judge": 0.0}
    assert tape.metadata.success is True  # the last reward (the judge's, 0) does not decide it
    tape = play(agent, ScriptedLLM(tokenizer, [f"\\boxed{{{product + 1}}}", "\\boxed{no}"]))
    assert role_rewards(tape) == {"solver": 0.0, "judge": 1.0} and tape.metadata.success is False
