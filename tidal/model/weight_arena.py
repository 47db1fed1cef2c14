"""Anonymous memory for the weights a decode step streams, in transparent huge pages where
Linux offers them (madvise mode). A step reads every weight once; with 4 KiB pages (a file's
memory map) it walks the page tables every 4 KiB, and the prefetchers stop at each page's
end: a 1B Q4_K_M model's projections stream ~12% faster from 2 MiB pages on a 2-core Xeon
(docs/performance.md)."""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # a cache line: every tensor starts on one


class WeightArena:
    """Hands out uint8 tensors carved from chunks of at least `chunk_bytes` of anonymous
    memory advised MADV_HUGEPAGE. Each chunk starts on a huge-page boundary; untouched tails
    cost no memory. The tensors keep their chunk alive."""

    def __init__(self, chunk_bytes: int = 64 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._free = torch.empty(0, dtype=torch.uint8)  # the current chunk's unused tail
        self.reserved = 0  # bytes of address space taken, over all chunks

    def empty(self, nbytes: int) -> torch.Tensor:
        """A fresh, 64-byte aligned uint8 tensor of `nbytes` (contents undefined)."""
        need = -(-nbytes // ALIGN) * ALIGN
        if need > self._free.numel():
            self._free = self._chunk(max(need, self.chunk_bytes))
        out, self._free = self._free[:nbytes], self._free[need:]
        return out

    def copy(self, src: torch.Tensor) -> torch.Tensor:
        """`src` copied into the arena, same shape and dtype."""
        src = src.contiguous()
        out = self.empty(src.numel() * src.element_size()).view(src.dtype).view(src.shape)
        return out.copy_(src)

    def _chunk(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to align the start
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            buf.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(buf, dtype=torch.uint8)  # keeps buf alive
        skip = -whole.data_ptr() % HUGE_PAGE
        self.reserved += size
        return whole[skip:skip + size - HUGE_PAGE]
