"""Environments by id, GEM-style: `--env.id math:arithmetic`, `--env.id countdown`, `--env.id gem:game:GuessTheNumber-v0`.

Built-in ids are registered with an options model (Pydantic): `--env.options.NAME VALUE`
sets one, and a bad one is refused with one line naming it before anything starts. An
environment that runs model-written code (`code`) is registered with `sandbox=True` and
built with the caller's Sandbox (EnvSpec's, from `--env.sandbox.*`).
Families by prefix:
- `rg:NAME`      any reasoning-gym data set (procedural, offline), scored by its own verifier;
- `gem:ID`       any GEM environment (the optional `gem` extra: `uv sync --extra gem`);
- `module:Class` a user's own environment: `module.path:ClassName`, built as
                 `Class(split=..., run_seed=..., **options)` or, if it takes neither, `Class(**options)`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from agents.envs.base import Env, EnvError

Factory = Callable[..., Env]  # (validated options, split, run_seed[, sandbox=]) -> Env


@dataclass
class EnvEntry:
    id: str
    options: type[BaseModel]
    factory: Factory
    description: str
    sandbox: bool = False  # it runs model-written code: the factory takes `sandbox=` (one Sandbox per EnvSpec)
    agents: tuple[str, ...] = ()  # a multi-agent environment's agent ids (GEM's possible_agents), known unbuilt


_REGISTRY: dict[str, EnvEntry] = {}
_PREFIXES: dict[str, Callable[[str], EnvEntry]] = {}


def register(env_id: str, options: type[BaseModel], description: str, *, sandbox: bool = False,
             agents: tuple[str, ...] = ()):  # fmt: skip
    """Decorator: register `factory(options, split, run_seed) -> Env` under `env_id`; with `sandbox`, the
    environment runs model-written code and its factory also takes `sandbox=` (an agents.sandbox.Sandbox);
    `agents`: the agent ids of a multi-agent environment (each a role of the run), checked before it is built."""

    def wrap(factory: Factory) -> Factory:
        _REGISTRY[env_id] = EnvEntry(env_id, options, factory, description, sandbox, tuple(agents))
        return factory

    return wrap


def register_prefix(prefix: str, resolver: Callable[[str], EnvEntry]) -> None:
    """Ids starting with `prefix` (e.g. 'rg:') are resolved by `resolver(rest_of_id)`."""
    _PREFIXES[prefix] = resolver


def _load_builtins() -> None:
    # Importing a module registers its environments; each is light (no model, no data).
    for name in ("math", "countdown", "guess_the_number", "hide_and_guess", "code", "qa", "reasoning_gym", "gem"):
        importlib.import_module(f"agents.envs.{name}")


def entry(env_id: str) -> EnvEntry:
    """The registry entry for `env_id`, or EnvError naming the known ids."""
    _load_builtins()
    if env_id in _REGISTRY:
        return _REGISTRY[env_id]
    for prefix, resolver in _PREFIXES.items():
        if env_id.startswith(prefix):
            return resolver(env_id[len(prefix) :])
    known = ", ".join(sorted(_REGISTRY)) + ", " + ", ".join(f"{p}..." for p in sorted(_PREFIXES))
    raise EnvError(f"unknown environment {env_id!r} (known: {known})")


def known_ids() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY) + [f"{p}NAME" for p in sorted(_PREFIXES)]


class FreeOptions(BaseModel):
    """Options passed through as keyword arguments (external environments)."""

    model_config = ConfigDict(extra="allow")


def check_options(env_id: str, options: dict[str, Any] | None) -> BaseModel:
    """Validate `options` for `env_id`; EnvError names the first bad option as `options.NAME`."""
    e = entry(env_id)
    try:
        return e.options.model_validate(options or {})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        name = f"options.{where}" if where else "options"
        raise EnvError(f"{name}: {err['msg'].removeprefix('Value error, ')}{got}") from None


def make_env(
    env_id: str, options: dict[str, Any] | None = None, *, split: str = "train", run_seed: int = 0, sandbox=None
) -> Env:
    """A fresh environment `env_id` for `split` ("train" or "test") of the run seeded `run_seed`. An
    environment that runs code gets `sandbox` (an agents.sandbox.Sandbox; default: one with default limits);
    the others ignore it."""
    if split not in ("train", "test"):
        raise EnvError(f"split must be 'train' or 'test', not {split!r}")
    e = entry(env_id)
    options = check_options(env_id, options)
    if not e.sandbox:
        return e.factory(options, split, run_seed)
    if sandbox is None:
        from agents.sandbox import Sandbox

        sandbox = Sandbox()
    return e.factory(options, split, run_seed, sandbox=sandbox)


# -- module:Class ---------------------------------------------------------------


def _module_class(spec: str) -> EnvEntry:
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise EnvError(f"module:{spec}: give the class as module:package.module:ClassName")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise EnvError(f"module:{spec}: cannot import it ({exc})") from None

    def factory(options: BaseModel, split: str, run_seed: int) -> Env:
        kwargs = options.model_dump()
        params = inspect.signature(cls).parameters
        if "split" in params:
            kwargs["split"] = split
        if "run_seed" in params:
            kwargs["run_seed"] = run_seed
        env = cls(**kwargs)
        if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
            raise EnvError(f"module:{spec}: {class_name} has no reset()/step(): not an environment")
        return env

    return EnvEntry(f"module:{spec}", FreeOptions, factory, f"user environment {spec}")


register_prefix("module:", _module_class)
