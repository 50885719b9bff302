"""Log-probs (and entropy) of the completion tokens under the model being trained.

Two things make this cheap:
- only the positions that predict completion tokens go through the output
  head (prompt positions never do), and
- with the fused implementation the logits are never held whole: the head
  runs in chunks of tokens, the backward pass recomputes each chunk's logits
  instead of keeping them. At vocabulary 49152 (SmolLM2) or 128256
  (Llama 3) fp32 logits are the largest tensors of a step.

Log-probs are of the tempered distribution, softmax(logits / T), with each
sequence's sampling temperature T: that is the distribution vLLM sampled
from and reports log-probs of, so the importance ratio starts at 1.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class _HeadLogProbs(torch.autograd.Function):
    """log softmax(hidden @ W.T * inv_temp)[target] and the entropy, chunk by chunk.

    Saves only hidden states and one log-sum-exp per token; backward
    recomputes each chunk's logits. d logp / d logits = (onehot - softmax) * inv_temp.
    Entropy is returned for logging only (not differentiable).
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: Tensor, chunk: int):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            logits = (hidden[s:e] @ weight.T).float().mul_(inv_temp[s:e, None])
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            logp[s:e] = logits.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
            probs = torch.exp(logits - lse[s:e, None])
            entropy[s:e] = lse[s:e] - (probs * logits).sum(-1)
            del logits, probs
        ctx.save_for_backward(hidden, weight, targets, inv_temp, lse)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_logp: Tensor, _grad_entropy: Tensor):
        hidden, weight, targets, inv_temp, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        n = hidden.shape[0]
        for s in range(0, n, ctx.chunk):
            e = min(n, s + ctx.chunk)
            logits = (hidden[s:e] @ weight.T).float().mul_(inv_temp[s:e, None])
            g = torch.exp(logits.sub_(lse[s:e, None]))  # softmax, in place of the logits
            del logits
            g.mul_(-grad_logp[s:e, None])
            g.scatter_add_(1, targets[s:e, None], grad_logp[s:e, None].float())
            g = g.mul_(inv_temp[s:e, None]).to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[s:e] = g @ weight
            if grad_weight is not None:
                grad_weight += g.T @ hidden[s:e].to(weight.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def head_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: Tensor, chunk: int = 1024):
    """(logp, entropy) per row of `hidden` [n, d] for `targets` [n] under head `weight` [V, d]."""
    return _HeadLogProbs.apply(hidden, weight, targets, inv_temp, chunk)


class PolicyLogProbs(nn.Module):
    """Wraps a causal LM so that its forward returns completion log-probs.

    accelerate prepares this wrapper (DDP / FSDP hook into its forward), so
    the whole computation, head included, happens inside one forward call.
    """

    def __init__(self, lm: nn.Module, impl: str = "fused", chunk: int = 1024):
        super().__init__()
        self.lm = lm
        head = lm.get_output_embeddings()
        if impl == "fused" and getattr(head, "bias", None) is not None:
            impl = "full"  # the fused head has no bias term
        if impl == "fused" and getattr(lm.config, "final_logit_softcapping", None):
            impl = "full"
        self.impl = impl
        self.chunk = chunk
        # FSDP's transformer auto-wrap looks for the layer classes here.
        self._no_split_modules = getattr(lm, "_no_split_modules", None)

    def forward(self, input_ids, position_ids, rows, cols, targets, inv_temp):
        """Per completion token: (logp with grad, entropy without), each [n]."""
        if self.impl == "fused":
            hidden = self.lm.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False)
            h = hidden.last_hidden_state[rows, cols]
            return head_logprobs(h, self.lm.get_output_embeddings().weight, targets, inv_temp, self.chunk)
        # full: the model's own forward, logits only from the first predicting column on.
        first = int(cols.min())
        out = self.lm(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                      logits_to_keep=input_ids.shape[1] - first)
        logits = out.logits[rows, cols - first].float() * inv_temp[:, None]
        logps = torch.log_softmax(logits, dim=-1)
        logp = logps.gather(1, targets[:, None]).squeeze(1)
        with torch.no_grad():
            entropy = -(logps.exp() * logps).sum(-1)
        return logp, entropy
