"""What both processes read of a Hugging Face model folder beyond its weights: the dtype its config declares
(the learner writes its checkpoints in it by default; orchestrate.after.merge writes a merged model in it)."""

from __future__ import annotations

import json
from pathlib import Path


def folder_dtype(model_dir: str | Path) -> str:
    """The dtype a model folder's config declares (float32 when it says nothing)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
