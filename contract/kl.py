"""The one k3 estimate of KL(policy || reference), for floats and for tensors alike.

Per sampled token: k3 = exp(r) - r - 1 with r = ref_logprob - logprob (Schulman's k3; >= 0, unbiased for
tokens drawn from the policy, low variance). The learner's KL penalty (finetune.losses), the run's kl_ref
metric (orchestrate.loop.metrics), the browser and orchestrate.after.show all call this function.

What it estimates at a sampling temperature T != 1: the tokens come from the tempered policy
softmax(logits / T), while both log-probs are untempered (T = 1; the reference is scored at T = 1). The
mean of k3 over those tokens is then E_{x ~ pi_T}[exp(r) - r - 1], not KL(pi || ref); it is still >= 0
and 0 only where the two models agree, so it stays a sound penalty, but it is not the KL of either the
tempered or the untempered policy. At T = 1 it is exactly the KL's unbiased estimate.
"""

from __future__ import annotations

import math


def k3(logprob, ref_logprob):
    """exp(r) - r - 1 with r = ref_logprob - logprob: floats give a float, tensors a tensor (same shape)."""
    r = ref_logprob - logprob
    return (math.exp(r) if isinstance(r, float | int) else r.exp()) - r - 1
