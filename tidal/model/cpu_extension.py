"""Builds tidal's C++ CPU extension (`csrc/`) once, on first use, and loads it."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

log = logging.getLogger("tidal.model")
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [str(_CSRC / name)  # + the headers they include
            for name in ("linear.cpp", "paged_attention.cpp", "prefill_attention.cpp",
                         "experts.cpp", "gguf_quants.cpp",
                         "lora.cpp", "all_reduce.cpp", "fused_ops.cpp", "token_mask.cpp",
                         "decoder.cpp")]
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_built: list[ModuleType | None] = []  # [] until the first build attempt


def extension() -> ModuleType | None:
    """The compiled module, or None when it cannot be built here (said once in the log)."""
    if not _built:
        try:
            from torch.utils.cpp_extension import load

            log.info("loading tidal's C++ CPU decoder (the first build takes about a minute)")
            with warnings.catch_warnings(), _build_folder() as folder:
                warnings.simplefilter("ignore")
                _built.append(load(name="tidal_cpu_decode", sources=_SOURCES,
                                   extra_cflags=_CFLAGS,
                                   extra_ldflags=["-fopenmp"], build_directory=str(folder),
                                   verbose=False))
        except Exception as exc:  # no compiler, headers or ninja: the PyTorch ops still work
            log.warning("tidal's C++ CPU decoder could not be built (%s); decoding with "
                        "PyTorch ops", str(exc).splitlines()[0] if str(exc) else type(exc))
            _built.append(None)
    return _built[0]


def loaded() -> ModuleType | None:
    """The extension if this process built or loaded it already; never starts a build."""
    return _built[0] if _built else None


@contextmanager
def _build_folder() -> Iterator[Path]:
    """The extension's build folder, held under an flock while torch builds or loads it.
    torch's own lock is a plain file that a process killed mid-build leaves behind, and
    every later build then waits on it forever; the flock dies with its process, so whoever
    holds it may remove a leftover lock file. The folder is named by the hash of the sources,
    their folder and the flags, so two checkouts on one machine never rebuild over each
    other."""
    import fcntl

    from torch.utils.cpp_extension import get_default_build_root

    version = f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # as torch's
    folder = Path(root) / f"tidal_cpu_decode-{version}-{source_key(_CSRC)}"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another tidal process building waits here
        (folder / "lock").unlink(missing_ok=True)
        yield folder


def source_key(csrc: Path) -> str:
    """A short hash of every source and header under `csrc`, of where `csrc` is, and of the
    compiler flags. The place counts: torch's build.ninja names each source by its path, so
    two checkouts of one version sharing a folder would each rebuild it after the other."""
    digest = hashlib.sha256(" ".join(_CFLAGS).encode())
    digest.update(str(csrc.resolve()).encode() + b"\0")
    for path in sorted(csrc.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]
