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

On CPU (no GPU visible) the servers started here, the learner and the orchestrator share the machine's memory
at once: each server its processes (CPU_SERVER_BASE_GIB + CPU_SERVER_PER_WEIGHT x its fp32 weights, fitted to
two servers measured on 2026-12-07: SmolLM2-135M's 2.9 GiB at 0.5 GiB of weights, Qwen2.5-Coder-0.5B's 4.1 at
2.35, beside their KV caches) and its --server.kv_cache_gib, the learner its peak with the CPU's activations
(CPU_ACTIVATION_BYTES per token, layer and hidden + MLP unit: the 0.5B's LoRA learner peaked at 13.0 GiB at a
token budget of 2048, 36 bytes; SmolLM2's 1.8 MB a token, docs/training.md, is 28), the orchestrator and the
launcher CPU_ORCHESTRATOR_GIB. The sum must fit the memory available when the run starts (check_cpu).
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
CPU_ACTIVATION_BYTES = 36  # per token x layer x (hidden + MLP) unit, the learner on CPU (see above)
SLEEPING_GIB = 1.0  # what a sleeping server still holds of the GPU
SERVER_WORK_GIB = 2.0  # of a server's share, what is neither weights nor KV cache (activations, CUDA graphs)
CONTEXT_GIB = 0.5  # a process's CUDA context (the learner's)
CPU_SERVER_BASE_GIB = 2.6  # a vLLM CPU server's processes beyond its weights' term and KV cache (see above)
CPU_SERVER_PER_WEIGHT = 1.65  # GiB per GiB of fp32 weights (the weights and what grows with them)
CPU_ORCHESTRATOR_GIB = 2.0  # the orchestrator (its tokenizer, tapes in flight) and accelerate's launcher


class MemoryPlanError(OptionError):
    """The run does not fit its GPU: one line naming the option to change, with the numbers."""


@dataclass
class Shape:
    """What the estimate needs of a model: its parameters and its decoder's size."""

    parameters: int
    layers: int
    hidden: int
    intermediate: int = 0  # the MLP's width (config.json's intermediate_size; the CPU estimate counts it)

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
        return cls(parameters, int(config["num_hidden_layers"]), int(config["hidden_size"]),
                   int(config.get("intermediate_size") or 0))  # fmt: skip


def learner_gib(shape: Shape, train, compiled: bool, cpu: bool = False) -> tuple[float, float]:
    """The learner's GiB between batches and at its peak (see the module's docstring)."""
    lora = train.lora.rank > 0
    resident = shape.parameters * (4 if lora else 12) / GiB
    gradients = 0 if lora else shape.parameters * 4 / GiB
    if cpu:
        per_token = CPU_ACTIVATION_BYTES * shape.layers * (shape.hidden + (shape.intermediate or 4 * shape.hidden))
    else:
        per_token = ACTIVATION_BYTES["compiled" if compiled else "eager"] * shape.layers * shape.hidden
    activations = train.token_budget * per_token / GiB
    context = 0 if cpu else CONTEXT_GIB
    return resident + context, resident + gradients + activations + context


def cpu_server_gib(shape: Shape, kv_cache_gib: float) -> float:
    """A vLLM server on CPU: its processes, its fp32 weights' term and its KV cache (module docstring)."""
    return CPU_SERVER_BASE_GIB + CPU_SERVER_PER_WEIGHT * shape.parameters * 4 / GiB + kv_cache_gib


def cpu_plan(config, policy: Shape, teacher: Shape | None = None, roles: list[Shape] = ()) -> dict[str, float]:
    """GiB of the machine's memory each part of a CPU run holds at its peak: the servers started here (`roles`:
    the frozen models roles are bound to, a server each), the learner (started here), the orchestrator."""
    s, kv = config.server, config.server.kv_cache_gib
    servers = 0.0 if s.policy_urls else s.policy_servers * cpu_server_gib(policy, kv)
    if config.train.needs_reference and not config.reference_on_policy and not s.reference_url:
        servers += cpu_server_gib(policy, kv)
    if config.teacher.model and not config.teacher.url and teacher is not None:
        servers += cpu_server_gib(teacher, kv)
    servers += sum(cpu_server_gib(shape, kv) for shape in roles)
    plan = {"servers": servers}
    if config.trainer.launch == "local":
        plan["learner"] = learner_gib(policy, config.train, compiled=False, cpu=True)[1]
    plan["orchestrator"] = CPU_ORCHESTRATOR_GIB
    return plan


def check_cpu(config, policy: Shape, total_gib: float, available: float | None = None,
              teacher: Shape | None = None, roles: list[Shape] = ()) -> tuple[dict[str, float], str | None]:  # fmt: skip
    """The CPU run's plan and a note when it passes the memory `available` now (something else holds it), or
    MemoryPlanError when it passes the machine's `total_gib`: the numbers and what to lower."""
    plan = cpu_plan(config, policy, teacher, roles)
    need = sum(plan.values())
    parts = (f"{', '.join(f'{p} {g:.1f}' for p, g in plan.items())} GiB; policy {policy.parameters / 1e9:.2f}B "
             f"parameters, {'full fine-tuning' if config.train.lora.rank == 0 else 'LoRA'}, token budget "
             f"{config.train.token_budget}, KV cache {config.server.kv_cache_gib} GiB a server")  # fmt: skip
    if need > total_gib:
        teacher_gib = cpu_server_gib(teacher, config.server.kv_cache_gib) if teacher is not None else 0.0
        if (
            plan["servers"] >= plan.get("learner", 0.0)
            and teacher_gib
            and config.teacher.model
            and not config.teacher.url
        ):
            option, lower = "--teacher.model", (
                f"its server ({teacher.parameters / 1e9:.2f}B parameters in fp32, about {teacher_gib:.1f} GiB) does not "
                "fit beside the policy's and the learner: serve it on another machine (`uv run -m orchestrate.serve "
                "--role teacher`) and give its URL")  # fmt: skip
        elif plan["servers"] >= plan.get("learner", 0.0) and roles:
            option, lower = "--agent.roles", (
                f"the servers of the models roles are bound to ({len(roles)}, about "
                f"{sum(cpu_server_gib(r, config.server.kv_cache_gib) for r in roles):.1f} GiB) do not fit beside the "
                "policy's and the learner: serve them on another machine and give their URLs, or lower "
                "--server.kv_cache_gib")  # fmt: skip
        elif plan["servers"] >= plan.get("learner", 0.0):
            option, lower = "--server.kv_cache_gib", "lower --server.kv_cache_gib or --train.token_budget"
        else:
            lora = ", train LoRA adapters (--train.lora.rank 16)" if config.train.lora.rank == 0 else ""
            option, lower = "--train.token_budget", f"lower --train.token_budget{lora} or --server.kv_cache_gib"
        raise MemoryPlanError(
            f"{option}: the run needs about {need:.1f} GiB of memory and this machine has {total_gib:.1f} GiB "
            f"({parts}); {lower}"
        )
    if available is not None and need > available:
        return plan, (f"note: the run needs about {need:.1f} GiB of memory and {available:.1f} GiB is available now "
                      f"({parts}): what else runs here may have to stop")  # fmt: skip
    return plan, None


def memory_gib(field: str) -> float:
    """/proc/meminfo's `field` (MemTotal, MemAvailable) in GiB; inf where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    return float("inf")


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
