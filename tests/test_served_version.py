"""Tapes name the policy version the servers actually serve (issue 22.8), with no vLLM: the loop's own
rollout and reload code, its real VLLMClient answered by scripted HTTP, servers and trainer stand-ins."""

import asyncio
import json

import httpx
import pytest

from agents.env_spec import EnvSpec
from contract.rundir import RunDir
from orchestrate.loop.config import RLConfig
from orchestrate.loop.evaluation import Evaluation
from orchestrate.loop.iteration import Loop
from orchestrate.loop.servers import Servers
from orchestrate.loop.setup import build_agent
from orchestrate.serving.llm import VLLMClient
from tapes.store import read_tapes

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


class Server:
    """A policy server stand-in: remembers which checkpoints it was asked to load."""

    served_model_name = "policy"
    base_url = "http://policy"
    headers: dict = {}

    def __init__(self):
        self.loaded = []

    async def healthy(self):
        return True

    def reload_weights(self, path, verify=True):
        self.loaded.append(path.name)


class Trainer:
    def weights_changed(self, version):
        return True


def answer(request: httpx.Request) -> httpx.Response:
    n = json.loads(request.content)["max_tokens"]
    choice = {
        "text": "",
        "finish_reason": "length",
        "logprobs": {"tokens": [f"token_id:{40 + i}" for i in range(n)], "token_logprobs": [-1.0] * n},
    }
    return httpx.Response(200, json={"choices": [choice], "usage": {"completion_tokens": n}})


@pytest.fixture
def loop(tmp_path):
    from transformers import AutoTokenizer

    from finetune.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", hidden_size=16, num_layers=1)
    config = RLConfig.model_validate({
        "model": {"policy": str(model)}, "rollouts": {"tasks_per_iteration": 2, "attempts": 2, "max_tokens": 4},
        "eval": {"tasks": 3, "max_tokens": 4},
    })  # fmt: skip
    run = RunDir(tmp_path / "run")
    run.create()
    loop = Loop(config, run, progress=False)  # its set-up (_start) starts processes: the parts it makes, by hand
    loop.tokenizer = AutoTokenizer.from_pretrained(model)
    loop.tokenizer.chat_template = CHAT_TEMPLATE
    loop.agent = build_agent(config, loop.tokenizer)
    loop.train_env, loop.evaluation = EnvSpec.from_config(config, "train"), Evaluation(config, run)
    loop.servers = Servers(config, run, loop.tokenizer, [Server(), Server()], progress=False)
    loop.servers.use(Trainer())  # reloads from folders

    def client(role, policy_version=0):  # the servers' client, its HTTP answered here
        assert role == "policy"
        return VLLMClient(loop.servers.policy, loop.tokenizer, policy_version=policy_version,
                          transport=httpx.MockTransport(answer))  # fmt: skip

    loop.servers.client = client
    return loop


def versions(tapes):
    return {t.metadata.policy_version for t in tapes}, {c.policy_version for t in tapes for c in t.llm_calls}


def test_evaluation_names_the_served_version_before_and_after_training(loop):
    """Before training the initial weights (version 0) are served; after iteration i, checkpoint i: evaluation
    after iteration i records i on its tapes and on every LLM call, and so does the next batch's generation."""
    loop.evaluate(0)
    before = list(read_tapes(loop.run.eval_tapes(0)))
    assert len(before) == 3 and all(t.llm_calls for t in before)
    assert versions(before) == ({0}, {0})

    for i in (1, 2):
        loop.run.checkpoint(i).mkdir(parents=True)
        (loop.run.checkpoint(i) / "config.json").write_text("{}")  # the learner published checkpoint i
        loop.servers.serve(i)  # what the loop does once checkpoint i is written
        assert [s.loaded[-1] for s in loop.servers.policy] == [loop.run.checkpoint(i).name] * 2
        loop.evaluate(i)
        after = list(read_tapes(loop.run.eval_tapes(i)))
        assert versions(after) == ({i}, {i}), f"evaluation after iteration {i}"

    tapes, _, _ = asyncio.run(loop._rollouts(loop.train_env, [0, 1], 2, 3, None, "iteration 3"))
    assert len(tapes) == 4 and versions(tapes) == ({2}, {2})  # iteration 3's batch: checkpoint 2 made it
