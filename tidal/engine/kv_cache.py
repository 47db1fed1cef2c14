"""A worker's KV cache: its tensors, how many blocks fit the memory left beside the model,
and the block I/O that P/D transfers (and lower cache tiers) go through.

Every layer holds one K and one V tensor of `num_blocks + 1` blocks: block `num_blocks` is
the null block, which padded rows read and write. The scheduler's block ids index them.
Their elements are the model's dtype or quantized rows (tidal.model.kv_quant); block I/O
moves the bytes as they are, so P/D and the tiers carry codes and scales alike.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from tidal.engine.config import ModelConfig
from tidal.engine.device import free_ram, gpu_kv_budget
from tidal.model.config import ModelArch
from tidal.model.kv_quant import AUTO, KVFormat


def kv_blocks(config: ModelConfig, per_block: int, device: str,
              peak_step: Callable[[], None]) -> int:
    """Blocks of `per_block` bytes the pool gets: `num_kv_blocks` if given; else those that
    fit `kv_cache_memory`, or on a GPU the memory `gpu_memory_utilization` leaves after the
    largest step (`peak_step` runs it), or on a CPU `kv_cache_fraction` of the free RAM."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory:
        budget = config.kv_cache_memory
    elif device.startswith("cuda"):
        budget = gpu_kv_budget(device, config.gpu_memory_utilization, peak_step)
    else:
        budget = int(free_ram() * config.kv_cache_fraction)
    blocks = budget // per_block - 1  # the null block
    if blocks < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of {per_block}")
    return blocks


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zeroed cache tensor. On a CPU from calloc, whose pages the OS zeroes when first
    touched: a pool of gigabytes is ready at once and takes memory as its blocks fill
    (torch.zeros writes every byte up front: 0.5 s for the embedded model's 2 GiB pool).
    A block is always written before it is read, so serving meets a page's first touch
    once, in the step that fills it; only a timing run over contexts nobody wrote must
    `touch` the blocks it reads first."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def kv_message(kv: torch.Tensor) -> tuple[bytes, list[int], str]:
    """KV blocks as they travel between instances: bytes, shape and dtype."""
    return kv.cpu().view(torch.uint8).numpy().tobytes(), list(kv.shape), str(kv.dtype)


def kv_tensor(data: bytes, shape: list[int], dtype: str) -> torch.Tensor:
    """KV blocks from `kv_message`'s bytes, shape and dtype."""
    kind = getattr(torch, dtype.removeprefix("torch."))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).view(shape)

class KVCache:
    """The K and V tensors of every layer, `num_blocks` blocks of `block_size` positions
    plus the null block, in `fmt` for a model computing in `dtype` (`self.dtype` is the
    tensors' own: int8 or float8_e4m3fn when quantized, bfloat16 with that format)."""

    def __init__(self, arch: ModelArch, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: str, fmt: KVFormat = AUTO) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.format, self.dtype = fmt, fmt.storage(dtype)
        self.device = device
        self.null_block = num_blocks
        shape = fmt.cache_shape(num_blocks + 1, block_size, arch.num_kv_heads, arch.head_dim)
        self.layers = [(cache_zeros(shape, self.dtype, device),
                        cache_zeros(shape, self.dtype, device))
                       for _ in range(arch.num_layers)]
        self.k_caches = [k for k, _ in self.layers]
        self.v_caches = [v for _, v in self.layers]

    @torch.inference_mode()
    def touch(self, block_ids: list[int]) -> None:
        """Write the pages of blocks `block_ids` in place, their contents unchanged, so that
        steps timed now read memory as a warm server's do, not pages the OS maps on first
        touch."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for k, v in self.layers:
            k[ids] = k[ids]
            v[ids] = v[ids]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy blocks `src` to `dst` in every layer (ids on this device)."""
        for k, v in self.layers:
            k[dst] = k[src]
            v[dst] = v[src]

    @torch.inference_mode()
    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the KV at slots `src` to slots `dst` in every layer (a speculation tree's
        accepted nodes to the positions they now hold): every source is read before any
        destination is written, so one move's destination may be another's source."""
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for k, v in self.layers:
            for cache in (k, v):  # as bytes: index_copy_ has no float8 kernel
                flat = cache.view(-1, *cache.shape[2:]).view(torch.uint8)
                flat.index_copy_(0, d, flat.index_select(0, s))

    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int]) -> tuple[bytes, list[int], str]:
        """These blocks' KV (every layer's K then V) as bytes, with its shape and dtype:
        what a prefill instance sends its decode instance."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        kv = torch.stack([torch.stack((k.index_select(0, idx), v.index_select(0, idx)))
                          for k, v in self.layers])
        return kv_message(kv)

    def check_fits(self, shape: list[int], dtype: str, count: int,
                   kv_heads: int | None = None, layers: int | None = None) -> None:
        """ValueError unless KV of `shape` and `dtype` fits `count` of these blocks
        (`kv_heads`, `layers`: a whole model's, where this cache holds a rank's share)."""
        mine = [layers or len(self.layers), 2, count, *self.layers[0][0].shape[1:]]
        if kv_heads is not None:
            mine[4] = kv_heads
        if shape != mine or dtype != str(self.dtype):
            raise ValueError(f"KV of shape {shape} ({dtype}) does not fit this instance's "
                             f"{mine} ({self.dtype}): prefill and decode must run the same "
                             f"model, dtype, block size and --kv-cache-dtype")

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], data: bytes, shape: list[int],
                     dtype: str) -> None:
        """Write KV read by another instance's `read_blocks` into these blocks."""
        self.check_fits(shape, dtype, len(block_ids))
        kv = kv_tensor(data, shape, dtype).view(torch.uint8)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for (k, v), layer in zip(self.layers, kv.to(self.device)):
            k.view(torch.uint8).index_copy_(0, idx, layer[0])
            v.view(torch.uint8).index_copy_(0, idx, layer[1])

    @property
    def block_nbytes(self) -> int:
        """The bytes of one block's KV over every layer (K and V)."""
        k = self.layers[0][0]
        return 2 * len(self.layers) * k[0].numel() * k.element_size()

    @torch.inference_mode()
    def block_bytes(self, block_ids: list[int]) -> list[bytes]:
        """Each block's KV as bytes (each layer's K then V): what the disk tier stores."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        kv = torch.stack([torch.stack([c.index_select(0, idx) for c in caches])
                          for caches in (self.k_caches, self.v_caches)])  # [2, L, n, ...]
        kv = kv.transpose(0, 2).contiguous().cpu()  # [n, L, 2, ...]: one block a row
        return [row.view(torch.uint8).numpy().tobytes() for row in kv]

    @torch.inference_mode()
    def write_rows(self, block_ids: list[int], rows: torch.Tensor) -> None:
        """Write blocks' KV from rows of `block_bytes`' bytes ([n, block_nbytes] uint8 in
        host memory): one copy per layer and K or V for all of them."""
        shape = self.layers[0][0].view(torch.uint8).shape[1:]  # as bytes: float8 has no index_copy_
        # a blocking copy: the rows are read into again as soon as this returns
        kv = rows.view(len(block_ids), len(self.layers), 2, *shape).to(self.device)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for i, (k, v) in enumerate(self.layers):
            k.view(torch.uint8).index_copy_(0, idx, kv[:, i, 0])
            v.view(torch.uint8).index_copy_(0, idx, kv[:, i, 1])
