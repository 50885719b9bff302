"""The resume rules of a run's saved settings: which config.json is a run's, the saved settings as this version
reads them (the base `--run-dir RUN` alone resumes with), and the options that differ from a command's.

orchestrate/rl.py holds the rule that uses them (which options may change on resume, RESUMABLE).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrate.loop.config import RLConfig, with_program_section


def not_a_run_config(data: Any) -> str | None:
    """Why a config.json is not a run's (a model folder's, anything else's: none of a run config's sections, or
    one that is not a section), else None. One of an earlier version is a run's."""
    if not isinstance(data, dict):
        return f"a {type(data).__name__}"
    known = [key for key in data if key in RLConfig.model_fields]
    wrong = [key for key in known if not isinstance(data[key], dict)]
    if wrong:
        return f"{wrong[0]} is a {type(data[wrong[0]]).__name__}"
    return None if known else "none of a run config's sections"


def with_defaults(saved: dict) -> dict:
    """A saved config as this version reads it: options added since it was written take their defaults, and
    options that moved are where they are now, so neither counts as a change of settings."""
    saved = _without_ignored(saved)
    try:
        return RLConfig.model_validate(saved).model_dump(mode="json")
    except ValueError:  # not valid any more: compared as written, its differences named
        return saved


def _without_ignored(saved: dict) -> dict:
    """Options a run's config could hold that an earlier version ignored and this one refuses (train.colocated,
    which the loop sets; teacher options without a teacher): taken out, so the run resumes as it ran."""
    saved = dict(saved)
    if isinstance(train := saved.get("train"), dict) and train.get("colocated"):
        saved["train"] = {**train, "colocated": False}
    if isinstance(teacher := saved.get("teacher"), dict) and not teacher.get("model"):
        saved["teacher"] = {}
    return saved


def saved_run_base(run_dir: Path) -> dict[str, Any] | None:
    """The settings an existing run resumes with when no --preset is given: its config.json as this version
    reads it (`with_program_section`, `with_defaults`), so `--run-dir RUN` alone resumes RUN as it was started,
    whatever its preset and options. None where there is no such file or it is not a run's config this version
    reads: the preset is the base then, and the resume check names what is wrong."""
    try:
        data = json.loads((run_dir / "config.json").read_bytes())
    except (OSError, ValueError):
        return None
    if not_a_run_config(data):
        return None
    try:  # `with_defaults`, where the saved config is valid
        return RLConfig.model_validate(_without_ignored(with_program_section(data))).model_dump(mode="json")
    except ValueError:
        return None


def config_differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted names whose values differ between two config dicts."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out
