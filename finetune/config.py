"""The learner's configuration: one typed model, every field documented.

`finetune.train` turns every field into a command-line option
(`--lr 1e-5`; a loss's own options as `--grpo.clip-eps-high 0.28`) and also reads them from a JSON file (`--config`),
so the orchestrator writes its train section there (RUN/train_config.json). A bad value is
refused with one line naming the field, before any model is loaded.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from finetune.algorithms import ALGORITHMS, with_algorithm
from finetune.algorithms import listing as algorithm_listing
from finetune.estimators import ESTIMATORS, overlong_penalty
from finetune.losses import LOSSES, LossConfig, LossSpec


def _listing(registry) -> str:
    """`name: one line (paper)` of every registered loss or estimator, for --help."""
    return "; ".join(f"{n}: {spec.doc.rstrip('.')} ({spec.paper})" for n, spec in registry.items())


class LoraOptions(BaseModel):
    """LoRA adapters (peft) instead of full fine-tuning: the frozen base weights and a low-rank update
    B @ A * alpha / rank on each target module; only the adapters are trained (and kept in the optimizer)."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(0, ge=0, description="LoRA rank; 0 trains every weight (full fine-tuning).")
    alpha: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="LoRA scaling numerator (alpha / rank); none: 2 x rank."
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] | None = Field(
        None,
        min_length=1,
        description="Names of the modules that get adapters (e.g. q_proj,v_proj); none: every linear layer of "
        "the model but the output head (the attention and MLP projections).",
    )
    start_from: str | None = Field(
        None,
        description="An adapter folder (peft's, e.g. RUN/checkpoints/N/adapter) whose weights the adapters start "
        "from, instead of fresh ones; its rank, alpha and target modules must be these (orchestrate.after.offline "
        "--model ADAPTER sets them from it).",
    )

    roles: list[str] = Field(
        default_factory=list,
        description="Roles with an adapter of their own (the orchestrator's agent.roles bound to `adapter`): each "
        "a second adapter on the same base, trained on that role's samples alone and published beside the "
        "policy's (checkpoints/N/adapter/ROLE/); every other sample trains the policy's adapter.",
    )

    @field_validator("target_modules", "roles", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value

    @field_validator("roles")
    @classmethod
    def _role_folders(cls, roles: list[str]) -> list[str]:
        for role in roles:  # each names a folder inside the adapter's
            if not role or "/" in role or role.startswith(".") or roles.count(role) > 1:
                raise ValueError(f"lora.roles: {role!r} is not a role name of its own (one folder name, each once)")
        return roles

    @model_validator(mode="after")
    def _options_need_a_rank(self) -> LoraOptions:
        fields = type(self).model_fields
        changed = [f for f in sorted(self.model_fields_set - {"rank"})
                   if getattr(self, f) != fields[f].get_default(call_default_factory=True)]  # fmt: skip
        if self.rank == 0 and (extra := changed):  # a dump of the defaults (train_config.json) is fine
            raise ValueError(f"lora.{extra[0]} is set but lora.rank is 0 (full fine-tuning): give lora.rank too")
        return self

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else 2.0 * self.rank) / self.rank


class _TrainOptions(BaseModel):
    """The options every algorithm shares; TrainConfig adds one section per registered loss."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    algorithm: str = Field(
        "grpo",
        description="the algorithm, by name (finetune.algorithms): " + algorithm_listing() + ". It sets loss, "
        "estimator, aggregation and its paper's options; any of them given too is taken as given.",
    )
    loss: str = Field(
        "grpo",
        description="the loss, by name (set by algorithm): "
        + _listing(LOSSES)
        + ". Its options are the section of the same name (--train.ppo.vf_coef 0.5).",
    )
    lr: float = Field(1e-6, gt=0, description="Peak learning rate of AdamW.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="After warm-up: constant, or linear / cosine decay to min_lr_ratio x lr "
        "at total_steps (these two need total_steps).",
    )
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warm-up from 0 to lr.")
    total_steps: int | None = Field(None, gt=0, description="Optimizer steps of the whole run, for decaying schedules.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final lr of a decaying schedule, as a fraction of lr.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this; 0 disables clipping.")
    epochs: int = Field(1, ge=1, description="Passes over each batch.")
    steps_per_epoch: int = Field(
        1, ge=1, description="Optimizer steps per pass: the batch is shuffled and split into this many mini-batches."
    )
    kl_coef: float = Field(
        0.0, ge=0, description="Weight of the k3 KL penalty to the reference log-probs; 0 needs no ref_logprobs."
    )
    teacher_coef: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="On-policy distillation: each trained token's advantage gets teacher_coef x (teacher log-prob "
        "- behaviour log-prob), the negative of the reverse KL to the teacher on that token (needs "
        "teacher_logprobs in the batch); 0: none. The RL loop sets it from --teacher.coef.",
    )
    teacher_topk_coef: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="On-policy distillation from the teacher's top-k: the loss gets teacher_topk_coef x the "
        "cross-entropy from the teacher's k most likely tokens at each trained token's position (renormalised) "
        "to the model's untempered distribution (needs teacher_top_ids in the batch); 0: none. The RL loop "
        "sets it from --teacher.topk_coef when a top-k is asked for.",
    )
    aggregation: Literal["token", "sequence"] = Field(
        "token",
        description="token: mean over all completion tokens of a step; sequence: mean over "
        "sequences of each sequence's token mean.",
    )
    estimator: str = Field(
        "group",
        description="the advantage estimator, by name (set by algorithm; finetune.estimators; any combines with "
        "any loss but ppo, whose critic gives the advantages instead): " + _listing(ESTIMATORS) + ".",
    )
    gamma: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Discount over the turns of an episode: G_t = r_t + gamma * G_{t+1} "
        "(GEM's games use 0.9). One-turn samples are unaffected.",
    )
    normalize_std: bool = Field(
        True, description="Divide advantages by the group (or batch) std; false: Dr. GRPO. rloo never divides."
    )
    std_eps: float = Field(1e-6, gt=0, description="Added to the group std before dividing.")
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="Entropy bonus: coef x the policy's per-token entropy (aggregated like the loss) is "
        "subtracted from the loss; 0: none (entropy is reported every step either way).",
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13): an output longer than "
        "max_tokens - overlong_buffer tokens loses reward linearly, overlong_penalty at max_tokens (the "
        "call's sampling limit, recorded on each turn); 0: off.",
    )
    overlong_penalty: float = Field(1.0, ge=0, description="The reward an output of max_tokens tokens loses.")
    overlong_filter: bool = Field(
        False,
        description="DAPO's overlong filtering: a sample with an output cut by the sampling limit (its finish "
        "reason, recorded on each turn) is not trained on (it still counts in its group's baseline), counted as "
        "overlong_masked.",
    )
    token_budget: int = Field(
        2048,
        ge=16,
        description="Tokens per micro-batch, padding included (rows x longest row). The main "
        "memory knob: SmolLM2-135M fp32 on CPU needs ~2 GB (weights, gradients, AdamW) + ~1.8 MB per token "
        "of budget, so 2048 peaks at ~5.8 GB; gradient checkpointing cuts the per-token part.",
    )
    layout: Literal["padded", "packed", "shared_prefix"] = Field(
        "shared_prefix",
        description="shared_prefix: the completions of one prompt (a GRPO group) share one copy "
        "of it in a row, under a mask where each completion sees the prompt and itself (the prompt's forward and "
        "backward once per group; same result); padded: length-sorted rows, right-padded to the longest in the "
        "micro-batch; packed: sequences concatenated in one row with position ids restarting (for "
        "flash-attention varlen kernels on GPU).",
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="torch.compile the decoder layers and the fused head's softmax arithmetic (fuses the "
        "element-wise work between matmuls; the first step compiles). auto: on with CUDA (not under FSDP, "
        "where it has not run), off on CPU.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward: less memory, ~30% slower."
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Compute dtype. auto: float32 on CPU, bf16 autocast with fp32 weights on GPU."
    )
    save_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="dtype of checkpoint weights; auto: that of the starting model folder."
    )
    lora: LoraOptions = Field(default_factory=LoraOptions, description="LoRA adapters (rank 0: off)")
    save_state_every: int = Field(
        25,
        ge=1,
        description="Write the full trainer state (weights in full precision, optimizer, RNG, critic) every this "
        "many batches and at a clean stop; a learner killed in between resumes from the last one and trains "
        "the batches after it again. 25: on an H200 a 1B model's full state, written in the background "
        "(async_state), costs the learner 2.9% of the step at 25, written before the next batch 12.7% "
        "(docs/weights.md).",
    )
    async_state: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Write the full trainer state from a copy in host memory, taken between steps, in a "
        "background thread while the next batches train (the learner waits only for the copy); off: written "
        "before the next batch starts. auto: on with CUDA (not under FSDP), off on CPU, where the write would "
        "take the cores training needs.",
    )
    save_weights_every: int = Field(
        0,
        ge=0,
        description="Also write the policy as a Hugging Face folder every this many batches when weights go to "
        "the servers in memory (0: only with a full state and at the last batch). With the disk reload, every "
        "batch's folder is written (the servers load it).",
    )
    logprob_impl: Literal["auto", "fused", "full"] = Field(
        "auto",
        description="fused: log-probs from the hidden states in chunks, logits never held whole "
        "(less memory); full: the model's own forward with logits at completion positions. auto: fused, "
        "except under FSDP / DeepSpeed ZeRO-3 where the head's weight is sharded. A model whose forward "
        "scales or caps its logits (Granite, Cohere, Gemma 2: checked on a few tokens at start) takes full.",
    )
    logit_chunk_tokens: int = Field(1024, ge=1, description="fused: completion tokens per chunk of logits.")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of the mini-batch shuffling (with the batch number).")
    colocated: bool = Field(
        False,
        description="The learner's GPUs are time-shared with vLLM servers that sleep while it trains: it gives "
        "back the GPU memory torch caches after each batch, before the checkpoint (set by the orchestrator, "
        "--server.colocate).",
    )
    max_lag: int | None = Field(
        None,
        ge=0,
        description="Samples generated more than this many policy versions before the one training "
        "them (batch b trains version b - 1) are not trained on, and counted (stale_dropped); none: no bound. "
        "The RL loop sets it to run.async_level.",
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Truncated importance sampling (off when none; ~2 when on): "
        "the policy-gradient term of each token is weighted by min(p_trainer / p_vllm, cap), p_trainer the "
        "trainer's probability before the batch's first update, and its ratio is taken against p_trainer.",
    )
    roles: list[str] | None = Field(
        None,
        min_length=1,
        description="Train the samples of these roles only, comma-separated (several agents in one episode: "
        "orchestrate's agent.roles); the others' are left out of the batch (counted, role_dropped). none: every "
        "sample.",
    )

    @field_validator("roles", mode="before")
    @classmethod
    def _roles_comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lstrip().startswith("["):  # a JSON list, as --help's JSON says
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError("expected role names: comma-separated, or a JSON list") from None
        if isinstance(value, str):
            value = [r.strip() for r in value.split(",")]
        if isinstance(value, list) and any(not (isinstance(r, str) and r) for r in value):
            raise ValueError("expected role names, comma-separated, none empty")
        return value

    @model_validator(mode="before")
    @classmethod
    def _algorithm_settings(cls, data: Any) -> Any:
        """The chosen algorithm's settings where not given."""
        return with_algorithm(data) if isinstance(data, dict) else data

    @field_validator("algorithm", "loss", "estimator")
    @classmethod
    def _registered(cls, value: str, info: ValidationInfo) -> str:
        registry, what = {"algorithm": (ALGORITHMS, "algorithm"), "loss": (LOSSES, "loss"),
                          "estimator": (ESTIMATORS, "advantage estimator")}[info.field_name]  # fmt: skip
        if value not in registry:
            raise ValueError(f"unknown {what} {value!r}: one of {', '.join(registry)}")
        return value

    @model_validator(mode="after")
    def _only_the_chosen_section(self) -> _TrainOptions:
        for name in LOSSES:
            section = getattr(self, name, None)
            if name != self.loss and section is not None and section != type(section)():
                raise ValueError(
                    f"{name}: options of loss {name!r} are changed, but the loss is {self.loss!r} (algorithm "
                    f"{self.algorithm}; choose an algorithm with loss {name}, or leave them out)"
                )
        return self

    @property
    def loss_spec(self) -> LossSpec:
        """The chosen loss: its function, options class and whether it trains a critic."""
        return LOSSES[self.loss]

    @property
    def loss_options(self) -> LossConfig:
        """The chosen loss's options (its section)."""
        return getattr(self, self.loss)

    def shaped_reward(self, reward: float, length: int, max_tokens: int | None) -> float:
        """A turn's reward as the estimators see it: the environment's, plus DAPO's soft overlong punishment
        of its output of `length` tokens against its call's sampling limit `max_tokens`, when overlong_buffer
        is on."""
        if not self.overlong_buffer:
            return float(reward)
        if max_tokens is None:
            raise ValueError("overlong_buffer: a turn records no sampling limit (its sample has no turns[].max_tokens "
                             "in the batch file); the buffer is measured against it")  # fmt: skip
        return float(reward) + overlong_penalty(length, max_tokens, self.overlong_buffer, self.overlong_penalty)

    @property
    def needs_reference(self) -> bool:
        """Whether training needs reference log-probs (a KL term in the loss or in the reward)."""
        return self.kl_coef > 0 or self.loss_options.needs_reference()

    @model_validator(mode="after")
    def _schedule_has_length(self) -> _TrainOptions:
        if self.lr_schedule != "constant" and self.total_steps is None:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} needs total_steps (or use lr_schedule=constant)")
        if self.total_steps is not None and self.total_steps <= self.warmup_steps and self.lr_schedule != "constant":
            raise ValueError("total_steps must be larger than warmup_steps")
        return self

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / (self.warmup_steps + 1)
        if self.lr_schedule == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        if self.lr_schedule == "linear":
            factor = 1 - progress
        else:
            import math

            factor = 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * factor)


TrainConfig = create_model(
    "TrainConfig",
    __base__=_TrainOptions,
    __module__=__name__,
    __doc__="Hyper-parameters of the learner and how to run them: the shared options, then one section per "
    "registered loss (finetune.losses.register_loss) holding that loss's own options.",
    **{
        name: (spec.config, Field(default_factory=spec.config, description=f"options of loss {name}"))
        for name, spec in LOSSES.items()
    },
)


def own_choices(saved: dict) -> dict:
    """Of a saved train config (a dump: every field there), the options that differ from what its algorithm
    sets by default, without the algorithm: what to keep when another algorithm is given on top of it
    (offline training on a run's tapes). DAPO's overlong buffer, set from the sampling limit, goes too."""
    old = saved.get("algorithm", "grpo")
    try:
        defaults = TrainConfig.model_validate({"algorithm": old}).model_dump(mode="json")
    except ValidationError:
        return {k: v for k, v in saved.items() if k != "algorithm"}

    def differ(ours: dict, base: dict) -> dict:
        out = {}
        for key, value in ours.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                if nested := differ(value, base[key]):
                    out[key] = nested
            elif key not in base or base[key] != value:
                out[key] = value
        return out

    chosen = differ({k: v for k, v in saved.items() if k != "algorithm"}, defaults)
    if ALGORITHMS.get(old) is not None and ALGORITHMS[old].overlong_fraction:
        chosen.pop("overlong_buffer", None)
    return chosen
