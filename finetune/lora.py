"""LoRA adapters (peft) in the learner, and the adapter folder it publishes for vLLM.

With `--train.lora.rank R` the learner injects adapters into the model in place (`with_lora`): the
model's own weights are frozen and the optimizer holds the adapters only. Each version is published as a
peft adapter folder (`write_adapter`: adapter_model.safetensors, then adapter_config.json, the file that
says the folder is whole), which vLLM loads by path (`POST /v1/load_lora_adapter`) and peft loads onto the
base model (`PeftModel.from_pretrained`). `merged` folds an adapter into the base weights, for a plain
model folder (`uv run -m orchestrate.after.merge`).

Names: inside the learner a LoRA layer's tensors are peft's `X.base_layer.weight`,
`X.lora_A.default.weight` and `X.lora_B.default.weight`; in an adapter file they are
`base_model.model.X.lora_A.weight` (peft's saved form, which vLLM reads too).

Roles with an adapter of their own (`lora.roles`, the orchestrator's agent.roles bound to `adapter`): each is a
second adapter on the same layers (peft's `roleI`, by the role's place in lora.roles: a role's name may hold
dots, which peft's names may not), trained on that role's samples alone: every micro-batch holds one
adapter's samples and `activate`s it (peft trains the active adapter of a forward pass). They are published
beside the policy's in peft's layout for several adapters (adapter/ROLE/, contract.rundir.role_adapters).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import torch

from contract.adapters import ADAPTER_WEIGHTS, SAVED_PREFIX
from contract.rundir import ADAPTER_CONFIG

ADAPTER = "default"  # peft's name of the policy's adapter


def role_adapter(lora, role: str | None) -> str:
    """peft's name of the adapter that trains `role`'s samples: the role's own (lora.roles), else the policy's."""
    return f"role{lora.roles.index(role)}" if role is not None and role in lora.roles else ADAPTER


def activate(lm, name: str) -> None:
    """Make adapter `name` the one `lm`'s LoRA layers apply (a role's own, or the policy's). peft's set_adapter
    also freezes the others: they stay trainable here (the optimizer and the trainer state hold every adapter;
    one not applied in a forward pass gets no gradient and no update)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in lm.modules():
        if isinstance(module, BaseTunerLayer):
            module.set_adapter(name)
    for key, param in lm.named_parameters():
        if ".lora_A." in key or ".lora_B." in key:
            param.requires_grad_(True)


def with_lora(lm, lora, seed: int = 0):
    """`lm` with LoRA adapters injected in place, and peft's LoraConfig (its target modules resolved). A
    target module the model does not have is refused with the names it has. The adapters' initial A
    matrices are drawn from `seed` (the same in every process and every run of the same options)."""
    from peft import LoraConfig, get_peft_model

    inside = sorted({n.split(".")[-1] for n, m in lm.named_modules()
                     if isinstance(m, torch.nn.Linear) and ".layers." in f".{n}."})  # fmt: skip
    if missing := [t for t in lora.target_modules or [] if t not in inside]:
        raise ValueError(f"lora.target_modules: {', '.join(missing)} is not a linear module inside the model's "
                         f"layers; those are {', '.join(inside)}")  # fmt: skip
    config = LoraConfig(r=lora.rank, lora_alpha=lora.scale * lora.rank, lora_dropout=lora.dropout,
                        target_modules=lora.target_modules or inside, bias="none")  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(lm, config, autocast_adapter_dtype=True)
        for role in lora.roles:  # each role's own adapter, on the same layers
            peft_model.add_adapter(role_adapter(lora, role), copy.deepcopy(peft_model.peft_config[ADAPTER]))
    if lora.roles:
        activate(peft_model.get_base_model(), ADAPTER)  # every adapter trainable, the policy's applied
    return peft_model.get_base_model(), peft_model.peft_config[ADAPTER]


def load_adapter_weights(lm, folder: str | os.PathLike) -> None:
    """Copy an adapter folder's A and B into `lm`'s injected adapters (with_lora), in place. ValueError
    naming the first difference when the folder's tensors are not exactly the injected ones (names, shapes)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"lora.start_from: {folder} has no {ADAPTER_WEIGHTS}")
    saved = load_file(str(folder / ADAPTER_WEIGHTS))
    params = {SAVED_PREFIX + n.replace(f".{ADAPTER}.", "."): p for n, p in lm.named_parameters()
              if f".lora_A.{ADAPTER}." in n or f".lora_B.{ADAPTER}." in n}  # fmt: skip
    if differ := sorted(set(saved) ^ set(params)):
        where = "the folder" if differ[0] in saved else "these lora options"
        raise ValueError(f"lora.start_from: {folder} does not fit the adapters of these lora options: {differ[0]} "
                         f"is only in {where} (rank, target modules and base model must be the folder's)")  # fmt: skip
    for key, param in params.items():
        if tuple(saved[key].shape) != tuple(param.shape):
            raise ValueError(f"lora.start_from: {folder}'s {key} is {list(saved[key].shape)}, these lora options "
                             f"make it {list(param.shape)} (the folder's rank is another)")  # fmt: skip
    with torch.no_grad():
        for key, param in params.items():
            param.copy_(saved[key].to(param.dtype))


def adapter_tensors(lm_state: dict, name: str = ADAPTER) -> dict:
    """Adapter `name`'s tensors of a learner's state dict (the language model's keys), named as peft saves
    them."""
    out = {}
    for key, value in lm_state.items():
        if f".lora_A.{name}." in key or f".lora_B.{name}." in key:
            out[SAVED_PREFIX + key.replace(f".{name}.", ".")] = value
    return out


def merged(state: dict, scale: float) -> dict:
    """A learner's state dict with LoRA layers as the plain model's: `X.weight` = base + B @ A * scale,
    in fp32."""
    out = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key or ".lora_dropout" in key:
            continue
        if key.endswith(".base_layer.weight"):
            module = key.removesuffix(".base_layer.weight")
            a = state[f"{module}.lora_A.{ADAPTER}.weight"].float()
            b = state[f"{module}.lora_B.{ADAPTER}.weight"].float()
            out[f"{module}.weight"] = value.float() + (b @ a) * scale
        else:
            out[key.replace(".base_layer.", ".")] = value
    return out


def write_adapter(folder: str | os.PathLike, tensors: dict, config, base_model: str | os.PathLike) -> Path:
    """An adapter folder peft and vLLM load: the tensors (adapter_tensors), then adapter_config.json last
    (moved in from aside, so a folder with it is whole)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    aside = folder.parent / f".tmp-{folder.name}"
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(aside / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})  # fmt: skip
    saved = config.to_dict()
    saved["target_modules"] = sorted(saved["target_modules"]) if saved.get("target_modules") else None
    saved["base_model_name_or_path"] = str(base_model)
    saved["inference_mode"] = True
    (aside / ADAPTER_CONFIG).write_text(json.dumps(saved, indent=2, sort_keys=True, default=_jsonable) + "\n")
    folder.mkdir(parents=True, exist_ok=True)
    os.replace(aside / ADAPTER_WEIGHTS, folder / ADAPTER_WEIGHTS)
    os.replace(aside / ADAPTER_CONFIG, folder / ADAPTER_CONFIG)
    aside.rmdir()
    return folder


def _jsonable(value):
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    if hasattr(value, "value"):  # enums (task_type, peft_type)
        return value.value
    return str(value)
