"""Reference (and teacher) log-probs: score each completion under a model whose weights never change.

The reference server (the initial weights, never reloaded) scores the token
ids the policy sampled, prompt included, with echo + prompt_logprobs. These
are log-probs of the reference model at temperature 1. A teacher
(--teacher.model, on-policy distillation) scores them the same way on its own
server, into `teacher_logprobs` (with --teacher.topk, also its k most likely
tokens at each sampled position, `teacher_top_ids` / `teacher_top_logprobs`). On GPU the policy server sleeps while the
reference or teacher server is awake; on CPU both stay up.
"""

from __future__ import annotations

import asyncio

from orchestrate.loop.progress import progress_bar
from orchestrate.serving.llm import Scores, VLLMClient
from tapes.tape import Tape, call_chains


async def annotate_reference(
    tapes: list[Tape], reference: VLLMClient, progress: bool = True, field: str = "ref_logprobs", top: int = 0
) -> int:
    """Fill `field` (`ref_logprobs`, or a teacher's `teacher_logprobs`) on every LLM call of every tape with
    the log-probs `reference` gives the sampled tokens; returns the number of calls scored. With `top` (a
    teacher's top-k, --teacher.topk), also each output token's `top` most likely tokens under it
    (`teacher_top_ids`, `teacher_top_logprobs`).

    The turns of an episode are scored in one request: the last call's prompt + output holds every
    earlier turn, so the reference model reads each token once instead of once per later turn.
    """
    chains = [chain for tape in tapes for chain in call_chains([c for c in tape.llm_calls if c.output_token_ids])]
    desc = "teacher" if field == "teacher_logprobs" else "reference"
    bar = progress_bar(total=sum(map(len, chains)), desc=desc, unit="call", disable=not progress, leave=False)

    async def one(chain) -> None:
        last, first = chain[-1], chain[0]
        ids = last.prompt_token_ids + last.output_token_ids
        if top:
            scores = await reference.score_top(ids, len(first.prompt_token_ids), top)
        else:
            scores = Scores(await reference.score(ids, len(first.prompt_token_ids)))
        offset = len(first.prompt_token_ids)
        for call in chain:
            start = len(call.prompt_token_ids) - offset
            end = start + len(call.output_token_ids)
            part = scores.logprobs[start:end]
            if len(part) != len(call.output_token_ids):  # score() checks too; this is the contract
                raise RuntimeError(
                    f"call {call.id}: {len(part)} {desc} log-probs for {len(call.output_token_ids)} tokens"
                )
            setattr(call, field, part)
            if top:
                call.teacher_top_ids = scores.top_ids[start:end]
                call.teacher_top_logprobs = scores.top_logprobs[start:end]
        bar.update(len(chain))

    try:
        await asyncio.gather(*(one(chain) for chain in chains))
    finally:
        bar.close()
    return sum(map(len, chains))
