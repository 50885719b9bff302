"""tapes: the record of what agents did (schema, store, diff); the bottom layer: imports nothing of ours.

The viewers (orchestrate.after.browse, orchestrate.after.show) and replay (orchestrate.after.replay) live above it."""

from tapes.store import TapeFileError, TapeWriter, read_tapes, write_tapes
from tapes.tape import (
    Action,
    EnvAction,
    EnvObservation,
    LLMCall,
    Observation,
    SamplingParams,
    Step,
    StepMetadata,
    Tape,
    TapeMetadata,
    Thought,
    ToolCallAction,
    ToolResultObservation,
    VersionChange,
)

__all__ = [
    "Action",
    "EnvAction",
    "EnvObservation",
    "LLMCall",
    "Observation",
    "SamplingParams",
    "Step",
    "StepMetadata",
    "Tape",
    "TapeFileError",
    "TapeMetadata",
    "TapeWriter",
    "VersionChange",
    "Thought",
    "ToolCallAction",
    "ToolResultObservation",
    "read_tapes",
    "write_tapes",
]
