"""Opening a GGUF file: gguf.GGUFReader over its memory map, with a truncated file (cut in
its header or its tensor data) or a file that is no GGUF refused with a ValueError naming
it, where the plain reader fails with a numpy error or reads a short tensor."""

from __future__ import annotations

import contextlib
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
    plain reader takes a short slice of its memory map (a numpy error or a short tensor),
    and reads array fields (the tokenizer's ~100k tokens, merges and scores) in one pass
    over the bytes, where the plain reader slices its memory map item by item (seconds).
    Without `arrays` they are stepped over, left empty."""

    def __init__(self, path: Path, arrays: bool = True) -> None:
        self._arrays = arrays
        super().__init__(path)

    def _get_field_parts(self, orig_offs, raw_type):
        if GGUFValueType(int(raw_type)) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item, n = GGUFValueType(int(item_type[0])), int(count[0])
        if item == GGUFValueType.STRING:
            offs, parts = self._strings(orig_offs + 12, n)
        elif item in self.gguf_scalar_to_np:
            offs, parts = self._scalars(orig_offs + 12, n, self.gguf_scalar_to_np[item])
        else:  # nested arrays: the plain reader's way
            return super()._get_field_parts(orig_offs, raw_type)
        # the plain reader's shape: each item's value is a part, its index in `data`
        step = 2 if item == GGUFValueType.STRING else 1
        data = list(range(2 + step - 1, 2 + len(parts), step))
        return offs - orig_offs, [item_type, count, *parts], data, [GGUFValueType.ARRAY, item]

    def _strings(self, offs: int, n: int) -> tuple[int, list[np.ndarray]]:
        """n strings from `offs`, each a uint64 length and its bytes: (end, parts)."""
        raw, size, parts = memoryview(self.data), len(self.data), []
        for _ in range(n):
            # (a length that is itself cut counts as one past the end)
            length = int.from_bytes(raw[offs:offs + 8], "little") if offs + 8 <= size else size
            if offs + 8 + length > size:
                raise _Truncated(f"its header runs past byte {size}, where the file ends")
            if self._arrays:
                parts += (np.frombuffer(raw, np.uint64, 1, offs),
                          np.frombuffer(raw, np.uint8, length, offs + 8))
            offs += 8 + length
        return offs, parts

    def _scalars(self, offs: int, n: int, dtype) -> tuple[int, list[np.ndarray]]:
        """n scalars of `dtype` from `offs`: (end, parts), each part one item."""
        end = offs + n * np.dtype(dtype).itemsize
        if end > len(self.data):
            raise _Truncated(f"its header runs past byte {len(self.data)}, where the file ends")
        if not self._arrays:
            return end, []
        values = np.frombuffer(memoryview(self.data), dtype, n, offs)
        return end, [values[i:i + 1] for i in range(n)]

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


@contextlib.contextmanager
def lent_to_gguf():
    """gguf.GGUFReader is this module's one-pass reader meanwhile: transformers reads a
    GGUF's tokenizer through it (its own import, inside the call), item by item with the
    plain reader (seconds for a 49k vocabulary)."""
    import gguf

    plain = gguf.GGUFReader
    gguf.GGUFReader = _CheckedReader
    try:
        yield
    finally:
        gguf.GGUFReader = plain
