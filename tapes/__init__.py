"""tapes: the record of what agents did (schema, store, diff); the bottom layer: imports nothing of ours.

The viewers (orchestrate.browse, orchestrate.show) and replay (orchestrate.replay) live above it."""

from tapes.store import TapeFileError, TapeWriter, read_tapes, write_tapes
from tapes.tape import (
    Action,
    EnvAction,
    EnvObservation,
    FinalAnswerAction,
    LLMCall,
    Observation,
    ParseFailureStep,
    ReasoningThought,
    SamplingParams,
    Step,
    StepMetadata,
    Tape,
    TapeMetadata,
    TaskStep,
    Thought,
    VersionChange,
)

__all__ = [
    "Action",
    "EnvAction",
    "EnvObservation",
    "FinalAnswerAction",
    "LLMCall",
    "Observation",
    "ParseFailureStep",
    "ReasoningThought",
    "SamplingParams",
    "Step",
    "StepMetadata",
    "Tape",
    "TapeFileError",
    "TapeMetadata",
    "TapeWriter",
    "TaskStep",
    "VersionChange",
    "Thought",
    "read_tapes",
    "write_tapes",
]
