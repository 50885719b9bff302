"""Will the run fit on its GPUs? Estimated before anything starts, refused in one line with the numbers.

Colocated (--server.colocate), one GPU holds in turn:
  generate   the policy server awake (vLLM takes --server.gpu_memory_utilization of the GPU: weights, KV cache,
             graphs), the reference and teacher servers asleep, the learner between batches (its weights and
             optimizer);
  reference  the policy server asleep, the reference (then the teacher's) server awake, the other asleep, the
             learner between batches;
  train      every server asleep, the learner at its peak (gradients and the activations of a micro-batch of
             --train.token_budget tokens on top);
(the servers start one after the other, each asleep before the next starts, so each finds its share free, and
the learner after them). A learner on GPUs of its own is checked against its peak alone.

The learner's figures are estimates: fp32 master weights (4 bytes a parameter) and AdamW's two moments (8),
fp32 gradients (4) while it steps (LoRA: the frozen weights, 4 a parameter, and nothing else that counts), and
activations of ACTIVATION_BYTES per token, layer and hidden unit, calibrated on the H200 measurements of
docs/training.md (Llama-3.2-1B's shape, token budget 16384: peak 61.8 GiB eager, 45.2 GiB compiled). A
sleeping vLLM server keeps its CUDA context and some of its pools (SLEEPING_GIB).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from contract.cli import OptionError

GiB = 2**30
ACTIVATION_BYTES = {"eager": 87, "compiled": 54}  # per token x layer x hidden unit (see above)
SLEEPING_GIB = 1.0  # what a sleeping server still holds of the GPU
SERVER_WORK_GIB = 2.0  # of a server's share, what is neither weights nor KV cache (activations, CUDA graphs)
CONTEXT_GIB = 0.5  # a process's CUDA context (the learner's)


class MemoryPlanError(OptionError):
    """The run does not fit its GPU: one line naming the option to change, with the numbers."""


@dataclass
class Shape:
    """What the estimate needs of a model: its parameters and its decoder's size."""

    parameters: int
    layers: int
    hidden: int

    @classmethod
    def of(cls, model_dir: str | Path) -> Shape:
        """Read from the folder: config.json and the safetensors headers (no weight is loaded)."""
        from safetensors import safe_open

        config = json.loads((Path(model_dir) / "config.json").read_text())
        parameters = 0
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    n = 1
                    for d in f.get_slice(key).get_shape():
                        n *= d
                    parameters += n
        return cls(parameters, int(config["num_hidden_layers"]), int(config["hidden_size"]))


def learner_gib(shape: Shape, train, compiled: bool) -> tuple[float, float]:
    """The learner's GiB between batches and at its peak (see the module's docstring)."""
    lora = train.lora.rank > 0
    resident = shape.parameters * (4 if lora else 12) / GiB
    gradients = 0 if lora else shape.parameters * 4 / GiB
    per_token = ACTIVATION_BYTES["compiled" if compiled else "eager"] * shape.layers * shape.hidden
    activations = train.token_budget * per_token / GiB
    return resident + CONTEXT_GIB, resident + gradients + activations + CONTEXT_GIB


def phases(config, shape: Shape, total_gib: float, compiled: bool, colocated: bool) -> dict[str, float]:
    """GiB each phase needs on the fullest GPU (the learner's peak alone when it does not colocate)."""
    resident, peak = learner_gib(shape, config.train, compiled)
    if not colocated:
        return {"train": peak}
    awake = config.server.gpu_memory_utilization * total_gib
    reference = config.train.needs_reference and not config.reference_on_policy
    scorers = int(reference) + int(bool(config.teacher.model and not config.teacher.url))  # servers of their own
    plan = {"generate": awake + resident + SLEEPING_GIB * scorers}
    if scorers:  # one scorer awake, the policy server and the other scorer asleep
        plan["reference"] = awake + SLEEPING_GIB * scorers + resident
    plan["train"] = SLEEPING_GIB * (1 + scorers) + peak
    return plan


def weights_gib(shape: Shape) -> float:
    """A server's weights: bfloat16, 2 bytes a parameter."""
    return shape.parameters * 2 / GiB


def check(config, shape: Shape, total_gib: float, compiled: bool, colocated: bool,
          teacher: Shape | None = None) -> dict[str, float]:  # fmt: skip
    """The plan, or MemoryPlanError naming the phase that does not fit, its numbers and what to change.
    `teacher`: a teacher's shape when its server shares the GPU; its weights must leave room for a KV cache
    in one server's share (a teacher larger than the student: an 8B teacher, a 1B student)."""
    plan = phases(config, shape, total_gib, compiled, colocated)
    share = config.server.gpu_memory_utilization * total_gib
    if colocated and teacher is not None and weights_gib(teacher) + SERVER_WORK_GIB > 0.9 * share:
        raise MemoryPlanError(
            f"--teacher.model: its weights ({teacher.parameters / 1e9:.2f}B parameters, about "
            f"{weights_gib(teacher):.1f} GiB in bfloat16) leave no room for a KV cache in one server's share of "
            f"the GPU ({config.server.gpu_memory_utilization} x {total_gib:.1f} = {share:.1f} GiB); raise "
            "--server.gpu_memory_utilization, or serve the teacher elsewhere (--teacher.model URL)"
        )
    for phase, need in plan.items():
        if need > total_gib:
            if phase == "train":
                change = ("--train.token_budget (fewer tokens a micro-batch), --train.lora.rank, or "
                          + ("--server.colocate off with GPUs apart" if colocated else "more --trainer.gpus"))  # fmt: skip
            else:
                change = "--server.gpu_memory_utilization (a smaller share for each server)"
            raise MemoryPlanError(
                f"--server.colocate: the {phase} phase needs about {need:.1f} GiB of the GPU's {total_gib:.1f} GiB "
                f"({', '.join(f'{p} {g:.1f}' for p, g in plan.items())} GiB; learner {shape.parameters / 1e9:.2f}B "
                f"parameters, token budget {config.train.token_budget}); lower {change}"
                if colocated
                else f"--train.token_budget: the learner's peak is about {need:.1f} GiB and its GPU has "
                f"{total_gib:.1f} GiB ({shape.parameters / 1e9:.2f}B parameters, token budget "
                f"{config.train.token_budget}); lower {change}"
            )
    return plan


def gpu_totals_gib() -> list[float]:
    """Each visible GPU's memory, asked of a short-lived process: CUDA set up here would hold a context on
    the GPU for the whole run."""
    code = ("import json, torch; print(json.dumps([torch.cuda.get_device_properties(i).total_memory "
            "for i in range(torch.cuda.device_count())]))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return [b / GiB for b in json.loads(out.stdout.strip().splitlines()[-1])] if out.returncode == 0 else []
