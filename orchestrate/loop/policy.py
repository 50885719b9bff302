"""Which model a command serves, resolved in one place: the checks (orchestrate.loop.preflight) and the set-up
(orchestrate.loop.setup) both take it from here, and neither imports the other.

- a model by name or folder (`model_folder`: the embedded one, a local folder, a hub id);
- the policy to sample from (`Policy`): a run's newest servable checkpoint or version N (`run_policy`), a
  checkpoint or model folder or a model by name (`given_policy`); a server by URL is checked as it is resolved
  (orchestrate.loop.preflight.remote_policy);
- the teacher's model folder (`teacher_folder`: a model, or a run's newest checkpoint with weights);
- a run's folders (`RunModels`): the policy's, the reference's, the teacher's and those of the models roles are
  bound to, resolved once per run (by the checks, which return them) and passed to its set-up.

Each refuses with a PolicyError: one line naming the option.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from contract.cli import OptionError
from contract.rundir import CHECKPOINT_NAME, RunDir
from orchestrate.loop.config import RLConfig, teacher_url


class PolicyError(OptionError):
    """A model, a run's version, a checkpoint or a run's config that cannot be had: one line naming the option."""


def first_line(exc: BaseException) -> str:
    """`Type: the first line of its message`, for an error of someone else's said in one line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def model_folder(name: str, option: str) -> Path:
    """The local folder of a model by name or folder (orchestrate.serving.models.resolve_model: the embedded
    one is built if needed)."""
    from orchestrate.serving.models import ModelNotAvailable, resolve_model

    try:
        return Path(resolve_model(name))
    except ModelNotAvailable as exc:
        raise PolicyError(f"{option}: {' '.join(str(exc).split())}") from None
    except Exception as exc:  # noqa: BLE001 - a hub that fails in its own way: the same one line
        raise PolicyError(f"{option}: model {name!r} cannot be had ({first_line(exc)})") from None


def read_run_config(path: Path, option: str = "--config") -> RLConfig:
    """A run's config.json, validated; refused in one line when it is missing or is not one."""
    if not path.is_file():
        raise PolicyError(f"{option}: {path} not found; pass the run's config.json")
    try:
        return RLConfig.model_validate(json.loads(path.read_text()))
    except Exception as exc:  # noqa: BLE001 - any way it is not a run config is the same one line
        raise PolicyError(f"{option} {path}: not a run config ({str(exc).splitlines()[0]})") from None


def is_run_dir(run: RunDir) -> bool:
    """Whether the folder holds a run: a config.json that is a run's (sections such as `model`), not a model's
    (`model_type`)."""
    try:
        saved = json.loads(run.config_path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and "model" in saved and "model_type" not in saved


# -- the policy to sample from ----------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """What live calls are sampled from."""

    model: Path  # the folder the server serves (a LoRA version: the base model)
    version: int  # recorded on the calls (LLMCall.policy_version) and the tapes' metadata
    name: str  # recorded as the calls' model
    adapter: Path | None = None  # a LoRA run's version: its adapter, loaded on the base
    note: str = ""  # where it comes from, for the console
    url: str | None = None  # a server that runs (used as it serves now), else one is started


def checkpoint_number(folder: Path) -> int:
    """N for a folder RUN/checkpoints/N (a version of a run), else 0."""
    m = CHECKPOINT_NAME.match(folder.name)
    return int(m.group(1)) if m and folder.parent.name == "checkpoints" else 0


def servable_versions(run: RunDir, config: RLConfig) -> list[int]:
    """A run's published versions that can be served, oldest first: their weights on disk (a LoRA run: their
    adapter). Version 0, the initial model, is not listed: it always can."""
    lora = config.train.lora.rank > 0
    return [i for i in run.published() if (run.has_adapter(i) if lora else run.has_weights(i))]


def run_policy(run: RunDir, config: RLConfig, version: int | None = None, option: str = "--model") -> Policy:
    """A run's policy: version `version` (0: the initial model), else its newest checkpoint that can be served
    (its weights on disk, or for a LoRA run its adapter), else the initial model before any. Refused when
    that version has no weights on disk (sent to the servers in memory, or dropped by keep_checkpoints)."""
    from orchestrate.serving.models import resolve_model

    published = run.published()
    lora = config.train.lora.rank > 0
    servable = servable_versions(run, config)
    initial = Policy(resolve_model(config.model.policy), 0, config.model.policy,
                     note=f"the initial policy {config.model.policy}")  # fmt: skip
    if version == 0:
        return initial
    if version is None and not published:
        return replace(initial, note=initial.note + " (the run has no checkpoint yet)")
    if version is not None and version not in servable:
        have = ", ".join(map(str, servable)) or "none"
        why = "not published" if version not in published else "its weights went to the servers in memory"
        raise PolicyError(f"--version {version}: {run.root} has no such version on disk ({why}); versions with "
                          f"weights on disk: {have} (0: the initial model)")  # fmt: skip
    if not servable:
        raise PolicyError(f"{option}: no checkpoint of {run.root} has its weights on disk (version {published[-1]}'s "
                          "went to the servers in memory; a clean stop writes them); pass --model MODEL")  # fmt: skip
    asked, version = version, version if version is not None else servable[-1]
    # the newest servable version was taken: say so when a newer one exists whose weights went in memory
    newer = (
        f"; version {published[-1]} is newer, its weights went in memory"
        if asked is None and published[-1] > version
        else ""
    )
    if lora:
        return Policy(resolve_model(config.model.policy), version, config.model.policy, run.adapter(version),
                      note=f"version {version} ({run.adapter(version)}{newer})")  # fmt: skip
    return Policy(run.checkpoint(version), version, config.model.policy,
                  note=f"version {version} ({run.checkpoint(version)}{newer})")  # fmt: skip


def given_policy(model: str, option: str = "--model") -> Policy:
    """A model folder (a run's checkpoint N: version N), a hub id or the embedded model's name."""
    folder = model_folder(model, option)
    version = checkpoint_number(folder)
    return Policy(folder, version, model, note=f"{model}" + (f" (version {version})" if version else ""))


# -- the teacher, and a run's folders ----------------------------------------------------------------


def teacher_folder(model: str, option: str = "--teacher.model") -> Path:
    """The teacher's model folder: a run directory's newest checkpoint with its weights on disk, else a model
    folder or name. Refused: a LoRA run (its versions are adapters), a run with no checkpoint on disk, a model
    that cannot be had."""
    run = RunDir(Path(model).expanduser())
    if not is_run_dir(run):
        return model_folder(model, option)
    config = read_run_config(run.config_path, option)
    if config.train.lora.rank:
        raise PolicyError(f"{option}: {run.root} is a LoRA run, whose versions are adapters; fold one into a model "
                          f"folder (uv run -m orchestrate.after.merge {run.root} --out DIR) and give that")  # fmt: skip
    policy = run_policy(run, config, option=option)
    if policy.version == 0:
        raise PolicyError(f"{option}: {run.root} has no checkpoint yet; give a run that has trained, or a model")
    return policy.model


@dataclass(frozen=True)
class RunModels:
    """The model folders one run serves, resolved once: by the checks (orchestrate.loop.preflight.preflight
    returns them, checked) and passed on to its set-up (orchestrate.loop.setup.RunSetup)."""

    policy: Path
    reference: Path  # the policy's when no --model.reference is given
    teacher: Path | None  # a teacher served here; None without one, or with one by URL (its server's)
    # the frozen models roles are bound to and served here (agent.roles: a model, not a URL): binding -> folder
    roles: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def of(cls, config: RLConfig, model=model_folder, teacher=None, role=None) -> RunModels:
        """Each folder resolved with `model(name, option)`, the teacher's with `teacher(name, policy_folder)`
        (default teacher_folder) and a role's model with `role(binding, policy_folder, option)` (default
        teacher_folder: the same kinds of model); the checks pass theirs, which check each folder as they
        resolve it."""
        policy = model(config.model.policy, "--model.policy")
        reference = model(config.model.reference, "--model.reference") if config.model.reference else policy
        role = role or (lambda name, _policy, option: teacher_folder(name, option))
        roles = {binding: role(binding, policy, f"--agent.roles {name}")
                 for name, binding in role_models(config).items()}  # fmt: skip
        if not config.teacher.model or config.teacher.url:
            return cls(policy, reference, None, roles)
        teacher = teacher or (lambda name, _policy: teacher_folder(name))
        return cls(policy, reference, teacher(config.teacher.model, policy), roles)


def role_models(config: RLConfig, urls: bool = False) -> dict[str, str]:
    """The roles bound to a model served here (agent.roles; with `urls`, those bound to a server's URL instead):
    role -> binding, one role per binding (the first that names it: one server each)."""
    from agents.agent import model_bindings

    found: dict[str, str] = {}
    for name, binding in model_bindings(config.agent.roles).items():
        if binding not in found.values() and bool(teacher_url(binding)) == urls:
            found[name] = binding
    return found
