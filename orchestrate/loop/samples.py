"""What an iteration saves: its tape file (`save_tapes`, written whole), and the tapes -> training samples in the finetune process's batch format: one sample per episode.

An episode's calls share their prefixes (each prompt is the previous prompt +
output + the environment's tokens), so the whole episode is one sample: the
first prompt, then everything after it, with `turns` marking the sampled
outputs (trained on) among the environment's tokens (context only). The
trainer computes it once instead of once per call. Where a call's prompt does
not extend the previous prompt + output (an agent that re-rendered or cut its
history), the episode is cut there into samples that share an `episode_id`.

Each turn carries its own reward; the learner turns them into returns and
advantages. The teacher's log-probs (on-policy distillation), and its top-k
(--teacher.topk), are carried when every call of the sample has them. Tapes flagged with an infrastructure error
are left out.
"""

from __future__ import annotations

import os
from pathlib import Path

from agents.agent import turn_rewards
from contract.durable import AtomicFile
from tapes.store import TapeWriter
from tapes.tape import LLMCall, Tape, call_chains


class SampleError(ValueError):
    pass


def tape_samples(tape: Tape, require_ref: bool, whole: bool = False) -> list[dict]:
    """The samples of one tape. A fork's replayed calls are its parent's to train, unless `whole` (its parent
    is not in the batch: the fork is trained as the episode it is, replayed turns included)."""
    if tape.metadata.error:
        return []  # an infrastructure failure is not a zero reward: not trained on
    if tape.metadata.reward is None:
        if not any(c.output_token_ids for c in tape.llm_calls):
            return []  # nothing was sampled (the prompt filled the context, say): nothing to train on
        raise SampleError(f"tape {tape.metadata.id} has no reward: score it before making samples")
    rewards = turn_rewards(tape)
    calls = [c for c in tape.llm_calls if c.output_token_ids]
    # a fork's: its parent's to train
    replayed = set() if whole else {c.id for c in tape.llm_calls[: tape.metadata.branch_at or 0]}
    for call in calls:
        if len(call.logprobs) != len(call.output_token_ids):
            raise SampleError(f"tape {tape.metadata.id} call {call.id}: log-probs do not match the output tokens")
        if call.id in replayed:
            continue
        if require_ref and (call.ref_logprobs is None or len(call.ref_logprobs) != len(call.output_token_ids)):
            raise SampleError(
                f"tape {tape.metadata.id} call {call.id}: reference log-probs missing or misaligned "
                "(run the reference pass, or set kl_coef to 0)"
            )
        if call.teacher_logprobs is not None and len(call.teacher_logprobs) != len(call.output_token_ids):
            raise SampleError(f"tape {tape.metadata.id} call {call.id}: teacher log-probs misaligned with its output")
        top = call.teacher_top_ids, call.teacher_top_logprobs
        if (top[0] is None) != (top[1] is None) or any(
            t is not None and len(t) != len(call.output_token_ids) for t in top
        ):
            raise SampleError(f"tape {tape.metadata.id} call {call.id}: the teacher's top-k misaligned with its output")
        if not 1 <= call.turn <= max(1, len(rewards)):
            raise SampleError(
                f"tape {tape.metadata.id} call {call.id}: turn {call.turn} outside the episode's {len(rewards)} turns"
            )
    if not rewards:  # a tape that counts no agent turn (metadata.turns 0: not played by the agent): its reward, once
        rewards = [float(tape.metadata.reward)]
    branch = None if whole else fork_branch(tape, rewards)
    samples = []
    for role, role_calls in by_role(calls).items():
        samples += _role_samples(tape, role, role_calls, rewards, replayed, branch, require_ref)
    return samples


def sample_id(tape_id: str, role: str | None = None, part: int | None = None) -> str:
    """A sample's id: its tape's, then `/ROLE` for a role's calls (agent.roles), then `:K` for the K-th part of an
    episode cut where a prompt was re-rendered."""
    own = tape_id if role is None else f"{tape_id}/{role}"
    return own if part is None else f"{own}:{part}"


def tape_of_sample(sample: str) -> str:
    """The id of the tape a sample id (`sample_id`) was cut from."""
    return sample.partition(":")[0].partition("/")[0]


def by_role(calls: list[LLMCall]) -> dict[str | None, list[LLMCall]]:
    """An episode's calls by the role that made them, in order of each role's first call (one agent: all under
    None). Each role's calls are its own conversation, trained as an episode of its own."""
    out: dict[str | None, list[LLMCall]] = {}
    for call in calls:
        out.setdefault(call.role, []).append(call)
    return out


def _role_samples(tape: Tape, role: str | None, calls: list[LLMCall], rewards: list[float], replayed: set[str],
                  branch: dict | None, require_ref: bool) -> list[dict]:  # fmt: skip
    """The samples of one role's calls of a tape (its one agent's: role None)."""
    segments = call_chains(calls)
    samples = []
    for k, segment in enumerate(segments):
        own = [call for call in segment if call.id not in replayed]
        if not own:
            continue  # wholly replayed: the parent's sample trains it
        prompt = segment[0].prompt_token_ids
        completion: list[int] = []
        turns, behaviour, ref, teacher = [], [], [], []
        top_ids, top_logprobs = [], []
        for call in segment:
            completion += call.prompt_token_ids[len(prompt) + len(completion) :]  # the environment's tokens
            if call.id not in replayed:  # a replayed call's output is context here, as the environment's
                turns.append({"index": call.turn - 1, "start": len(completion), "length": len(call.output_token_ids),
                              "reward": rewards[call.turn - 1], "truncated": call.finish_reason == "length",
                              "max_tokens": call.sampling.max_tokens})  # fmt: skip
                behaviour += call.logprobs
                if require_ref:
                    ref += call.ref_logprobs
                if teacher is not None and call.teacher_logprobs is not None:
                    teacher += call.teacher_logprobs
                else:
                    teacher = None
                if top_ids is not None and call.teacher_top_ids is not None:
                    top_ids += call.teacher_top_ids
                    top_logprobs += call.teacher_top_logprobs
                else:
                    top_ids = top_logprobs = None
            completion += call.output_token_ids
        # where the version of the sampled tokens changes (a later turn's newer call, or new weights under a call)
        oldest = min(call.policy_version for call in own)
        versions = [v for call in own for v in call.token_versions()]
        changes = [(i, v) for i, v in enumerate(versions) if v != (versions[i - 1] if i else oldest)]
        samples.append({
            "prompt_ids": prompt,
            "completion_ids": completion,
            "turns": turns,
            "behaviour_logprobs": behaviour,
            "ref_logprobs": ref if require_ref else None,
            "teacher_logprobs": teacher,
            "teacher_top_ids": top_ids,
            "teacher_top_logprobs": top_logprobs,
            "reward": sum(t["reward"] for t in turns),
            "group_id": tape.metadata.group_id,
            "episode_id": tape.metadata.id,
            "temperature": own[0].sampling.temperature,  # a fork's own calls' (tree.temperature), not its parent's
            "sample_id": sample_id(tape.metadata.id, role, None if len(segments) == 1 else k),
            "policy_version": oldest,
            "version_changes": changes or None,
            "branch": branch,
            "role": role,
        })  # fmt: skip
    return samples


def fork_branch(tape: Tape, rewards: list[float]) -> dict | None:
    """A fork's place in its tree for the learner (contract.batch.Branch): its parent, the first turn it
    played itself, and the rewards of the turns before it (replayed: its parent's); none for a tape that
    replayed nothing."""
    m = tape.metadata
    if m.parent_id is None or not m.branch_at:
        return None
    turn = tape.llm_calls[m.branch_at].turn - 1 if m.branch_at < len(tape.llm_calls) else len(rewards)
    return {"parent_id": m.parent_id, "turn": turn, "prefix_rewards": rewards[:turn]}


def tapes_to_samples(tapes: list[Tape], require_ref: bool) -> list[dict]:
    """The batch's samples; a fork whose parent is not among `tapes` (left out by an offline filter, or forked
    by hand) is trained whole, when its calls were sampled at one temperature (a sample has one; a fork at
    --tree.temperature trains its own calls alone)."""
    present = {t.metadata.id for t in tapes}

    def whole(tape: Tape) -> bool:
        temperatures = {c.sampling.temperature for c in tape.llm_calls if c.output_token_ids}
        return tape.metadata.parent_id not in present | {None} and len(temperatures) == 1

    samples = [sample for tape in tapes for sample in tape_samples(tape, require_ref, whole=whole(tape))]
    return counterfactual_regroup(samples, tapes)


def counterfactual_regroup(samples: list[dict], tapes: list[Tape]) -> list[dict]:
    """The batch's samples with counterfactual credit (orchestrate.loop.counterfactual): each fork's samples cut
    to its role's, and the parent's sample of that role moved into the fork's group (its other roles keep the
    task's)."""
    groups = {(t.metadata.parent_id, t.metadata.counterfactual): t.metadata.group_id for t in tapes
              if t.metadata.counterfactual and not t.metadata.dropped}  # fmt: skip
    if not groups:
        return samples
    forks = {t.metadata.id: t.metadata.counterfactual for t in tapes if t.metadata.counterfactual}
    out = []
    for sample in samples:
        episode, role = sample["episode_id"], sample["role"]
        if episode in forks:
            if role != forks[episode]:
                continue  # not the role played again: its calls are the parent's, or an episode it changed
            sample = {**sample, "branch": None}  # all of its role's calls are its own (none replayed)
        elif (episode, role) in groups:
            sample = {**sample, "group_id": groups[(episode, role)]}
        out.append(sample)
    return out


def write_samples(path: Path, tapes: list[Tape], require_ref: bool) -> Path:
    """Write the batch file the finetune process trains on (its own format and atomic writer)."""
    from contract.batch import write_batch

    samples = tapes_to_samples(tapes, require_ref)
    if not samples:
        raise no_samples(tapes)
    return write_batch(path, samples)


def no_samples(tapes: list[Tape]) -> SampleError:
    """Why none of `tapes` gives a sample, in one line."""
    if not tapes:
        return SampleError("no episode to train on (no tapes)")
    causes = [untrainable(t) for t in tapes]
    others = len(set(causes)) - 1
    more = f" (and {others} other cause{'s' * (others > 1)}: see the tapes)" if others else ""
    first = f"the first's: {causes[0]}" if len(tapes) > 1 else causes[0]
    return SampleError(f"no episode of {len(tapes)} can be trained on; {first}{more}")


def untrainable(tape: Tape) -> str:
    """Why a tape gives no sample, in one line: its error, no LLM call, nothing sampled (not its reward's
    reason when it was never the cause)."""
    m = tape.metadata
    if m.error:
        return m.error.strip().splitlines()[0]
    who = f"the agent ({m.author})" if m.author else "the agent"
    reason = f" ({m.reward_reason})" if m.reward_reason else ""
    if not tape.llm_calls:
        return f"{who} made no LLM call{reason}"
    if not any(c.output_token_ids for c in tape.llm_calls):
        return f"{who}'s calls sampled no token{reason}"
    return m.reward_reason or "no reward"


def save_tapes(path: str | os.PathLike, tapes) -> Path:
    """A tape file of the run: written under `.partial`, renamed when whole (contract.durable.AtomicFile)."""
    with AtomicFile(path) as f, TapeWriter(f) as writer:
        for tape in tapes:
            writer.write(tape)
    return Path(path)
