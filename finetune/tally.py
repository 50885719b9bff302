"""What a step adds up to: the sums its micro-batches add up on each process (`StepTally`), reduced over
the processes into `StepSums`, and the step's metrics made from them (`loss_metrics`: the learner's own
figures and every term the loss reported, under the loss's own names; `loss_terms` names the latter)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from accelerate import Accelerator


@dataclass
class StepSums:
    """What a step's micro-batches add up to, by kind: the base sums (loss, entropy, token and slot counts),
    the training-inference mismatch over lag-0 tokens (sum of |gap|, of the ratio e^gap, and their count;
    first step of a batch only), the loss's terms (summed as they are) and its per-token sums (divided by
    the step's completion tokens when reported); and the extremes of per-token values as (max, min)."""

    base: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("loss", "entropy", "tokens", "slots"), 0.0))
    mismatch: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("abs", "ratio", "n"), 0.0))
    terms: dict[str, float] = field(default_factory=dict)
    token_sums: dict[str, float] = field(default_factory=dict)
    extremes: dict[str, tuple[float, float]] = field(default_factory=dict)

    CHANNELS: ClassVar[tuple[str, ...]] = ("base", "mismatch", "terms", "token_sums")


class StepTally:
    """This process's StepSums in one step, added micro-batch by micro-batch, then reduced over processes."""

    def __init__(self):
        self.sums = StepSums()
        self.maxes: dict[str, torch.Tensor] = {}
        self.mins: dict[str, torch.Tensor] = {}

    def add(self, channel: str, values: dict[str, float]) -> None:
        into = getattr(self.sums, channel)
        for name, value in values.items():
            into[name] = into.get(name, 0.0) + value

    def extreme(self, name: str, hi: torch.Tensor, lo: torch.Tensor) -> None:
        self.maxes[name] = torch.maximum(self.maxes[name], hi) if name in self.maxes else hi
        self.mins[name] = torch.minimum(self.mins[name], lo) if name in self.mins else lo

    def reduce(self, acc: Accelerator) -> StepSums:
        """The sums and the (max, min) of each extreme over all processes (the same keys on every process:
        the same loss)."""
        keys = [(c, n) for c in StepSums.CHANNELS for n in sorted(getattr(self.sums, c))]
        totals = torch.tensor([getattr(self.sums, c)[n] for c, n in keys], dtype=torch.float64)
        extremes = sorted(self.maxes)
        empty = torch.zeros(0, dtype=torch.float64)
        hi = torch.stack([self.maxes[n] for n in extremes]).double() if extremes else empty
        lo = torch.stack([self.mins[n] for n in extremes]).double() if extremes else empty
        if acc.num_processes > 1:
            totals = acc.reduce(totals.to(acc.device), "sum").cpu()
            hi = acc.gather(hi[None].to(acc.device)).amax(0).cpu()
            lo = acc.gather(lo[None].to(acc.device)).amin(0).cpu()
        out = StepSums(extremes=dict(zip(extremes, zip(hi.tolist(), lo.tolist()))))
        for (channel, name), value in zip(keys, totals.tolist()):
            getattr(out, channel)[name] = value
        return out


def loss_metrics(sums: StepSums, n_completion: int) -> dict:
    """A step's loss, entropy per token, training-inference mismatch (when measured), the loss's terms, its
    per-token means and extremes."""
    m = {"loss": sums.base["loss"], "entropy": sums.base["entropy"] / n_completion}
    measured = sums.mismatch["n"]
    if measured:  # the training-inference mismatch (first step of a batch only)
        m.update(mismatch_abs_logp=sums.mismatch["abs"] / measured, tis_ratio_mean=sums.mismatch["ratio"] / measured)
    m.update(sums.terms)
    m.update({name: value / n_completion for name, value in sums.token_sums.items()})
    for name, (hi, lo) in sums.extremes.items():
        if name == "tis_ratio":
            if measured:
                m["tis_ratio_max"] = hi
            continue
        m[f"{name}_max"], m[f"{name}_min"] = hi, lo
    return m


def advantage_metrics(adv: torch.Tensor) -> dict[str, float]:
    """Mean, std, min, max and the fraction of zeros of a step's per-token advantages."""
    return {
        "adv_mean": float(adv.mean()),
        "adv_std": float(adv.std()) if len(adv) > 1 else 0.0,
        "adv_min": float(adv.min()),
        "adv_max": float(adv.max()),
        "zero_adv_frac": float((adv == 0).double().mean()),
    }


def loss_terms(sums: StepSums) -> list[str]:
    """The names under which loss_metrics reports what the loss returned (its terms, per-token means and
    extremes), in that order."""
    extremes = [f"{name}_{end}" for name in sums.extremes if name != "tis_ratio" for end in ("max", "min")]
    return [*sums.terms, *sums.token_sums, *extremes]
