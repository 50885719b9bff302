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
The KL term compares the model with the reference model, whose log-probs
vLLM scores at T = 1 (prompt log-probs are never tempered): for it the
head also returns the untempered log-probs when asked (`with_raw`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn


def _chunk_forward(lowp: Tensor, targets: Tensor, inv_temp: Tensor, with_raw: bool):
    """One chunk's head output [c, V] (any float dtype; its fp32 copy is worked on in place):
    (logp, entropy, lse, raw_logp, raw_lse), the last two None without `with_raw`."""
    raw = lowp.float()
    raw_logp = raw_lse = None
    if with_raw:
        raw_lse = torch.logsumexp(raw, dim=-1)
        raw_logp = raw.gather(1, targets[:, None]).squeeze(1) - raw_lse
    logits = raw.mul_(inv_temp[:, None])
    top = logits.amax(dim=-1, keepdim=True)
    unnorm = torch.sub(logits, top).exp_()  # softmax * z
    z = unnorm.sum(dim=-1, keepdim=True)
    lse = (top + z.log()).squeeze(1)
    logp = logits.gather(1, targets[:, None]).squeeze(1) - lse
    # entropy = lse - sum(p * logits); the row dot products as one batched matmul, no temporary
    dot = (unnorm.unsqueeze(1) @ logits.unsqueeze(2)).view(-1) / z.view(-1)
    return logp, lse - dot, lse, raw_logp, raw_lse


def _chunk_backward(lowp: Tensor, targets: Tensor, inv_temp: Tensor, lse: Tensor, scale: Tensor,
                    raw_lse: Tensor | None, raw_scale: Tensor | None, entropy: Tensor | None,
                    ent_scale: Tensor | None, dtype: torch.dtype) -> Tensor:  # fmt: skip
    """d loss / d raw logits of one chunk, in `dtype`: (onehot - p) * scale, plus the untempered term
    (onehot - softmax(raw)) * raw_scale and the entropy's -p * (log p + H) * ent_scale when they are asked."""
    raw = lowp.float()
    g_raw = g_ent = None
    if raw_scale is not None:  # before raw is overwritten
        g_raw = torch.sub(raw, raw_lse[:, None]).exp_().mul_(-raw_scale[:, None])
        g_raw.scatter_add_(1, targets[:, None], raw_scale[:, None])
    logp_all = raw.mul_(inv_temp[:, None]).sub_(lse[:, None])  # tempered log softmax, in place
    if ent_scale is not None:  # before logp_all is overwritten
        g_ent = (logp_all + entropy[:, None]).mul_(logp_all.exp()).mul_(-ent_scale[:, None])
    g = logp_all.exp_()  # tempered softmax, in place
    g.mul_(-scale[:, None]).scatter_add_(1, targets[:, None], scale[:, None])
    if g_ent is not None:
        g.add_(g_ent)
    if g_raw is not None:
        g.add_(g_raw)
    return g.to(dtype)


_COMPILED: dict[str, object] = {}


def _chunk_fns(compiled: bool):
    """The per-chunk functions, eager or torch.compile'd (inductor fuses each into a few passes over the
    logits instead of one per operation; chunk sizes vary, so the shapes are dynamic)."""
    if not compiled:
        return _chunk_forward, _chunk_backward
    if not _COMPILED:
        _COMPILED["forward"] = torch.compile(_chunk_forward, dynamic=True)
        _COMPILED["backward"] = torch.compile(_chunk_backward, dynamic=True)
    return _COMPILED["forward"], _COMPILED["backward"]


class _HeadLogProbs(torch.autograd.Function):
    """log softmax(hidden @ W.T * inv_temp)[target] and the entropy, chunk by chunk.

    Saves only hidden states and one log-sum-exp per token; backward
    recomputes each chunk's logits. d logp / d logits = (onehot - softmax) * inv_temp.
    With `with_raw`, also the untempered log softmax(hidden @ W.T)[target]
    from the same logits (for the KL to the reference model, which is
    scored at T = 1): one head matmul serves both.
    Entropy (of the tempered distribution) is differentiable only with `entropy_grad` (the entropy bonus):
    d H / d logits = -p * (log p + H), recomputed in backward like the rest.
    The matmuls run in the autocast dtype; the softmax arithmetic in fp32 (`_chunk_forward`,
    `_chunk_backward`, compiled with `compiled`).
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        inv_temp: Tensor,
        chunk: int,
        with_raw: bool,
        entropy_grad: bool = False,
        compiled: bool = False,
    ):
        n = hidden.shape[0]
        inv_temp = inv_temp.float()
        forward_chunk, _ = _chunk_fns(compiled)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        raw_logp = torch.empty(n if with_raw else 0, dtype=torch.float32, device=hidden.device)
        raw_lse = torch.empty_like(raw_logp)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            out = forward_chunk(hidden[s:e] @ weight.T, targets[s:e], inv_temp[s:e], with_raw)
            logp[s:e], entropy[s:e], lse[s:e] = out[:3]
            if with_raw:
                raw_logp[s:e], raw_lse[s:e] = out[3:]
            del out
        ctx.save_for_backward(hidden, weight, targets, inv_temp, lse, raw_lse, entropy if entropy_grad else lse[:0])
        ctx.chunk = chunk
        ctx.with_raw = with_raw
        ctx.entropy_grad = entropy_grad
        ctx.compiled = compiled
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros
        return logp, raw_logp, entropy

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_logp: Tensor, grad_raw: Tensor, grad_entropy: Tensor):
        hidden, weight, targets, inv_temp, lse, raw_lse, entropy = ctx.saved_tensors
        _, backward_chunk = _chunk_fns(ctx.compiled)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        n = hidden.shape[0]
        if grad_logp is None:
            grad_logp = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        scale = grad_logp.float() * inv_temp  # d logits / d raw logits = inv_temp
        raw_scale = grad_raw.float() if ctx.with_raw and grad_raw is not None else None
        ent_scale = grad_entropy.float() * inv_temp if ctx.entropy_grad and grad_entropy is not None else None
        device = hidden.device.type
        autocast = torch.is_autocast_enabled(device)
        # g straight in the dtype its matmuls run in (the cast fuses into the chunk's last pass)
        dtype = torch.get_autocast_dtype(device) if autocast else weight.dtype
        for s in range(0, n, ctx.chunk):
            e = min(n, s + ctx.chunk)
            g = backward_chunk(
                hidden[s:e] @ weight.T, targets[s:e], inv_temp[s:e], lse[s:e], scale[s:e],
                None if raw_scale is None else raw_lse[s:e], None if raw_scale is None else raw_scale[s:e],
                None if ent_scale is None else entropy[s:e], None if ent_scale is None else ent_scale[s:e], dtype,
            )  # fmt: skip
            if grad_hidden is not None:
                grad_hidden[s:e] = g @ weight
            if grad_weight is not None:
                h = hidden[s:e].to(weight.dtype)
                if grad_weight.dtype == g.dtype and not autocast:
                    grad_weight.addmm_(g.T, h)
                else:
                    grad_weight += (g.T @ h).float()
            del g
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    inv_temp: Tensor,
    chunk: int = 1024,
    with_raw: bool = False,
    entropy_grad: bool = False,
    compiled: bool = False,
):
    """(logp, raw_logp, entropy) per row of `hidden` [n, d] for `targets` [n] under head `weight` [V, d].

    logp is at each row's temperature (1 / inv_temp); raw_logp at T = 1, or an
    empty tensor without `with_raw`; entropy with a gradient only with `entropy_grad`;
    `compiled`: the per-chunk arithmetic through torch.compile.
    """
    return _HeadLogProbs.apply(hidden, weight, targets, inv_temp, chunk, with_raw, entropy_grad, compiled)


def compile_layers(model: nn.Module, backend: str = "inductor") -> int:
    """torch.compile each decoder layer in place (the classes the model names in `_no_split_modules`, which
    FSDP wraps too): inductor fuses what runs between the matmuls (norms, rotary, activation, residuals),
    one compiled graph for all layers, dynamic shapes (micro-batches differ). Returns how many."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's wrapper
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in base.modules() if type(m).__name__ in names]
    for layer in layers:
        layer.compile(dynamic=True, backend=backend)
    return len(layers)


def head_is_plain(lm: nn.Module, tokens: int = 8) -> bool:
    """Whether `lm`'s logits are its last hidden state times its output embedding, which is all the fused head
    computes: checked on a few tokens, since some models change them in their own forward (Granite divides by
    `logits_scaling`, Cohere multiplies by `logit_scale`, Gemma 2 caps them) and the fused log-probs would then not
    be the sampler's. Run in eval mode (no dropout), without gradients."""
    head = lm.get_output_embeddings()
    if getattr(head, "bias", None) is not None or getattr(lm.config, "final_logit_softcapping", None):
        return False
    if head.weight.is_meta:  # not loaded here (FSDP's rank-0 loading): nothing to compute with, taken as plain
        return True
    ids = torch.arange(min(tokens, head.weight.shape[0]), device=head.weight.device)[None]
    was_training = lm.training
    lm.eval()
    try:
        with torch.no_grad():
            full = lm(input_ids=ids, use_cache=False).logits[0].float()
            hidden = lm.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]
            fused = (hidden @ head.weight.T).float()
    finally:
        lm.train(was_training)
    return bool(torch.allclose(full, fused, rtol=1e-3, atol=1e-3 * float(full.abs().max()) + 1e-5))


def model_mask(model: nn.Module, attention_mask: Tensor | None) -> Tensor | None:
    """A micro-batch's 4-D boolean mask in the form `model`'s attention implementation takes."""
    if attention_mask is None:
        return None
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if "flash" in impl:
        raise ValueError(
            f"layout 'shared_prefix' needs a custom attention mask, which {impl} does not take: "
            "use layout 'packed' (or 'padded') with flash-attention"
        )
    if impl == "eager":  # additive
        dtype = model.get_input_embeddings().weight.dtype
        return torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device).masked_fill_(
            ~attention_mask, torch.finfo(dtype).min
        )
    return attention_mask


def soft_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, raw_logp: Tensor, ids: Tensor,
                  chunk: int = 1024) -> Tensor:  # fmt: skip
    """Untempered log softmax(hidden @ W.T) at `ids` [n, k] (a teacher's top-k tokens at each position), from
    the targets' untempered log-probs `raw_logp` [n] (with grad) and the logits of the k + 1 tokens alone:
    log p(id) = logit(id) - logit(target) + raw_logp. The logits of the targets cancel from the gradient,
    which is (onehot(id) - softmax) as a log softmax's; the vocabulary-wide logits are never made again.
    Each chunk's gathered head rows are recomputed in backward (activation checkpointing), not kept; the
    k + 1 logits are computed in fp32 (the targets' own, in the head's dtype, can differ from them by a
    rounding step: the log-probs' values, not their gradient, carry that)."""
    from torch.utils.checkpoint import checkpoint

    dtype = torch.promote_types(hidden.dtype, torch.float32)  # k + 1 rows a token: cheap in fp32

    def logits(h: Tensor, rows: Tensor) -> Tensor:  # [c, d] x [c, k + 1] -> [c, k + 1]
        with torch.autocast(h.device.type, enabled=False):
            return torch.einsum("cd,ckd->ck", h.to(dtype), weight[rows].to(dtype))

    both = torch.cat([targets[:, None], ids], dim=1)
    parts = [checkpoint(logits, hidden[s : s + chunk], both[s : s + chunk], use_reentrant=False)
             for s in range(0, hidden.shape[0], chunk)]  # fmt: skip
    out = torch.cat(parts) if parts else hidden.new_zeros((0, both.shape[1]), dtype=torch.float32)
    return out[:, 1:] - out[:, :1] + raw_logp[:, None]


class PolicyOutput(NamedTuple):
    logp: Tensor  # [n] at each sequence's sampling temperature, with grad
    raw_logp: Tensor | None  # [n] at T = 1 (with grad) when asked, else None
    entropy: Tensor  # [n] of the tempered distribution; with grad only when the policy has entropy_grad
    values: Tensor | None  # [n] the value head's V before each token (with grad), when the policy has one
    soft_logp: Tensor | None = None  # [n, k] at T = 1 (with grad) of the `soft_ids` asked for (a teacher's top-k)


class PolicyLogProbs(nn.Module):
    """Wraps a causal LM so that its forward returns completion log-probs.

    accelerate prepares this wrapper (DDP / FSDP hook into its forward), so
    the whole computation, head included, happens inside one forward call.
    With `value_head` (PPO's critic as a head on the policy), the forward also
    returns a value per completion token, from the same last hidden state.
    """

    def __init__(
        self,
        lm: nn.Module,
        impl: str = "fused",
        chunk: int = 1024,
        value_head: bool = False,
        entropy_grad=False,
        compiled: bool = False,
    ):
        super().__init__()
        self.lm = lm
        self.compiled = compiled  # the fused head's per-chunk arithmetic through torch.compile
        self.entropy_grad = entropy_grad  # the entropy bonus differentiates the entropy
        self.value_head = new_value_head(lm.config.hidden_size) if value_head else None
        head = lm.get_output_embeddings()
        if impl == "fused" and getattr(head, "bias", None) is not None:
            impl = "full"  # the fused head has no bias term
        if impl == "fused" and getattr(lm.config, "final_logit_softcapping", None):
            impl = "full"  # (a scale in the model's forward: build_models asks head_is_plain first)
        self.impl = impl
        self.chunk = chunk
        # FSDP's transformer auto-wrap looks for the layer classes here.
        self._no_split_modules = getattr(lm, "_no_split_modules", None)

    def _mask(self, attention_mask):
        return model_mask(self.lm, attention_mask)

    def forward(
        self,
        input_ids,
        position_ids,
        rows,
        cols,
        targets,
        inv_temp,
        with_raw: bool = False,
        attention_mask=None,
        soft_ids=None,
    ):
        """Per completion token: PolicyOutput(logp, raw_logp, entropy, values, soft_logp), each [n].

        logp (with grad) is at each sequence's sampling temperature; raw_logp
        (with grad) at T = 1 when `with_raw`, else None; entropy has a grad only with `entropy_grad`;
        values from the value head, else None; soft_logp [n, k] (with grad, T = 1) at `soft_ids` [n, k] when
        given (a teacher's top-k tokens at each position), else None.
        `attention_mask`: a 4-D boolean mask (shared_prefix layout), else None.
        """
        mask = self._mask(attention_mask)
        if self.impl == "fused":
            hidden = self.lm.get_decoder()(
                input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False
            )
            h = hidden.last_hidden_state[rows, cols]
            weight = self.lm.get_output_embeddings().weight
            logp, raw_logp, entropy = head_logprobs(
                h,
                weight,
                targets,
                inv_temp,
                self.chunk,
                with_raw or soft_ids is not None,
                self.entropy_grad,
                self.compiled,
            )
            soft_logp = None
            if soft_ids is not None:
                soft_logp = soft_logprobs(h, weight, targets, raw_logp, soft_ids, self.chunk)
            values = None if self.value_head is None else self.value_head(h.float()).squeeze(-1)
            return PolicyOutput(logp, (raw_logp if with_raw else None), entropy, values, soft_logp)
        # full: the model's own forward, logits only from the first predicting column on.
        first = int(cols.min())
        out = self.lm(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            use_cache=False,
            logits_to_keep=input_ids.shape[1] - first,
            output_hidden_states=self.value_head is not None,
        )
        raw = out.logits[rows, cols - first].float()
        logps = torch.log_softmax(raw * inv_temp[:, None], dim=-1)
        logp = logps.gather(1, targets[:, None]).squeeze(1)
        raw_all = torch.log_softmax(raw, dim=-1) if with_raw or soft_ids is not None else None
        raw_logp = raw_all.gather(1, targets[:, None]).squeeze(1) if with_raw else None
        soft_logp = None if soft_ids is None else raw_all.gather(1, soft_ids)
        if self.entropy_grad:
            entropy = -(logps.exp() * logps).sum(-1)
        else:
            with torch.no_grad():
                entropy = -(logps.exp() * logps).sum(-1)
        values = None
        if self.value_head is not None:
            values = self.value_head(out.hidden_states[-1][rows, cols].float()).squeeze(-1)
        return PolicyOutput(logp, raw_logp, entropy, values, soft_logp)


def new_value_head(hidden_size: int) -> nn.Linear:
    """A linear value head, zero-initialised: every value starts at 0 (the critic learns the scale)."""
    head = nn.Linear(hidden_size, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


class ValueModel(nn.Module):
    """PPO's separate critic: the policy's body (a copy, trained on its own) and a linear value head.

    Its forward takes a micro-batch like PolicyLogProbs's and returns V before each completion token: the
    value of the hidden state at the position that predicts the token.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.body = lm.get_decoder()
        self.config = lm.config
        self.value_head = new_value_head(lm.config.hidden_size)
        self._no_split_modules = getattr(lm, "_no_split_modules", None)

    def forward(self, input_ids, position_ids, rows, cols, attention_mask=None) -> Tensor:
        mask = model_mask(self.body, attention_mask)
        hidden = self.body(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False)
        return self.value_head(hidden.last_hidden_state[rows, cols].float()).squeeze(-1)
