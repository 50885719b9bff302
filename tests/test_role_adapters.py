"""Roles with a LoRA adapter of their own (agent.roles bound to `adapter`): the role's calls go to its adapter
(policy-ROLE-vN), its samples train that adapter alone in the learner, which publishes it beside the policy's
(adapter/ROLE/, peft's layout), and vLLM's CPU LoRA ops give a request without an adapter no adapter's update
whatever the slots hold."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from finetune.config import TrainConfig
from orchestrate.loop.command_line import resolve
from orchestrate.serving.recorded import ReplayLLM
from tests.programs import WithBase, play
from tests.test_roles import asked_models, debate


def test_a_role_bound_to_adapter_is_answered_by_its_own_and_trained_with_its_own_adapter(tokenizer, agent_for):
    agent = agent_for(debate, roles={"solver": "adapter", "judge": "policy"})
    llm = WithBase(tokenizer, ["j1", "j2"], [], {"solver": ["s1", "s2"]})
    tape = play(agent, llm)
    assert tape.metadata.error is None, tape.metadata.error
    assert [(c.role, c.output_text) for c in tape.llm_calls] == [("solver", "s1"), ("judge", "j1"),
                                                                 ("solver", "s2"), ("judge", "j2")]  # fmt: skip
    assert len(llm.own["solver"].prompts) == 2 and len(llm.prompts) == 2
    again = play(agent, ReplayLLM(tape, strict=True))  # a replay answers every role from the tape
    assert [c.output_text for c in again.llm_calls] == ["s1", "j1", "s2", "j2"]
    config = resolve("solver_judge", {"agent.roles": '{"solver": "adapter", "judge": "adapter"}',
                                      "train.lora.rank": "8"})  # fmt: skip
    assert config.adapter_roles == ["solver", "judge"] and config.trained_roles is None  # both trained
    mixed = resolve("solver_judge", {"agent.roles": '{"solver": "adapter", "judge": "base"}', "train.lora.rank": "8"})
    assert mixed.trained_roles == ["solver"] and mixed.adapter_roles == ["solver"]


def test_the_client_asks_for_a_roles_own_adapter_by_its_name():
    from orchestrate.serving.llm import VLLMClient
    from orchestrate.serving.vllm_server import adapter_name
    from tapes.tape import SamplingParams
    from tests.test_agents import Endpoint

    asked = []
    handler = asked_models(asked)

    def names(v, role=None):
        return adapter_name("policy", v, role) if v else None

    async def go(version):
        client = VLLMClient([Endpoint("a")], transport=httpx.MockTransport(handler), policy_version=version,
                            adapter=names)  # fmt: skip
        own = await client.role_model("solver").complete_ids([1], SamplingParams())
        policy = await client.complete_ids([1], SamplingParams())
        return own, policy

    own, policy = asyncio.run(go(3))
    assert asked == ["policy-solver-v3", "policy-v3"]
    assert own.policy_version == policy.policy_version == 3 and own.model.endswith("adapter policy-solver-v3")
    asked.clear()
    asyncio.run(go(0))  # version 0: every adapter is the base model (its B matrices are zero)
    assert asked == ["policy", "policy"]


def test_a_roles_samples_train_its_own_adapter_which_is_published_beside_the_policys(tiny_model_dir, tmp_path):
    """Samples of a role with its own adapter move that adapter alone, the others' samples the policy's; the
    adapter folder holds each role's (peft's layout), which peft loads on the base and scores as the learner
    scores that role's samples; the trainer state keeps every adapter (a resumed learner scores the same)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from contract.rundir import role_adapters
    from finetune.learner import Learner
    from tests.test_finetune_learner import BAD, GOOD, OTHER, group, with_behaviour

    cfg = TrainConfig(lr=1e-2, lora={"rank": 2, "roles": "solver,ju.dge"})
    learner = Learner(tiny_model_dir, cfg)
    batch = with_behaviour(learner, group([GOOD, BAD] + OTHER, [1.0, 0.0, 0.0, 0.5]))
    solver = [s.model_copy(update={"role": "solver"}) for s in batch]
    lm = learner.accelerator.unwrap_model(learner.model).lm
    before = {n: p.detach().clone() for n, p in lm.named_parameters() if ".lora_" in n}

    def moved():
        return sorted({n.split(".")[-2] for n, p in lm.named_parameters() if ".lora_" in n
                       and not torch.equal(p, before[n])})  # fmt: skip

    learner.train_batch(solver, 0)
    assert moved() == ["role0"]  # the solver's adapter alone
    learner.train_batch(batch, 1)  # samples without a role: the policy's
    assert moved() == ["default", "role0"]
    policy_lp, solver_lp = learner.logprobs(batch), learner.logprobs(solver)
    assert not torch.allclose(policy_lp[0], solver_lp[0])

    folder = learner.save_adapter(tmp_path / "adapter", learner.adapter_weights())
    assert sorted(role_adapters(folder)) == ["ju.dge", "solver"]
    for sub, expected in ((folder, policy_lp), (folder / "solver", solver_lp)):
        on_base = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), sub
        )
        scorer = Learner(tiny_model_dir, TrainConfig())
        scorer.accelerator.unwrap_model(scorer.model).lm = on_base.merge_and_unload()
        for a, b in zip(expected, scorer.logprobs(batch)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)

    learner.save_trainer_state(tmp_path / "ckpt", {"batch": 1})
    resumed = Learner(tiny_model_dir, cfg)
    resumed.load_trainer_state(tmp_path / "ckpt")
    for a, b in zip(solver_lp + policy_lp, resumed.logprobs(solver) + resumed.logprobs(batch)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_lora_roles_must_be_distinct_folder_names_and_need_a_rank():
    assert TrainConfig.model_validate_json(TrainConfig().model_dump_json()).lora.roles == []  # train_config.json
    with pytest.raises(ValueError, match="'a' is not a role name of its own"):
        TrainConfig(lora={"rank": 2, "roles": "a,a"})
    with pytest.raises(ValueError, match="lora.roles is set but lora.rank is 0"):
        TrainConfig(lora={"roles": "a"})


def test_cpu_lora_ops_give_a_request_without_an_adapter_nothing_whatever_the_last_slot_holds():
    """vLLM's -1 (no adapter) is a zero update, where Python indexing would take the last slot's adapter."""
    from orchestrate.serving.vllm_plugin.cpu_lora import bgmv_expand, bgmv_shrink

    torch.manual_seed(0)
    weights = torch.randn(3, 1, 4, 6)  # three slots, all in use: rank 4, input 6
    inputs = torch.randn(5, 6)
    indices = torch.tensor([0, -1, 2, 2, -1])
    out = torch.zeros(5, 4)
    bgmv_shrink(inputs, weights, out, indices, scaling=0.5)
    expected = torch.stack([0.5 * weights[i, 0] @ x if i >= 0 else torch.zeros(4) for x, i in zip(inputs, indices)])
    torch.testing.assert_close(out, expected)
    none = torch.ones(5, 4)
    bgmv_expand(torch.randn(5, 6), weights, none, torch.full((5,), -1))  # a batch of base requests alone
    assert torch.equal(none, torch.ones(5, 4))
