"""Write one model folder from a LoRA run's version: the base model with the adapter folded in.

    uv run -m orchestrate.after.merge RUN --out DIR [--version N]       # a LoRA run's checkpoint N (default: newest)
    uv run -m orchestrate.after.merge ADAPTER --out DIR [--model BASE]  # an adapter folder (peft's)

A LoRA run publishes each version as an adapter (RUN/checkpoints/N/adapter/), which vLLM serves on top of
the base model; people who want one model to ship (or to serve without LoRA) get it here: W = W0 + B A *
alpha / r, computed by peft (`merge_and_unload`), written as a Hugging Face folder (safetensors, config,
tokenizer) in the base model's dtype. The base is the run's --model.policy, or for an adapter folder the
base its adapter_config.json names (--model overrides it). Everything is checked before anything is
written: the run, the version, that the adapter fits the base (its layers and their shapes), and that
--out is new or empty.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from contract.cli import OptionError, StrictParser


class MergeError(OptionError):
    """Bad input: one line, exit 2."""


def read_json_object(path: Path) -> dict:
    """A JSON object from `path`, or MergeError saying what it is instead."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON
        raise MergeError(f"{path}: not readable JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(value, dict):
        raise MergeError(f"{path}: holds a {type(value).__name__}, not a JSON object")
    return value


def adapter_and_base(source: Path, version: int | None, model: str | None) -> tuple[Path, Path, str]:
    """The adapter folder, the base model folder and a name for what is merged (checked to fit)."""
    from contract.adapters import adapter_mismatch, is_adapter
    from contract.rundir import ADAPTER_CONFIG, RunDir
    from orchestrate.serving.models import resolve_model

    if not source.exists():
        raise MergeError(f"{source}: no such run directory or adapter folder")
    if is_adapter(source):
        if version is not None:
            raise MergeError(f"--version: {source} is an adapter folder, not a run; leave --version out")
        adapter = source
        base = model or read_json_object(source / ADAPTER_CONFIG).get("base_model_name_or_path")
        if not base:
            raise MergeError(f"{source}/{ADAPTER_CONFIG} names no base model; give --model")
        what = str(source)
    else:
        run = RunDir(source)
        if not run.config_path.is_file():
            raise MergeError(f"{source} is neither a run directory (no config.json) nor an adapter folder "
                             "(no adapter_config.json)")  # fmt: skip
        config = read_json_object(run.config_path)
        if not isinstance(config.get("train"), dict) or not isinstance(config.get("model"), dict):
            raise MergeError(f"{run.config_path}: not a run's config (no train and model sections)")
        if not (config["train"].get("lora") or {}).get("rank"):
            raise MergeError(f"{source} is not a LoRA run: its checkpoints hold whole model folders already "
                             "(checkpoints/N/ with config.json), no adapter to merge")  # fmt: skip
        with_adapter = [i for i in run.published() if run.has_adapter(i)]
        if not with_adapter:
            raise MergeError(f"{source} has no checkpoint with an adapter yet")
        if version is None:
            version = with_adapter[-1]
        elif version not in with_adapter:
            raise MergeError(f"--version {version}: {source} holds the adapters of versions "
                             f"{', '.join(map(str, with_adapter))} (older ones are pruned: --run.keep_checkpoints)")  # fmt: skip
        adapter = run.adapter(version)
        base = model or config["model"]["policy"]
        what = f"{source} version {version}"
    try:
        base_dir = Path(resolve_model(base))
    except Exception as exc:  # noqa: BLE001 - any way a model cannot be found is the same one-line error
        raise MergeError(f"--model: {base}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if problem := adapter_mismatch(adapter, base_dir):
        raise MergeError(f"the adapter does not fit the base model: {problem}")
    return adapter, base_dir, what


def merge(adapter: Path, base: Path, out: Path) -> Path:
    """peft's merge of `adapter` into `base`, written to `out` (built aside, then renamed)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from contract.model_folder import folder_dtype

    dtype = getattr(torch, folder_dtype(base))
    aside = out.parent / f".tmp-{out.name}"
    shutil.rmtree(aside, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)  # merged in fp32, saved as the base
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.to(dtype).save_pretrained(aside)
    AutoTokenizer.from_pretrained(base).save_pretrained(aside)
    if out.exists():
        out.rmdir()  # checked empty
    aside.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = StrictParser(prog="orchestrate.after.merge", allow_abbrev=False,
                                     description="Fold a LoRA run's adapter into its base model: one model folder.")  # fmt: skip
    parser.add_argument("source", help="a LoRA run directory, or an adapter folder (adapter_config.json)")
    parser.add_argument("--out", required=True, help="the model folder to write (new, or an empty folder)")
    parser.add_argument("--version", type=int, default=None,
                        help="the run's version (checkpoint number) to merge [default: the newest]")  # fmt: skip
    parser.add_argument("--model", default=None,
                        help="the base model (name or folder) [default: the run's --model.policy, or the one the "
                             "adapter names]")  # fmt: skip
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        if args.version is not None and args.version < 1:
            raise MergeError(f"--version {args.version}: versions are checkpoint numbers, from 1")
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise MergeError(f"--out {out}: exists and is not an empty folder; give a new one")
        if not out.parent.is_dir():
            raise MergeError(f"--out {out}: its parent folder {out.parent} does not exist")
        adapter, base, what = adapter_and_base(Path(args.source), args.version, args.model)
    except OptionError as exc:  # any refusal of the input: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"merging {what} ({adapter}) into {base} ...", flush=True)
    merge(adapter, base, out)
    print(f"wrote {out}: a model folder (transformers, vLLM) with the adapter folded in")
    return 0


if __name__ == "__main__":
    sys.exit(main())
