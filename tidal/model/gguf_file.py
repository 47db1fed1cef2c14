"""Opening a GGUF file: gguf.GGUFReader over its memory map, with a truncated file (cut in
its header or its tensor data) or a file that is no GGUF refused with a ValueError naming
it, where the plain reader fails with a numpy error or reads a short tensor."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES


class _Truncated(Exception):
    """A read past the end of the file."""


class _CheckedReader(GGUFReader):
    """gguf.GGUFReader that stops at the first read past the end of the file, where the
    plain reader takes a short slice of its memory map (a numpy error or a short tensor)."""

    def _get(self, offset, dtype, count=1, *args, **kwargs):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _Truncated(f"its header runs past byte {len(self.data)}, where the file ends")
        return super()._get(offset, dtype, count, *args, **kwargs)

    def _build_tensors(self, start_offs, fields) -> None:
        for field in fields:  # each tensor's extent, before the reader slices its data
            _, name, _, dims, raw_type, offset = field.parts
            name = bytes(name).decode("utf-8", "replace")
            try:
                qtype = QT(int(raw_type[0]))
            except ValueError:
                raise ValueError(f"GGUF tensor {name!r} has unknown ggml type "
                                 f"{int(raw_type[0])}") from None
            block, size = GGML_QUANT_SIZES[qtype]
            end = int(start_offs) + int(offset[0]) + math.prod(int(d) for d in dims) // block * size
            if end > len(self.data):
                raise _Truncated(f"tensor {name!r} ({qtype.name}) ends at byte {end}, the file "
                                 f"at byte {len(self.data)}")
        super()._build_tensors(start_offs, fields)


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """gguf.GGUFReader over `path` (a memory map); ValueError naming the file when it is
    truncated (cut in its header or its tensor data) or no GGUF file the reader reads."""
    path = Path(path)
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is truncated: it is empty")
    try:
        return _CheckedReader(path)
    except _Truncated as e:
        raise ValueError(f"{path} is truncated: {e}") from None
    except (ValueError, KeyError, IndexError) as e:
        raise ValueError(f"{path} is not a GGUF file tidal reads: {e}") from None
