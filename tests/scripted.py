"""The answer a scripted test LLM gives: one LLMCall, the way VLLMClient.complete_ids builds it."""

from tapes.tape import LLMCall


def scripted_call(text, ids, prompt_ids, sampling, *, messages=None, prompt_text="", logprob=-0.5, finish="stop"):
    """`text` sampled as the tokens `ids`, each at log-prob `logprob`, after the prompt `prompt_ids`."""
    return LLMCall(
        messages=list(messages or []),
        prompt_token_ids=list(prompt_ids),
        prompt_text=prompt_text,
        output_text=text,
        output_token_ids=ids,
        logprobs=[logprob] * len(ids),
        finish_reason=finish,
        sampling=sampling,
    )
