"""Opening a GGUF file: gguf.GGUFReader over its memory map, with a truncated file (cut in
its header or its tensor data) or a file that is no GGUF refused with a ValueError naming
it, where the plain reader fails with a numpy error or reads a short tensor."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES


class _Truncated(Exception):
    """A read past the end of the file."""


class _CheckedReader(GGUFReader):
    """gguf.GGUFReader that stops at the first read past the end of the file, where the
    plain reader takes a short slice of its memory map (a numpy error or a short tensor).
    Without `arrays`, array fields (the tokenizer's ~100k tokens, merges and scores, which
    the plain reader slices one item at a time: seconds) are stepped over, left empty."""

    def __init__(self, path: Path, arrays: bool = True) -> None:
        self._arrays = arrays
        super().__init__(path)

    def _get_field_parts(self, orig_offs, raw_type):
        if self._arrays or GGUFValueType(int(raw_type)) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item = GGUFValueType(int(item_type[0]))
        offs = orig_offs + 12
        if item == GGUFValueType.STRING:  # each a uint64 length and its bytes
            raw = memoryview(self.data)
            for _ in range(int(count[0])):
                if offs + 8 > len(raw):
                    raise _Truncated(f"its header runs past byte {len(raw)}, where the file ends")
                offs += 8 + int.from_bytes(raw[offs:offs + 8], "little")
        elif item in self.gguf_scalar_to_np:
            offs += int(count[0]) * np.dtype(self.gguf_scalar_to_np[item]).itemsize
        else:  # nested arrays: the plain reader's way
            return super()._get_field_parts(orig_offs, raw_type)
        if offs > len(self.data):
            raise _Truncated(f"its header runs past byte {len(self.data)}, where the file ends")
        return offs - orig_offs, [item_type, count], [], [GGUFValueType.ARRAY, item]

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


def open_gguf(path: str | os.PathLike, arrays: bool = True) -> GGUFReader:
    """gguf.GGUFReader over `path` (a memory map); ValueError naming the file when it is
    truncated (cut in its header or its tensor data) or no GGUF file the reader reads.
    `arrays`: False leaves array fields (the tokenizer's) empty, for a reader of weights."""
    path = Path(path)
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is truncated: it is empty")
    try:
        return _CheckedReader(path, arrays)
    except _Truncated as e:
        raise ValueError(f"{path} is truncated: {e}") from None
    except (ValueError, KeyError, IndexError) as e:
        raise ValueError(f"{path} is not a GGUF file tidal reads: {e}") from None
