"""The adapter folder's format (peft's), as both processes read it: what an adapter may target in a model
folder (the learner, finetune.lora, and the servers: orchestrate.serving.vllm_server's --lora-target-modules),
whether a folder is an adapter, whether it fits a base model, and the options it was trained with (a LoRA
run's versions: orchestrate.after.merge, orchestrate.after.offline's start_from). The learner writes it: finetune.lora."""

from __future__ import annotations

import json
import os
from pathlib import Path

from contract.rundir import ADAPTER_CONFIG

ADAPTER_WEIGHTS = "adapter_model.safetensors"
SAVED_PREFIX = "base_model.model."  # peft's prefix of the keys in a saved adapter


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


def adapter_options(folder: str | os.PathLike) -> dict:
    """The lora options (finetune.config.LoraOptions) an adapter folder was trained with, start_from it."""
    saved = json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
    options = {"rank": int(saved["r"]), "alpha": float(saved.get("lora_alpha") or 2 * saved["r"]),
               "dropout": float(saved.get("lora_dropout") or 0.0), "start_from": str(Path(folder).resolve())}  # fmt: skip
    if targets := saved.get("target_modules"):
        options["target_modules"] = sorted([targets] if isinstance(targets, str) else targets)
    return options


def is_adapter(folder: str | os.PathLike) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def adapter_mismatch(adapter: str | os.PathLike, base: str | os.PathLike) -> str | None:
    """None when the adapter folder fits the base model folder (its target modules are the model's, each
    A and B shaped for that module), else what does not fit. Reads shapes only, loads no weights."""
    from safetensors import safe_open

    adapter, base = Path(adapter), Path(base)
    if not is_adapter(adapter):
        return f"{adapter} is not an adapter folder (no {ADAPTER_CONFIG})"
    if not (adapter / ADAPTER_WEIGHTS).is_file():
        return f"{adapter} has no {ADAPTER_WEIGHTS}"
    shapes = {}
    for file in sorted(base.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    if not shapes:
        return f"{base} has no safetensors weights"
    with safe_open(str(adapter / ADAPTER_WEIGHTS), "pt") as f:
        for key in f.keys():
            module = key.removeprefix(SAVED_PREFIX).rsplit(".lora_", 1)[0]
            weight = shapes.get(f"{module}.weight")
            if weight is None:
                return f"the adapter has a layer {module} that {base} does not"
            out_features, in_features = weight
            shape = tuple(f.get_slice(key).get_shape())
            if ".lora_A." in key and shape[1] != in_features or ".lora_B." in key and shape[0] != out_features:
                return f"the adapter's {key} {list(shape)} does not fit {module} {list(weight)} of {base}"
    return None
