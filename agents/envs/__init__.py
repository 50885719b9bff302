"""Environments the agent acts in (GEM's protocol), chosen by id: see `registry`."""

from agents.envs.base import (
    Capabilities,
    Env,
    EnvError,
    HasStopStrings,
    HasTestSize,
    SupportsAsyncStep,
    ToolCalling,
    capabilities,
    episode_seed,
    jsonable,
)
from agents.envs.registry import check_options, entry, known_ids, make_env, register

__all__ = [
    "Capabilities",
    "Env",
    "EnvError",
    "HasStopStrings",
    "HasTestSize",
    "SupportsAsyncStep",
    "ToolCalling",
    "capabilities",
    "check_options",
    "entry",
    "episode_seed",
    "jsonable",
    "known_ids",
    "make_env",
    "register",
]
