"""Micro-batches by token budget: length-sorted, with (almost) no padding.

Sequences (prompt + completion) are sorted longest first and cut greedily
into micro-batches whose cost stays within the token budget:

- padded: rows right-padded to the longest row of the micro-batch; cost =
  rows x longest. Sorting makes neighbours similar in length, so padding is
  a few percent. Right padding needs no attention mask: under causal
  attention a real token never sees the padding after it. On CPU this is the
  fastest layout (measured, see bench/bench_trainer.py): attention stays
  cheap because rows stay short.
- packed: all sequences of a micro-batch in one row, position ids restarting
  at 0 for each; cost = total tokens, no padding at all. transformers turns
  restarting position ids into a block-diagonal causal mask (sdpa) or
  variable-length kernels (flash-attention), so sequences never see each
  other. Pays off on GPU with flash-attention; on CPU the dense mask makes
  attention quadratic in the row length.

- shared_prefix: the completions of one prompt (a GRPO group: every
  attempt of a task has the same prompt ids) share one copy of it in a row:
  [prompt, c1, c2, ...], position ids continuing after the prompt in each
  completion, and a 4-D attention mask under which a completion sees the
  prompt and itself only. The same function as computing every sequence
  alone, with the prompt's forward and backward done once per group instead
  of once per completion: with the embedded preset (prompt ~100 tokens,
  completions ~25, 4 attempts) a step computes 2.6x fewer tokens. Rows are
  padded as in `padded`. Needs an attention implementation that takes a
  custom mask (sdpa, eager; not flash-attention).
  Trees (tree rollouts): a fork's sequence starts as its parent's does
  (the prompt, then the parent's turns up to the branch point); in its
  parent's row it takes those tokens from the parent's and adds only its
  own, its tokens seeing the shared ones and themselves (`parents`): a
  shared prefix is computed once, however many branches share it.

Each MicroBatch also says where every trained completion token is
predicted: the hidden state at (row, col) predicts the token at col + 1, so
the completion token k of a sequence with prompt length P is predicted at col
P - 1 + k. `trained` picks which completion tokens are trained on (a
multi-turn episode's environment tokens are computed, as context, but not
trained on); by default all are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Layout = Literal["padded", "packed", "shared_prefix"]


@dataclass
class MicroBatch:
    indices: list[int]  # which sequences (positions in the input list), in token order below
    input_ids: Tensor  # [rows, cols]
    position_ids: Tensor | None  # [rows, cols] for packed, None for padded (0..cols-1 per row)
    rows: Tensor  # [n] row of the hidden state predicting each completion token
    cols: Tensor  # [n] its column
    targets: Tensor  # [n] the trained completion tokens, sequences end to end in `indices` order
    completion_lengths: list[int]  # trained tokens of each sequence
    n_tokens: int  # real tokens computed (a shared prompt counts once)
    attention_mask: Tensor | None = None  # [rows, 1, cols, cols] bool (True: may attend), shared_prefix only
    adapter: str | None = None  # the LoRA adapter its samples train, with roles of their own (finetune.lora)

    @property
    def n_slots(self) -> int:
        """Token slots computed, padding included."""
        return self.input_ids.numel()


def plan(lengths: Sequence[int], token_budget: int, layout: Layout) -> list[list[int]]:
    """Group sequence indices into micro-batches, longest first.

    A sequence longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i in order:
        n = lengths[i]
        # Sorted longest first, so the first member of a padded group is its longest row.
        cost = (len(current) + 1) * lengths[current[0]] if (layout == "padded" and current) else total + n
        if current and cost > token_budget:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        groups.append(current)
    return groups


Positions = Sequence[Sequence[int]] | None


def _positions(trained: Positions, completions: Sequence[Sequence[int]], i: int) -> list[int]:
    return list(range(len(completions[i]))) if trained is None else list(trained[i])


def build(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    indices: list[int],
    layout: Layout,
    pad_id: int = 0,
    trained: Positions = None,
) -> MicroBatch:
    """Tensors for one micro-batch of the sequences `indices`."""
    seqs = [list(prompts[i]) + list(completions[i]) for i in indices]
    positions = {i: torch.as_tensor(_positions(trained, completions, i), dtype=torch.long) for i in indices}
    rows, cols, targets = [], [], []
    if layout == "padded":
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        for r, (i, s) in enumerate(zip(indices, seqs)):
            input_ids[r, : len(s)] = torch.tensor(s)
            p, k = len(prompts[i]), positions[i]
            rows.append(torch.full((len(k),), r, dtype=torch.long))
            cols.append(p - 1 + k)
        position_ids = None
    elif layout == "packed":
        input_ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)[None]
        position_ids = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        offset = 0
        for i, s in zip(indices, seqs):
            p, k = len(prompts[i]), positions[i]
            rows.append(torch.zeros(len(k), dtype=torch.long))
            cols.append(offset + p - 1 + k)
            offset += len(s)
    else:
        raise ValueError(f"layout must be 'padded' or 'packed', not {layout!r}")
    for i in indices:
        targets.append(torch.as_tensor(list(completions[i]), dtype=torch.long)[positions[i]])
    return MicroBatch(
        indices=list(indices),
        input_ids=input_ids,
        position_ids=position_ids,
        rows=torch.cat(rows),
        cols=torch.cat(cols),
        targets=torch.cat(targets),
        completion_lengths=[len(positions[i]) for i in indices],
        n_tokens=sum(len(s) for s in seqs),
    )


def micro_batches(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    token_budget: int,
    layout: Layout = "padded",
    pad_id: int = 0,
    trained: Positions = None,
    parents: Sequence[int | None] | None = None,
) -> list[MicroBatch]:
    """All micro-batches for these sequences, longest first; `trained[i]`: the completion positions of
    sequence i that are trained on (default: all); `parents[i]`: the sequence that sequence i forked from (a
    tree rollout: they share the prompt and the completion up to the branch point), which the
    shared_prefix layout computes once for both."""
    if layout == "shared_prefix":
        return _shared_prefix_batches(prompts, completions, token_budget, pad_id, trained, parents)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    return [build(prompts, completions, g, layout, pad_id, trained) for g in plan(lengths, token_budget, layout)]


def shared_length(completion: Sequence[int], parent: Sequence[int]) -> int:
    """How many tokens `completion` starts with that `parent` starts with too."""
    n = 0
    for a, b in zip(completion, parent):
        if a != b:
            break
        n += 1
    return n


def _tree_order(members: list[int], parents: Sequence[int | None] | None) -> list[int]:
    """`members` with every sequence after its parent (when the parent is a member): depth first from the
    roots, children in order."""
    if parents is None:
        return members
    inside = set(members)
    children: dict[int | None, list[int]] = {}
    for i in members:
        parent = parents[i] if parents[i] in inside and parents[i] != i else None
        children.setdefault(parent, []).append(i)
    order: list[int] = []
    stack = list(reversed(children.get(None, [])))
    while stack:
        i = stack.pop()
        order.append(i)
        stack += reversed(children.get(i, []))
    return order


def prefix_units(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    token_budget: int,
    parents: Sequence[int | None] | None = None,
) -> list[list[int]]:
    """Sequences with the same prompt, in rows of one prompt + several completions; a fork (`parents`) after
    its parent, sharing the tokens they start with when its parent is in its row.

    A row grows while it stays within the token budget and while its attention area (width squared,
    under the 4-D mask every position is computed) stays within that of its sequences computed one by
    one: sharing the prompt saves its tokens once per extra completion, but long completions (multi-turn
    episodes) in one wide row would cost more attention than they save.
    """
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        by_prompt.setdefault(tuple(p), []).append(i)
    units = []
    for members in by_prompt.values():
        p = len(prompts[members[0]])
        unit: list[int] = []
        width, alone = p, 0
        for i in _tree_order(members, parents):
            n = len(completions[i])
            parent = parents[i] if parents is not None else None
            c = n - (shared_length(completions[i], completions[parent]) if parent in unit else 0)
            if unit and (width + c > token_budget or (width + c) ** 2 > alone + (p + n) ** 2):
                units.append(unit)
                unit, width, alone, c = [], p, 0, n
            unit.append(i)
            width += c
            alone += (p + n) ** 2
        units.append(unit)
    return units


def _shared_prefix_batches(
    prompts, completions, token_budget: int, pad_id: int, trained: Positions, parents=None
) -> list[MicroBatch]:
    units = prefix_units(prompts, completions, token_budget, parents)
    shares = [_shares(completions, unit, parents) for unit in units]
    widths = [len(prompts[u[0]]) + sum(len(completions[i]) - shares[k][i] for i in u) for k, u in enumerate(units)]
    batches = []
    for group in plan(widths, token_budget, "padded"):  # rows = units, padded to the longest
        batches.append(_build_shared_prefix(prompts, completions, [units[g] for g in group], pad_id, trained,
                                            [shares[g] for g in group], parents))  # fmt: skip
    return batches


def _shares(completions, unit: list[int], parents) -> dict[int, int]:
    """Each sequence of a row: how many of its first completion tokens it takes from its parent's (0 for a
    sequence whose parent is not in the row before it)."""
    out: dict[int, int] = {}
    for i in unit:
        parent = parents[i] if parents is not None else None
        out[i] = shared_length(completions[i], completions[parent]) if parent in out else 0
    return out


def _build_shared_prefix(
    prompts, completions, units: list[list[int]], pad_id: int, trained: Positions, shares, parents
) -> MicroBatch:
    width = max(len(prompts[u[0]]) + sum(len(completions[i]) - shares[k][i] for i in u) for k, u in enumerate(units))
    input_ids = torch.full((len(units), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(units), width), dtype=torch.long)
    mask = torch.zeros((len(units), width, width), dtype=torch.bool)
    rows, cols, targets, indices, lengths = [], [], [], [], []
    n_tokens = 0
    shared_any = False
    for r, unit in enumerate(units):
        prompt = list(prompts[unit[0]])
        p = len(prompt)
        input_ids[r, :p] = torch.tensor(prompt)
        position_ids[r, :p] = torch.arange(p)
        mask[r, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
        offset = p
        columns: dict[int, Tensor] = {}  # each sequence's completion tokens: where they are in the row
        for i in unit:
            c = torch.as_tensor(list(completions[i]), dtype=torch.long)
            n, shared = len(c), shares[r][i]
            own = torch.arange(offset, offset + n - shared)
            at = torch.cat([columns[parents[i]][:shared], own]) if shared else own
            columns[i] = at
            input_ids[r, own] = c[shared:]
            position_ids[r, own] = torch.arange(p + shared, p + n)
            # its own tokens see the prompt, then its completion up to themselves (the shared part in its parent's)
            mask[r, own[:, None], :p] = True
            mask[r, own[:, None], at[None, :]] = torch.ones(n, n, dtype=torch.bool).tril()[shared:]
            # token 0 is predicted by the prompt's last position, token k by completion token k - 1
            k = torch.as_tensor(_positions(trained, completions, i), dtype=torch.long)
            predicted_at = torch.cat([torch.tensor([p - 1]), at[:-1]])
            rows.append(torch.full((len(k),), r, dtype=torch.long))
            cols.append(predicted_at[k])
            targets.append(c[k])
            indices.append(i)
            lengths.append(len(k))
            offset += n - shared
            shared_any |= len(unit) > 1
        position_ids[r, offset:] = torch.arange(width - offset) + offset  # padding: harmless positions
        n_tokens += offset
    if not shared_any:
        # no row shares its prompt: a padded micro-batch (positions 0.., plain causal attention), which
        # attention kernels run faster without a mask (flash on GPUs)
        return MicroBatch(indices=indices, input_ids=input_ids, position_ids=None, rows=torch.cat(rows),
                          cols=torch.cat(cols), targets=torch.cat(targets), completion_lengths=lengths,
                          n_tokens=n_tokens)  # fmt: skip
    mask |= torch.eye(width, dtype=torch.bool)  # padding sees itself only
    return MicroBatch(
        indices=indices,
        input_ids=input_ids,
        position_ids=position_ids,
        rows=torch.cat(rows),
        cols=torch.cat(cols),
        targets=torch.cat(targets),
        completion_lengths=lengths,
        n_tokens=n_tokens,
        attention_mask=mask[:, None],
    )
