"""The client, the math environments through the agent, and replay, with no server: scripted HTTP and LLMs."""

import asyncio
import json

import httpx
import pytest

from agents.agent import AgentConfig, ChatAgent, Example
from agents.chat import ChatTokens
from agents.env_spec import EnvSpec
from agents.tasks import Arithmetic, ArithmeticConfig, gsm8k_gold, load_gsm8k
from orchestrate.loop.rollouts import RolloutContext, run_rollouts
from orchestrate.loop.samples import SampleError, tapes_to_samples, write_samples
from orchestrate.serving.llm import LLMError, RequestRejected, VLLMClient
from orchestrate.serving.recorded import ReplayLLM
from tapes.tape import LLMCall, SamplingParams, Tape


class Endpoint:
    def __init__(self, name):
        self.served_model_name = "policy"
        self.base_url = f"http://{name}"
        self.headers = {}

    async def healthy(self):
        return True


def completion(text, n_tokens=3, finish="stop"):
    return {
        "choices": [
            {
                "text": text,
                "finish_reason": finish,
                "logprobs": {
                    "tokens": [f"token_id:{i + 5}" for i in range(n_tokens)],
                    "token_logprobs": [-0.5] * n_tokens,
                },
            }
        ],
        "usage": {"completion_tokens": n_tokens},
    }


def run(coro):
    return asyncio.run(coro)


def test_client_spreads_requests_and_keeps_ids():
    seen = []

    async def handler(request: httpx.Request):
        seen.append(request.url.host)
        await asyncio.sleep(0.01)
        body = json.loads(request.content)
        assert isinstance(body["prompt"], list) and body["logprobs"] == 0
        return httpx.Response(200, json=completion("7 + 5 = 12 \\boxed{12}"))

    async def go():
        client = VLLMClient([Endpoint("a"), Endpoint("b")], transport=httpx.MockTransport(handler))
        calls = await asyncio.gather(
            *(
                client.complete_ids([1, 2, 3], SamplingParams(), messages=[{"role": "user", "content": "q"}])
                for _ in range(20)
            )
        )
        await client.aclose()
        return calls

    calls = run(go())
    assert {"a", "b"} == set(seen) and min(seen.count("a"), seen.count("b")) >= 5
    assert calls[0].output_token_ids == [5, 6, 7] and calls[0].logprobs == [-0.5] * 3
    assert calls[0].prompt_token_ids == [1, 2, 3] and calls[0].messages == [{"role": "user", "content": "q"}]


def test_weight_swap_drains_calls_in_flight_and_versions_every_call():
    """swap_weights: calls in flight finish on the old weights, calls started meanwhile wait until the
    reload is done, nothing reaches a server during the reload, and each call names its one version."""
    events = []  # what the servers saw, in order
    in_flight = 0
    three_arrived, release = asyncio.Event(), asyncio.Event()

    async def handler(request: httpx.Request):
        nonlocal in_flight
        in_flight += 1
        events.append(("request", in_flight))
        if in_flight == 3:
            three_arrived.set()
        if not release.is_set():
            await release.wait()  # the first three stay in flight until the test lets them go
        in_flight -= 1
        return httpx.Response(200, json=completion("x"))

    async def go():
        client = VLLMClient([Endpoint("a")], transport=httpx.MockTransport(handler), policy_version=4)

        def call():
            return asyncio.create_task(client.complete_ids([1, 2], SamplingParams()))

        first = [call() for _ in range(3)]
        await three_arrived.wait()

        async def reload():
            events.append(("reload", in_flight))

        swap = asyncio.create_task(client.swap_weights(reload, version=5))
        await asyncio.sleep(0)  # the swap closes the gate
        later = [call() for _ in range(2)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(events) == 3, "a call reached the server while the weights were being swapped"
        release.set()
        held = await swap
        calls = await asyncio.gather(*first, *later)
        await client.aclose()
        return calls, held

    calls, held = run(go())
    assert events[3] == ("reload", 0)  # the reload ran with nothing in flight
    assert [e[0] for e in events] == ["request"] * 3 + ["reload"] + ["request"] * 2
    assert [c.policy_version for c in calls] == [4, 4, 4, 5, 5]
    assert held > 0


def test_client_retries_transient_failures_and_calls_on_failure():
    state = {"n": 0, "failures": 0}

    async def handler(request):
        state["n"] += 1
        if state["n"] <= 2:
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, json=completion("\\boxed{1}"))

    async def on_failure(endpoint, exc):
        state["failures"] += 1

    async def go():
        async with VLLMClient([Endpoint("a")], transport=httpx.MockTransport(handler), on_failure=on_failure) as client:
            return await client.complete_ids([1], SamplingParams())

    call = run(go())
    assert call.output_text == "\\boxed{1}" and state["failures"] == 2


def test_client_gives_up_and_does_not_retry_client_errors():
    async def down(request):
        raise httpx.ConnectError("refused")

    async def bad(request):
        return httpx.Response(400, json={"error": "prompt too long"})

    async def go(handler):
        async with VLLMClient([Endpoint("a")], transport=httpx.MockTransport(handler), max_retries=1) as client:
            return await client.complete_ids([1], SamplingParams())

    with pytest.raises(LLMError, match="after 2 attempts"):
        run(go(down))
    with pytest.raises(RequestRejected, match="400"):
        run(go(bad))


def test_reference_scoring_refuses_misaligned_logprobs():
    async def handler(request):
        body = json.loads(request.content)
        ids = body["prompt"]
        entries = [None] + [{str(t): {"logprob": -1.0}} for t in ids[1:]]
        entries[-1] = {"999": {"logprob": -2.0}}  # the server scored another token
        return httpx.Response(200, json={"choices": [{"text": "", "prompt_logprobs": entries}]})

    async def go():
        async with VLLMClient([Endpoint("a")], transport=httpx.MockTransport(handler)) as client:
            return await client.score([1, 2, 3, 4], 2)

    with pytest.raises(LLMError, match="no log-prob for token 4"):
        run(go())


class ScriptedLLM:
    """Answers with scripted (text, finish reason); output ids [1, 2] (+ the end-of-turn token on a stop)."""

    def __init__(self, outputs, eos=None):
        self.outputs, self.eos = list(outputs), eos

    async def complete_ids(self, prompt_ids, sampling, *, messages=None, prompt_text=""):
        text, finish = self.outputs.pop(0)
        ids = [1, 2] + ([self.eos] if finish == "stop" and self.eos is not None else [])
        return LLMCall(
            messages=list(messages or []),
            output_text=text,
            output_token_ids=ids,
            logprobs=[-0.1] * len(ids),
            prompt_token_ids=list(prompt_ids),
            prompt_text=prompt_text,
            finish_reason=finish,
            sampling=sampling,
        )


def agent(tokenizer):
    config = AgentConfig(
        instruction="Put the answer in \\boxed{}.",
        max_turns=1,
        examples=[Example(question="1+1?", solution="\\boxed{2}")],
    )
    return ChatAgent(config, SamplingParams(temperature=0.7, max_tokens=16), ChatTokens(tokenizer))


def arithmetic(split="train"):
    return EnvSpec("math:arithmetic", {"digits": 1}, split, run_seed=0)


def test_math_environment_rewards_and_groups(tokenizer):
    spec = arithmetic()
    answers = [spec.make().reset(seed)[1]["answer"] for seed in (0, 1)]
    llm = ScriptedLLM(
        [
            (f"so \\boxed{{{answers[0]}}}", "stop"),
            ("\\boxed{-77}", "stop"),
            ("I think 4", "stop"),
            (f"= \\boxed{{{answers[1]}", "length"),
        ]
    )
    tapes = run(run_rollouts(RolloutContext(agent(tokenizer), spec, llm, iteration=3, policy_version=2), [0, 1], 2,
                             progress=False))  # fmt: skip
    assert [t.metadata.reward for t in tapes] == [1.0, 0.0, -1.0, -1.0]
    assert [t.metadata.success for t in tapes] == [True, False, False, False]
    assert tapes[2].steps[-1].info["format_error"] and tapes[3].metadata.truncated
    assert tapes[0].metadata.group_id == tapes[1].metadata.group_id != tapes[2].metadata.group_id
    assert tapes[0].context["env"] == {
        "id": "math:arithmetic",
        "options": {"digits": 1},
        "split": "train",
        "run_seed": 0,
        "seed": 0,
    }
    # the prompt holds the worked example as an earlier turn, then the question with the instruction
    messages = tapes[0].llm_calls[0].messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[-1]["content"] == tapes[0].steps[0].text + "\nPut the answer in \\boxed{}."

    samples = tapes_to_samples(tapes, require_ref=False)
    assert len(samples) == 4 and samples[2]["reward"] == -1.0 and samples[0]["temperature"] == 0.7
    with pytest.raises(SampleError, match="reference"):
        tapes_to_samples(tapes, require_ref=True)


def test_environment_failure_is_flagged_not_scored(tokenizer):
    class Broken:
        def reset(self, seed=None):
            return "q", {}

        def step(self, action):
            raise RuntimeError("verifier crashed")

    spec = arithmetic()
    spec.make = lambda: Broken()
    (tape,) = run(
        run_rollouts(RolloutContext(agent(tokenizer), spec, ScriptedLLM([("x", "stop")]), 1, 0), [0], 1, progress=False)
    )
    assert tape.metadata.error == "RuntimeError: verifier crashed"
    assert tapes_to_samples([tape], require_ref=False) == []


def test_samples_round_trip_through_the_finetune_format(tmp_path, tokenizer):
    from contract.batch import read_batch

    answer = arithmetic().make().reset(0)[1]["answer"]
    llm = ScriptedLLM([(f"\\boxed{{{answer}}}", "stop"), ("\\boxed{-1}", "stop")])
    tapes = run(run_rollouts(RolloutContext(agent(tokenizer), arithmetic(), llm, 0, 0), [0], 2, progress=False))
    for tape in tapes:
        tape.llm_calls[0].ref_logprobs = [-0.3, -0.4]
    path = write_samples(tmp_path / "batches" / "000001.jsonl", tapes, require_ref=True)
    samples = read_batch(path)
    assert [s.reward for s in samples] == [1.0, 0.0]
    assert samples[0].completion_ids == [1, 2] and samples[0].ref_logprobs == [-0.3, -0.4]
    assert samples[0].group_id == samples[1].group_id and samples[0].temperature == 0.7


def test_replay_gives_the_same_tape_and_catches_prompt_changes(tokenizer):
    from orchestrate.after.replay import replay_tape

    answer = arithmetic().make().reset(0)[1]["answer"]
    llm = ScriptedLLM([(f"so \\boxed{{{answer}}}", "stop")])
    (tape,) = run(run_rollouts(RolloutContext(agent(tokenizer), arithmetic(), llm, 0, 0), [0], 1, progress=False))
    replayed, diff = run(replay_tape(tape, agent(tokenizer)))
    assert diff.identical, diff.report()
    changed = agent(tokenizer)
    changed.config = changed.config.model_copy(update={"instruction": "Answer briefly."})
    _, diff = run(replay_tape(tape, changed))
    assert not diff.identical and "prompt differs" in diff.report()
    with pytest.raises(LLMError, match="prompt differs"):
        run(changed.run_episode(arithmetic().make(), 0, ReplayLLM(tape), Tape()))


def test_arithmetic_is_seeded_and_train_test_disjoint():
    source = Arithmetic(ArithmeticConfig(digits=2, operands=2), seed=7)
    assert source.train(0, 50) == Arithmetic(ArithmeticConfig(digits=2, operands=2), seed=7).train(0, 50)
    assert source.train(10, 5) == source.train(0, 15)[10:]
    test = source.test_set(300)
    assert len({t.question for t in test}) == 300
    assert not {t.question for t in test} & {t.question for t in source.train(0, 3000)}
    hard = Arithmetic(ArithmeticConfig(digits=3, operands=3, operations=["+", "-", "*"]), seed=0).train(0, 20)
    for task in hard:
        assert str(eval(task.data["expression"])) == task.answer


def test_gsm8k_local_file(tmp_path):
    path = tmp_path / "gsm.jsonl"
    rows = [{"question": "q1", "answer": "steps\n#### 1,080"}, {"question": "q2", "answer": "x\n#### -5"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    tasks = load_gsm8k(str(path), "test")
    assert [t.answer for t in tasks] == ["1080", "-5"]
    assert gsm8k_gold("a #### 72") == "72"


def test_gsm8k_shared_test_split_if_present():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
    if not path.exists():
        pytest.skip("../shared/data/gsm8k is not beside this checkout")
    tasks = load_gsm8k(str(path), "test")
    raw = [json.loads(line)["answer"].split("####")[-1].strip() for line in path.read_text().splitlines()]
    assert len(tasks) == len(raw) == 1319
    assert sum("," in r for r in raw) > 0  # thousands commas in the file ...
    assert not any("," in t.answer for t in tasks)  # ... none in the gold answers
    assert sum(t.answer.startswith("-") for t in tasks) == sum(r.startswith("-") for r in raw) > 0


def test_a_lora_swap_holds_nothing_back_and_the_old_version_is_idle_once_its_calls_are_done():
    """swap_weights(mode="adapter"), as for LoRA adapters: calls in flight go on under the old adapter's name,
    calls started after the swap name the new one, nothing waits; version_idle(old) returns only when the
    last call of the old version has come back."""
    models = []
    release = asyncio.Event()

    async def handler(request: httpx.Request):
        models.append(json.loads(request.content)["model"])
        if len(models) <= 2:
            await release.wait()  # the first two stay in flight across the swap
        return httpx.Response(200, json=completion("x"))

    async def go():
        client = VLLMClient([Endpoint("a")], transport=httpx.MockTransport(handler), policy_version=1,
                            adapter=lambda v: f"policy-v{v}" if v else None)  # fmt: skip

        def call():
            return asyncio.create_task(client.complete_ids([1, 2], SamplingParams()))

        first = [call(), call()]
        while len(models) < 2:
            await asyncio.sleep(0)
        loaded = []

        async def reload():
            loaded.append(client.in_flight)

        held = await client.swap_weights(reload, version=2, mode="adapter")
        later = await call()  # answered while the first two are still in flight
        idle = asyncio.create_task(client.version_idle(1))
        await asyncio.sleep(0.01)
        assert not idle.done(), "version 1 reported idle with two of its calls in flight"
        release.set()
        calls = await asyncio.gather(*first)
        await asyncio.wait_for(idle, 1)
        await client.aclose()
        return held, loaded, calls, later

    held, loaded, calls, later = run(go())
    assert held == 0.0 and loaded == [2]  # the new adapter loaded with the two calls still in flight
    assert models == ["policy-v1", "policy-v1", "policy-v2"]
    assert [c.policy_version for c in calls] == [1, 1] and later.policy_version == 2
    assert later.model.endswith(" + adapter policy-v2") and calls[0].model.endswith(" + adapter policy-v1")
