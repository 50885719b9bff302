"""Building what the learner trains: the policy (a causal LM, with LoRA adapters when asked, its decoder layers
compiled where that pays), its optimizer and, for a loss with a critic, the critic's value head or separate
value model with its optimizer, all prepared by accelerate (DDP or FSDP across processes).

Weights stay fp32 (master copy); bf16 on a GPU comes from accelerate's autocast. With LoRA the frozen base is
held in bf16 on a GPU (it gets no update), the adapters in fp32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from finetune.config import TrainConfig
from finetune.critic import Critic
from finetune.logprobs import PolicyLogProbs, ValueModel, compile_layers, head_is_plain
from finetune.lora import load_adapter_weights, with_lora


def mixed_precision_for(config: TrainConfig) -> str | None:
    """accelerate's mixed_precision for config.dtype (None: what the launcher set)."""
    if config.dtype == "bfloat16":
        return "bf16"
    if config.dtype == "float32":
        return "no"
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return None
    return "bf16" if torch.cuda.is_available() else "no"


@dataclass
class Models:
    """The prepared models and optimizers, and how many optimizer steps they have taken over the run."""

    accelerator: Accelerator
    model: torch.nn.Module  # the policy (PolicyLogProbs), with a value head for a critic of kind head
    optimizer: torch.optim.Optimizer
    value_model: torch.nn.Module | None  # a separate critic's value model
    value_optimizer: torch.optim.Optimizer | None
    critic: Critic | None  # the loss's critic (finetune.critic), which gives the advantages
    lora_config: object | None  # peft's LoraConfig, with LoRA
    pad_id: int
    step: int = 0  # optimizer steps taken so far, over the whole run
    vocab_size: int | None = None  # the policy's output rows (a teacher's top-k id beyond them is left out)

    def trained(self) -> list[torch.nn.Module]:
        """The prepared models in accelerate's order (the policy, a separate critic's value model)."""
        return [m for m in (self.model, self.value_model) if m is not None]

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.optimizer, self.value_optimizer) if o is not None]


def build_models(model_dir: Path, config: TrainConfig, acc: Accelerator) -> Models:
    """The policy, its optimizer and the critic's parts, built from `model_dir` and prepared by `acc`."""
    if acc.distributed_type == DistributedType.DEEPSPEED:
        raise ValueError(
            "DeepSpeed is not supported: a step has a variable number of micro-batches, which DeepSpeed's "
            "fixed gradient accumulation cannot express. Use FSDP (finetune/accelerate/multi_gpu_fsdp.yaml)."
        )
    if config.lora.roles and acc.num_processes > 1:
        raise ValueError("lora.roles: adapters of their own for roles are trained in one learner process (each "
                         "micro-batch applies one adapter, which DDP and FSDP see as unused weights); launch one")  # fmt: skip
    lm, lora_config = _language_model(model_dir, config, acc.device.type == "cuda")
    head_rows = int(lm.get_output_embeddings().weight.shape[0])
    impl = config.logprob_impl
    if impl == "auto":
        impl = "full" if acc.distributed_type == DistributedType.FSDP else "fused"
    if impl == "fused" and not head_is_plain(lm):  # before compiling: a forward here would compile the layers
        print(f"logprob_impl full: {type(lm).__name__} changes its logits in its forward (scaled or capped), "
              "which the fused head would not", flush=True)  # fmt: skip
        impl = "full"
    # auto: on a GPU, not under FSDP (compiled layers inside FSDP's wrapping have not run here)
    compiled = config.compile == "on" or (
        config.compile == "auto" and acc.device.type == "cuda" and acc.distributed_type != DistributedType.FSDP
    )
    if compiled:
        compile_layers(lm)
    pad_id = lm.config.pad_token_id if isinstance(lm.config.pad_token_id, int) else 0
    spec = config.loss_spec
    # a loss with a critic (PPO's, finetune.critic) takes its advantages from it, not from an estimator
    critic = (spec.critic(config.loss_options, config.gamma, config.std_eps, config.shaped_reward)
              if spec.critic is not None else None)  # fmt: skip
    head = critic is not None and critic.value_head
    policy = PolicyLogProbs(
        lm, impl, config.logit_chunk_tokens, value_head=head, entropy_grad=config.entropy_coef > 0, compiled=compiled
    )
    policy.train()
    trainable = [p for n, p in policy.named_parameters() if not n.startswith("value_head.") and p.requires_grad]
    groups = [{"params": trainable, "base_lr": config.lr}]
    if head:
        groups.append({"params": list(policy.value_head.parameters()), "base_lr": critic.lr})
    optimizer = _adamw(groups, config.lr_at(0), config)
    if critic is None or head:
        model, optimizer = acc.prepare(policy, optimizer)
        value_model = value_optimizer = None
    else:
        value_model = _value_model(model_dir, config, compiled)
        value_optimizer = _adamw([{"params": list(value_model.parameters()), "base_lr": critic.lr}], critic.lr, config)
        model, optimizer, value_model, value_optimizer = acc.prepare(policy, optimizer, value_model, value_optimizer)
    # the head's rows, not config.vocab_size: a top-k id between the two would index past the head
    return Models(acc, model, optimizer, value_model, value_optimizer, critic, lora_config, pad_id,
                  vocab_size=head_rows)  # fmt: skip


def _language_model(model_dir: Path, config: TrainConfig, cuda: bool):
    """The causal LM to train and peft's LoraConfig (None without LoRA)."""
    from transformers import AutoModelForCausalLM

    lora = config.lora
    frozen_bf16 = lora.rank > 0 and cuda
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if frozen_bf16 else torch.float32)
    lm.config.use_cache = False
    lora_config = None
    if lora.rank > 0:
        lm, lora_config = with_lora(lm, lora, config.seed)
        if lora.start_from:
            load_adapter_weights(lm, lora.start_from)
    if config.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return lm, lora_config


def _value_model(model_dir: Path, config: TrainConfig, compiled: bool) -> ValueModel:
    """oat's choice of critic: a separate value model, initialised from the policy's weights."""
    from transformers import AutoModelForCausalLM

    body = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    body.config.use_cache = False
    if config.gradient_checkpointing:
        body.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compiled:
        compile_layers(body)
    value_model = ValueModel(body)
    del body  # the value model keeps the body; the LM head goes
    value_model.train()
    return value_model


def _adamw(groups: list[dict], lr: float, config: TrainConfig) -> torch.optim.AdamW:
    betas = (config.adam_beta1, config.adam_beta2)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=config.adam_eps, weight_decay=config.weight_decay)
