"""New weights under calls in flight (`--run.in_flight_swaps`, issue 34.4), through a real vLLM server: the
calls are paused between two engine steps, the weights swapped, the calls resumed; each records the token
where its version changed, and vLLM's log-probs say that token is exactly where the new weights took over."""

import asyncio
import shutil
from pathlib import Path

import pytest

from contract.rundir import RunDir
from orchestrate.loop.config import RLConfig
from orchestrate.loop.servers import Servers
from orchestrate.serving.llm import VLLMClient
from tapes.tape import LLMCall, SamplingParams, VersionChange

LENGTH = 96  # tokens per call: the swap comes after the first, well before the last


def test_a_call_knows_the_version_of_each_token():
    call = LLMCall(policy_version=3, output_token_ids=list(range(6)),
                   version_changes=[VersionChange(token=2, version=4), VersionChange(token=5, version=6)])  # fmt: skip
    assert call.token_versions() == [3, 3, 4, 4, 4, 6] and call.newest_version == 6
    assert LLMCall(policy_version=2, output_token_ids=[7, 8]).token_versions() == [2, 2]


async def score(server, ids: list[int]) -> list[float]:
    """The server's log-probs of ids[1:] given what precedes each (temperature 1, fresh: no cache reused)."""
    async with VLLMClient([server]) as client:
        return await client.score(ids, 1)


def other_weights(model: Path, folder: Path) -> Path:
    """`model` with noise on its MLP weights: other log-probs, the same shapes and tokenizer."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, folder)
    weights = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, value in weights.items():
        if ".mlp." in name:
            value.add_(0.02 * torch.randn(value.shape, generator=generator))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.vllm
def test_weights_swapped_under_calls_in_flight_take_over_at_the_recorded_token(policy_server, tmp_path):
    """Four calls of 256 tokens (ignore_eos) on the embedded policy server (about ten seconds each here);
    once each has sampled some, version 1 (other weights, from its checkpoint folder) is swapped in under
    them. Every call records one change, inside its output; the server's log-probs of each output, scored
    afresh, are the new weights' from that token on (the calls' KV was recomputed with them) and the old
    weights' before it."""
    server = policy_server
    run = RunDir(tmp_path / "run")
    other_weights(Path(server.model), run.checkpoint(1))
    config = RLConfig.model_validate({"run": {"async_level": 1, "in_flight_swaps": True}})

    class Trainer:
        def weights_changed(self, version):
            return True

    servers = Servers(config, run, None, [server], progress=False)
    servers.use(Trainer())
    sampling = SamplingParams(temperature=1.0, max_tokens=LENGTH)
    prompts = [[1 + 37 * i + k for k in range(12)] for i in range(4)]

    async def go():
        async with VLLMClient([server], extra_body={"ignore_eos": True}) as client:
            calls = [asyncio.create_task(client.complete_ids(p, sampling)) for p in prompts]
            while True:  # polling the engine's progress (between its steps) until every call has tokens
                lengths = await asyncio.to_thread(server.output_lengths)
                if len(lengths) == 4 and min(lengths.values()) >= 1:
                    break
                for c in calls:
                    assert not c.done(), f"a call ended before the swap: {c.exception() or c.result()}"
                await asyncio.sleep(0.01)
            await client.swap_weights(lambda: servers.swap_in_flight(client, 1), 1, mode="keep")
            assert client.policy_version == 1 and servers.served == 1 and not servers.stale
            return await asyncio.gather(*calls)

    try:
        calls = asyncio.run(go())
        new = [asyncio.run(score(server, c.prompt_token_ids + c.output_token_ids))[11:] for c in calls]
    finally:
        server.reload_weights(server.model, verify=False)  # the session's server gets its own weights back
    old = [asyncio.run(score(server, c.prompt_token_ids + c.output_token_ids))[11:] for c in calls]
    for call, new_lp, old_lp in zip(calls, new, old):
        assert call.policy_version == 0 and len(call.version_changes) == 1 and call.newest_version == 1
        n = call.version_changes[0].token
        assert 1 <= n < len(call.output_token_ids) == LENGTH, n
        after = max(abs(a - b) for a, b in zip(call.logprobs[n:], new_lp[n:]))
        before = max(abs(a - b) for a, b in zip(call.logprobs[:n], old_lp[:n]))
        assert after < 1e-3 and before < 1e-3, (after, before)
        # and the other way round they differ: the weights did change at n
        assert max(abs(a - b) for a, b in zip(call.logprobs[n:], old_lp[n:])) > 1e-2
