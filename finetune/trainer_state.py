"""The trainer's state, to resume from: trainer_state/ (weights in full precision, optimizer states, RNG, a
separate critic's model and optimizer, progress.json with the optimizer step) written through accelerate's
save_state, now or from a host-memory copy taken now and written by a thread while training goes on
(TrainConfig.async_state), and read back. With LoRA it holds the trainable weights only (the adapters, a value
head); the frozen base is the initial model's, loaded at start."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from accelerate.utils import DistributedType

from contract.rundir import TRAINER_PROGRESS, TRAINER_STATE_DIR
from finetune.config import TrainConfig
from finetune.models import Models
from finetune.staging import HostStage, host_memory_available


class TrainerState:
    def __init__(self, models: Models, config: TrainConfig):
        self.models, self.config = models, config
        acc = models.accelerator
        if config.lora.rank > 0:  # its trainer state holds the adapters (and a value head), not the frozen base
            acc.register_save_state_pre_hook(trainable_only)
        if config.async_state == "on" and acc.distributed_type == DistributedType.FSDP:
            raise ValueError("--train.async_state on: not under FSDP, whose state is saved through its own sharded "
                             "path; use auto or off")  # fmt: skip
        self.stage = HostStage(acc.device)  # host copies of the trainer state (stage)
        self.in_background, self.background_why = self.background_choice()

    def background_choice(self) -> tuple[bool, str]:
        """Whether the full trainer state is written from a host-memory copy while training goes on
        (TrainConfig.async_state), and why. auto: with CUDA, not under FSDP (whose state is saved through its
        own sharded path), and when the copy (the trained weights and AdamW's two moments) takes at most half
        the host memory available."""
        on, acc = self.config.async_state, self.models.accelerator
        if on != "auto":
            return on == "on", f"--train.async_state {on}"
        if acc.device.type != "cuda":
            return False, "auto: not on CUDA (on CPU the write would take the cores training needs)"
        if acc.distributed_type == DistributedType.FSDP:
            return False, "auto: FSDP saves its sharded state itself"
        trained = self.models.trained()
        copy = 3 * sum(p.numel() * p.element_size() for m in trained for p in m.parameters() if p.requires_grad)
        available = host_memory_available()
        if available is not None and copy > available / 2:
            return False, (f"auto: its copy ({copy / 2**30:.1f} GiB) would take more than half the host memory "
                           f"available ({available / 2**30:.1f} GiB)")  # fmt: skip
        return True, f"auto: on CUDA, a copy of {copy / 2**30:.1f} GiB in page-locked host memory"

    def save(self, folder: str | os.PathLike, progress: dict) -> None:
        """trainer_state/ (weights in full precision, optimizer states, RNG, PPO's critic, progress) to
        resume from. Every process must call it (each adds its own RNG state)."""
        acc = self.models.accelerator
        acc.save_state(str(Path(folder) / TRAINER_STATE_DIR))
        if acc.is_main_process:
            (Path(folder) / TRAINER_STATE_DIR / TRAINER_PROGRESS).write_text(
                json.dumps({**progress, "optimizer_step": self.models.step}) + "\n"
            )
        acc.wait_for_everyone()

    def stage_state(self, folder: str | os.PathLike, progress: dict) -> Callable[[], None]:
        """What `save` writes, copied now (finetune.staging) and written by the function returned, which may
        run in another thread while training goes on: the same files, so `load` reads them. Every process
        must call it between steps (each adds its own RNG state, taken now); the function writes on each
        process what it holds."""
        from accelerate.checkpointing import save_accelerator_state

        acc = self.models.accelerator
        state_dir = Path(folder) / TRAINER_STATE_DIR
        taken = Path(folder) / f".taken-{acc.process_index}"  # what is taken now: RNG (and a loss scaler)
        for d in (state_dir, taken):
            d.mkdir(parents=True, exist_ok=True)
        at = dict(process_index=acc.process_index, step=acc.step,
                  save_on_each_node=acc.project_configuration.save_on_each_node)  # fmt: skip
        save_accelerator_state(taken, [], [], [], [], scaler=acc.scaler, **at)
        weights, optimizers = [], []
        if acc.is_main_process or at["save_on_each_node"]:  # accelerate writes these on the main process only
            models = self.models.trained()
            weights = [acc.get_state_dict(m, unwrap=False) for m in models]  # as Accelerator.save_state takes them
            if self.config.lora.rank > 0:
                trainable_only(models, weights, str(state_dir))
            optimizers = self.models.optimizers()
            weights, states = self.stage.copy((weights, [o.state_dict() for o in optimizers]), "state")
            optimizers = [_Taken(s) for s in states]
        step = self.models.step

        def write() -> None:
            save_accelerator_state(state_dir, weights, optimizers, [], [], scaler=None, **at)
            for path in taken.iterdir():
                os.replace(path, state_dir / path.name)
            taken.rmdir()
            if acc.is_main_process:
                (state_dir / TRAINER_PROGRESS).write_text(json.dumps({**progress, "optimizer_step": step}) + "\n")

        return write

    def load(self, folder: str | os.PathLike) -> dict:
        """Restore weights, optimizer state and step count from a checkpoint's trainer_state/; its progress.

        The models must be built from the run's initial model (its architecture, tied head included); the
        weights come from here."""
        folder = Path(folder) / TRAINER_STATE_DIR
        acc = self.models.accelerator
        if self.config.lora.rank > 0 and acc.distributed_type != DistributedType.FSDP:
            self._check_trainable(folder)
            acc.load_state(str(folder), strict=False)  # the frozen base is not in it
        else:
            acc.load_state(str(folder))
        progress = json.loads((folder / TRAINER_PROGRESS).read_text())
        self.models.step = int(progress["optimizer_step"])
        return progress

    def _check_trainable(self, folder: Path) -> None:
        """A LoRA trainer state holds exactly this learner's trainable weights (the same rank and target
        modules), or resuming from it is refused."""
        from safetensors import safe_open

        file = folder / "model.safetensors"
        if not file.is_file():
            raise ValueError(f"{folder} has no model.safetensors to resume the adapters from")
        with safe_open(str(file), "pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        ours = {n: tuple(p.shape) for n, p in self.models.model.named_parameters() if p.requires_grad}
        if saved != ours:
            differ = sorted(set(saved.items()) ^ set(ours.items()))[:1]
            raise ValueError(f"{folder} holds other trainable weights than this learner's LoRA options "
                             f"(e.g. {differ[0][0]} {list(differ[0][1])}): resume with the run's own options")  # fmt: skip


def trainable_only(models: list, weights: list, output_dir: str) -> None:
    """accelerate's save-state hook with LoRA: the policy's saved weights are its trainable ones (the
    adapters, a value head); the frozen base is the initial model's, loaded at start."""
    if not weights:  # FSDP saves through its own path: the whole model
        return
    trainable = {n for n, p in models[0].named_parameters() if p.requires_grad}
    weights[0] = {k: v for k, v in weights[0].items() if k in trainable}


class _Taken:
    """An optimizer's state dict taken at one moment, for save_accelerator_state (which asks for state_dict())."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state
