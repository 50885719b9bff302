"""What the gateway's tests share: a scripted LLM with a real tokenizer, a sandbox stand-in, the arithmetic
environment the programs play; the `agent_for` fixture (tests/conftest.py) builds a ProgramAgent on them."""

from __future__ import annotations

import asyncio

from agents.envs import make_env
from tapes.tape import SamplingParams, Tape
from tests.scripted import scripted_call

SAMPLING = SamplingParams(temperature=0.7, max_tokens=64)


class ScriptedLLM:
    """Answers each call with the next text of `replies`, tokenised (the ids a server would have sampled, the
    end-of-turn token appended where `eos`)."""

    def __init__(self, tokenizer, replies, eos=True):
        self.tokenizer, self.replies, self.eos = tokenizer, list(replies), eos
        self.prompts: list[list[int]] = []

    async def complete_ids(self, prompt_ids, sampling, *, messages=None, prompt_text=""):
        self.prompts.append(list(prompt_ids))
        text = self.replies.pop(0)
        if isinstance(text, Exception):
            raise text
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        stopped = any(text.endswith(s) for s in sampling.stop)
        if self.eos and not stopped:
            ids = ids + [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        return scripted_call(text, ids, prompt_ids, sampling, messages=messages, prompt_text=prompt_text)


class WithBase(ScriptedLLM):
    """A LoRA run's client as an agent sees it: the policy's replies, its base model's own (`base_model`) and
    each role's own adapter's (`role_model`)."""

    def __init__(self, tokenizer, replies, base_replies, role_replies=None):
        super().__init__(tokenizer, replies)
        self.base = ScriptedLLM(tokenizer, base_replies)
        self.own = {role: ScriptedLLM(tokenizer, said) for role, said in (role_replies or {}).items()}

    def base_model(self):
        return self.base

    def role_model(self, role):
        return self.own[role]


def arithmetic():
    return make_env("math:arithmetic", {"digits": 3, "operands": 2, "operations": ["*"]}, split="train", run_seed=0)


def play(agent, llm, seed=3):
    tape = Tape()
    asyncio.run(agent.run_episode(arithmetic(), seed, llm, tape))
    return tape


def answer_of(seed=3):
    env = arithmetic()
    question, _ = env.reset(seed=seed)
    a, b = [int(x) for x in question.removeprefix("What is ").rstrip("?").split(" * ")]
    return a, b, a * b


class FakeSandbox:
    def run(self, code):
        from agents.sandbox import SandboxResult

        namespace: dict = {}
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code, namespace)  # test code of our own
        return SandboxResult(stdout=out.getvalue(), stderr="", exit_code=0)


async def two_roles(task, client):
    """Each role of the run calls once; a reward by role given, then returned by role (process isolation)."""
    for role in task.roles:
        await client.chat.completions.create(model=role, messages=[{"role": "user", "content": role}])
    task.reward(0.25, role="solver")
    return {"solver": 0.5, "judge": 0.5}
