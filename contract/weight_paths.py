"""The one table of weight paths: how each new policy version gets from the learner into the policy servers.

A mechanism has two ends, each a class named here by its dotted path and loaded only by the process that
uses it (so this module imports neither side, nor torch): the learner's publisher (finetune.publish.base.
Publisher: writes or sends a version) and the orchestrator's transport (orchestrate.serving.weights.Transport:
puts a version on every policy server). The command line maps onto this table: `--server.weight_transfer`
takes the names of the mechanisms that are options, and `--train.lora.rank` above 0 selects the adapter
mechanism (`select`). Outside this table and each mechanism's own files nothing compares a mechanism's
name (tests/test_weight_paths.py): the loop, the option checks and the servers read the properties below.
Adding a mechanism is one file per end and one `register` call here (docs/weights.md,
"Adding a weight transport").

The run folder carries the announcement between the two ends: RUN/weight_group.json's "backend" is the name
of the mechanism the orchestrator set up (absent or null: none yet, and the learner publishes by the default).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# The swap timings of the client (orchestrate.serving.llm.VLLMClient.swap_weights): new calls wait while the
# calls in flight finish ("drain"), the calls in flight are paused between two engine steps ("keep", with
# --run.in_flight_swaps), or nothing waits: each version is served under a name of its own ("adapter").
DRAIN, KEEP, ADAPTER = "drain", "keep", "adapter"

# vLLM weight-transfer engines of ours, by the name a server is started with (`--weight-transfer-config
# '{"backend": NAME}'`) and registered under by the plugin (orchestrate.serving.vllm_plugin.weight_engine).
ENGINES = {"tapeloop": "orchestrate.serving.vllm_plugin.collective_engine:CollectiveEngine"}


@dataclass(frozen=True)
class Mechanism:
    name: str
    publisher: str  # "module:Class" of the learner's end
    transport: str  # "module:Class" of the orchestrator's end
    option: bool = True  # a value of --server.weight_transfer (False: selected by its own option, LoRA's rank)
    backend: str | None = None  # the torch.distributed backend of a collective
    engine: str | None = None  # the vLLM weight-transfer engine (ENGINES) the policy servers start with
    by_path: bool = True  # servers load versions from the run folder by path, so they must see it
    one_rank_per_gpu: bool = False  # the learner and every server's worker are ranks on GPUs of their own
    adapter: bool = False  # each version an adapter of its own name; the one before stays while calls use it
    same_machine: bool = False  # the learner, the orchestrator and the servers share this machine's memory
    summary: str = ""  # what it does, in a few words: --server.weight_transfer's help lists it

    def swap(self, in_flight: bool) -> str:
        """The client's swap timing for this mechanism; `in_flight`: --run.in_flight_swaps."""
        if self.adapter:
            return ADAPTER
        return KEEP if in_flight else DRAIN


MECHANISMS: dict[str, Mechanism] = {}


def register(mechanism: Mechanism) -> Mechanism:
    MECHANISMS[mechanism.name] = mechanism
    return mechanism


DEFAULT = register(Mechanism("disk", "finetune.publish.disk:DiskPublisher",
                             "orchestrate.serving.transports.disk:DiskTransport",
                             summary="each version written as a model folder, reloaded by path")).name  # fmt: skip
for _backend in ("gloo", "nccl"):
    register(Mechanism(_backend, "finetune.publish.collective:CollectivePublisher",
                       "orchestrate.serving.transports.collective:CollectiveTransport", backend=_backend,
                       engine="tapeloop", by_path=False, one_rank_per_gpu=_backend == "nccl",
                       summary="in memory over torch.distributed, " + ("GPUs" if _backend == "nccl" else "CPU")))  # fmt: skip
register(Mechanism("shm", "finetune.publish.shm:ShmPublisher", "orchestrate.serving.transports.shm:ShmTransport",
                   same_machine=True, summary="the disk's folder in this machine's shared memory, /dev/shm: nothing "
                   "synced or written to disk"))  # fmt: skip
LORA = register(Mechanism("lora", "finetune.publish.adapter:AdapterPublisher",
                          "orchestrate.serving.transports.adapter:AdapterTransport", option=False,
                          adapter=True, summary="each version's LoRA adapter, loaded by name")).name  # fmt: skip


def options() -> tuple[str, ...]:
    """--server.weight_transfer's values: the mechanisms registered as options (wherever in this module)."""
    return tuple(name for name, m in MECHANISMS.items() if m.option)


def options_help() -> str:
    """--server.weight_transfer's help, from the table: each option and what it does."""
    described = [f"{m.name} ({m.summary})" if m.summary else m.name for m in MECHANISMS.values() if m.option]
    return "how new policy weights reach the servers: " + "; ".join(described) + "; see docs/weights.md"


def select(option: str | None, lora_rank: int = 0) -> Mechanism:
    """The mechanism of --server.weight_transfer `option` (None: the default), or the adapter mechanism when
    --train.lora.rank is above 0 (it sends only the adapter, whatever the option)."""
    if lora_rank > 0:
        return MECHANISMS[LORA]
    return MECHANISMS[option or DEFAULT]


def load(path: str):
    """The class at "module:Class" (one end of a mechanism, imported only now)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
