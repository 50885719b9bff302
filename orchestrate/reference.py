"""Reference log-probs: score each completion under the reference model.

The reference server (the initial weights, never reloaded) scores the token
ids the policy sampled, prompt included, with echo + prompt_logprobs. These
are log-probs of the reference model at temperature 1. On GPU the policy
server sleeps while the reference server is awake; on CPU both stay up.
"""

from __future__ import annotations

import asyncio

from tqdm.auto import tqdm

from agents.llm import VLLMClient
from tapes.tape import Tape


async def annotate_reference(tapes: list[Tape], reference: VLLMClient, progress: bool = True) -> int:
    """Fill `ref_logprobs` on every LLM call of every tape; returns the number of calls scored."""
    calls = [call for tape in tapes for call in tape.llm_calls if call.output_token_ids]
    bar = tqdm(total=len(calls), desc="reference", unit="call", disable=not progress, leave=False)

    async def one(call) -> None:
        scores = await reference.score(call.prompt_token_ids + call.output_token_ids, len(call.prompt_token_ids))
        if len(scores) != len(call.output_token_ids):  # score() checks too; this is the contract
            raise RuntimeError(f"call {call.id}: {len(scores)} reference log-probs for {len(call.output_token_ids)} tokens")
        call.ref_logprobs = scores
        bar.update(1)

    try:
        await asyncio.gather(*(one(call) for call in calls))
    finally:
        bar.close()
    return len(calls)
