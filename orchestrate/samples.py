"""Tapes -> training samples, one per LLM call, in the finetune process's batch format.

A sample holds exactly what the trainer needs: the prompt and completion token
ids vLLM saw and sampled, the behaviour log-probs (of the sampling
distribution, logits / temperature), the reference log-probs (temperature 1),
the tape's reward, its group and the sampling temperature.
"""

from __future__ import annotations

from pathlib import Path

from tapes.tape import Tape


class SampleError(ValueError):
    pass


def tape_samples(tape: Tape, require_ref: bool) -> list[dict]:
    if tape.metadata.reward is None:
        raise SampleError(f"tape {tape.metadata.id} has no reward: score it before making samples")
    samples = []
    for call in tape.llm_calls:
        if not call.output_token_ids:
            continue
        if len(call.logprobs) != len(call.output_token_ids):
            raise SampleError(f"tape {tape.metadata.id} call {call.id}: log-probs do not match the output tokens")
        if require_ref and (call.ref_logprobs is None or len(call.ref_logprobs) != len(call.output_token_ids)):
            raise SampleError(
                f"tape {tape.metadata.id} call {call.id}: reference log-probs missing or misaligned "
                "(run the reference pass, or set kl_coef to 0)"
            )
        samples.append(
            {
                "prompt_ids": call.prompt_token_ids,
                "completion_ids": call.output_token_ids,
                "behaviour_logprobs": call.logprobs,
                "ref_logprobs": call.ref_logprobs if require_ref else None,
                "reward": tape.metadata.reward,
                "group_id": tape.metadata.group_id,
                "temperature": call.sampling.temperature,
                "sample_id": f"{tape.metadata.id}:{call.id}",
            }
        )
    return samples


def tapes_to_samples(tapes: list[Tape], require_ref: bool) -> list[dict]:
    return [sample for tape in tapes for sample in tape_samples(tape, require_ref)]


def write_samples(path: Path, tapes: list[Tape], require_ref: bool) -> Path:
    """Write the batch file the finetune process trains on (its own format and atomic writer)."""
    from finetune.batch import write_batch

    return write_batch(path, tapes_to_samples(tapes, require_ref))
