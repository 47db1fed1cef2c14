"""A GGUF file's weights in their own formats, under Hugging Face names, with no float32 copy.

`read_gguf` memory-maps the file (gguf.GGUFReader) and gives each tensor the name and layout
of the tensor `gguf_convert.hf_tensors` writes for it, undoing llama.cpp's changes on the
stored bytes rather than on floats: llama's q/k permutation reorders output rows, and a row
of a quantized matrix is a whole row of blocks, so the rows of blocks move intact; stacked
[experts, out, in] tensors split into per-expert views. Quantized matrices become
`QuantizedWeight`s, copied into huge-page memory (tidal.model.weight_arena) as they are read,
the map's pages of each dropped once copied (`in_place=True`: read-only views of the map
unless reordered or repacked); float matrices are torch tensors of the file's dtype viewing
the map. 1-D tensors (norms, biases) become small float32 copies, Gemma's norm offset undone.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Union

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES

from tidal.model.gguf_convert import (HFTensor, _unpermute, expert_name, hf_config, hf_layout,
                                      is_flat_gate)
from tidal.model.gguf_file import open_gguf
from tidal.model.gguf_quants import FLOAT_TYPES, QuantizedWeight, _as_bytes
from tidal.model.tensor_parallel import Shard
from tidal.model.weight_arena import WeightArena

Weight = Union[torch.Tensor, QuantizedWeight]


class GGUFWeights(Mapping):
    """Hugging Face name -> weight (torch tensor or QuantizedWeight) of one GGUF file, with
    its `config` (hf_config's config.json dict), `path` and `nbytes`, the bytes of all the
    file's tensors. The reader's memory map lives as long as the weights viewing it."""

    def __init__(self, path: Path, reader: GGUFReader, config: dict,
                 weights: dict[str, Weight]) -> None:
        self.path, self.reader, self.config = path, reader, config
        self.nbytes = sum(int(t.n_bytes) for t in reader.tensors)
        self._weights = weights

    def __getitem__(self, name: str) -> Weight:
        return self._weights[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def release_unused(self, live: Iterable[torch.Tensor]) -> int:
        """Drop this process's pages of the file's memory map that no `live` tensor views:
        what was copied (weights in memory, floats converted) and the header, so RSS holds
        each weight's bytes once. They stay in the page cache, and a later read maps them
        again. Returns the bytes of the ranges released."""
        mapped = self.reader.data
        base, size = mapped.ctypes.data, mapped.nbytes
        spans = sorted((p - base, p - base + t.numel() * t.element_size())
                       for t in live if base <= (p := t.data_ptr()) < base + size)
        released, at = 0, 0
        for start, end in [*spans, (size, size)]:
            released += drop_pages(mapped, at, start)
            at = max(at, end)
        return released

    def __repr__(self) -> str:
        return f"GGUFWeights({str(self.path)!r}, {len(self)} tensors, {self.nbytes} bytes)"


def drop_pages(mapped: np.memmap, start: int, end: int) -> int:
    """Drop this process's whole pages of the map within bytes start..end; their bytes."""
    handle = getattr(mapped, "_mmap", None)  # np.memmap's mmap.mmap
    lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if handle is None or not hasattr(handle, "madvise") or hi <= lo:
        return 0
    handle.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    return hi - lo


def read_gguf(path: str | os.PathLike, planar: bool | None = None,
              use_extension: bool = True, config: dict | None = None,
              in_place: bool = False, shard: Shard | None = None) -> GGUFWeights:
    """The weights of the GGUF file at `path` (see the module docstring); `planar` and
    `use_extension` go to each QuantizedWeight; `config`: the file's hf_config, when known
    (the cache folder's config.json), which spares reading the tokenizer's metadata;
    `in_place`: quantized weights stay views of the map; `shard`: one tensor-parallel rank's
    part of each tensor, only its blocks copied. ValueError naming the file for a
    truncated file, an architecture that does not convert, or a tensor type tidal does not
    run."""
    path = Path(path)
    reader = open_gguf(path, arrays=config is None)
    arena = None if in_place else WeightArena()
    try:
        config = config or hf_config(reader)
        weights: dict[str, Weight] = {}
        for item in hf_layout(reader, config):
            read = dict(_weights(item, planar, use_extension, arena, shard))
            weights.update(read)
            if arena is not None and all(isinstance(w, QuantizedWeight) for w in read.values()):
                stored = np.asarray(item[0].data)  # copied: the map's pages go now, not at
                at = stored.ctypes.data - reader.data.ctypes.data  # the end (peak RSS)
                drop_pages(reader.data, at, at + stored.nbytes)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return GGUFWeights(path, reader, config, weights)


def _weights(item: HFTensor, planar: bool | None, use_extension: bool,
             arena: WeightArena | None, shard: Shard | None) -> Iterator[tuple[str, Weight]]:
    """(HF name, weight) for one GGUF tensor: one pair, or one per expert."""
    t, name, heads, norm_offset = item
    own = name if shard is None or ".experts." in name else shard.local_name(name)
    if own is None:  # a layer another pipeline stage holds: never read
        return
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the innermost dim first
    if len(shape) == 1 or norm_offset:
        w = _small_float(t, shape, norm_offset, is_flat_gate(name, len(shape)))
        yield own, w if shard is None else shard.take(name, w)
        return
    data = np.asarray(t.data)  # [..., rows, row bytes or values]: whole rows either way
    qtype = QT(t.tensor_type)
    unit = 1 if qtype in FLOAT_TYPES else GGML_QUANT_SIZES[qtype][1]
    if ".experts." in name:  # [experts, rows, ...]: each expert a matrix of its own
        for e in range(shape[0]):
            own, matrix, dims = expert_name(name, e), data[e], shape[1:]
            if shard is not None:  # the rank's experts, or its whole blocks of each
                own = shard.local_name(own)
                if own is None:
                    continue
                matrix, dims = shard.take_matrix(own, matrix, dims, unit)
            yield own, _matrix(f"{t.name}[{e}]", matrix, t.tensor_type, dims, planar,
                               use_extension, arena)
        return
    if shard is not None:  # this rank's whole rows or whole blocks, before any copy
        data, shape = shard.take_matrix(name, data, shape, unit)
        if heads is not None:  # q/k rows are permuted within a head: the rank's own heads
            heads = max(1, heads // shard.size)
    if heads is not None:  # a copy of the stored rows, reordered as HF orders them
        data = np.ascontiguousarray(_unpermute(data, heads))
    yield own, _matrix(t.name, data, t.tensor_type, shape, planar, use_extension, arena)


def _small_float(t, shape: tuple[int, ...], norm_offset: bool, flat_gate: bool) -> torch.Tensor:
    """A norm, bias or other small tensor as a float32 copy."""
    from gguf.quants import dequantize

    try:
        w = np.array(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
    except NotImplementedError:
        raise ValueError(f"GGUF tensor {t.name!r} has type {QT(t.tensor_type).name}, which "
                         "tidal does not read") from None
    w = w.reshape(shape)
    if norm_offset:
        w -= 1
    return torch.from_numpy(w[None] if flat_gate else w)


def _matrix(name: str, data: np.ndarray, qtype: QT, shape: tuple[int, ...],
            planar: bool | None, use_extension: bool, arena: WeightArena | None) -> Weight:
    """A [out, in] matrix of the file's bytes: a torch tensor for the float types, else a
    QuantizedWeight (which refuses the types tidal does not run, by name)."""
    if len(shape) != 2:
        raise ValueError(f"GGUF tensor {name!r} has shape {list(shape)}; tidal reads matrices")
    if qtype in FLOAT_TYPES:
        return _as_bytes(data).view(FLOAT_TYPES[qtype]).view(shape)
    return QuantizedWeight(name, data, qtype, shape, planar, use_extension, arena)
