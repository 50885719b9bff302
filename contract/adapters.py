"""What an adapter may target in a model folder: a fact of the adapter format that the learner (finetune.lora)
and the servers (orchestrate.serving.vllm_server: --lora-target-modules) share."""

from __future__ import annotations

import os
from pathlib import Path


def layer_projections(model_dir: str | os.PathLike) -> list[str] | None:
    """The short names of the matrices inside the model's layers (q_proj, ..., down_proj for a Llama), read
    from its safetensors key names (no weight is loaded): what an adapter may target. None: no safetensors.
    The output head and the embeddings are not among them (vLLM's LoRA path for the head breaks prompt
    log-probs of batched requests on this version: vllm-project/vllm#16668)."""
    from safetensors import safe_open

    names: set[str] = set()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                parts = key.split(".")
                if "layers" in parts and parts[-1] == "weight" and len(f.get_slice(key).get_shape()) == 2:
                    names.add(parts[-2])
    return sorted(names) if files else None
