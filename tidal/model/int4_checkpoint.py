"""GPTQ and AWQ checkpoints: 4-bit weights in groups, served by the GGUF kernels.

Both store, per output channel and group of `group_size` input channels, a float16 scale s
and a 4-bit zero z, and per weight a 4-bit q: w = s * (q - z). Each projection is repacked
at load into GGUF blocks of 32 weights that hold exactly these values, with d = s: Q4_0
(w = d * (q - 8), 18 bytes) where every zero is 8 (symmetric checkpoints), else Q5_0
(w = d * (q5 - 16) with q5 = q - z + 16, 22 bytes; Q4_1's float16 m = -s * z would round).
They run GGUFLinear's integer kernels and tiles, in the C++ decoder too.

Packing (what the checkpoints hold, int32 words of 8 nibbles, lowest nibble first):
- GPTQ: qweight [in / 8, out] (8 input channels a word), qzeros [groups, out / 8] storing
  z - 1 (`checkpoint_format` "gptq", the default) or z ("gptq_v2"), scales [groups, out],
  g_idx [in]: input channel i's group, i // group_size, or with act-order (desc_act) any
  assignment of group_size channels to each group. Then the channels are reordered by group
  (a stable sort of g_idx) so each block of 32 lies in one group, and the projection
  gathers its input into that order (QuantizedWeight.in_perm); a fused q/k/v or gate/up
  shares one input, so its parts must share one order (GPTQ derives it from that input).
  A row-parallel split (o, down) would take scattered channels of every group: tensor
  parallelism is refused.
- AWQ (GEMM): qweight [in, out / 8] and qzeros [groups, out / 8] with nibble i of a word
  holding output channel 8c + AWQ_ORDER[i], scales [groups, out].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

from tidal.model.gguf_quants import QuantizedWeight
from tidal.model.gguf_weights import Weight
from tidal.model.tensor_parallel import Shard

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")


def read_checkpoint(folder: Path, quantization_config: dict,
                    shard: Shard | None = None) -> dict[str, Weight]:
    """HF name -> weight of a GPTQ/AWQ folder: each quantized projection a Q4_0/Q5_0
    QuantizedWeight under `<module>.weight`, the rest torch tensors as stored; `shard`:
    one tensor-parallel rank's part of each (whole blocks of 32)."""
    from safetensors import safe_open

    q = quantization_config
    method = q["quant_method"].lower()
    group = q.get("group_size", q.get("q_group_size"))
    raw: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                raw[name] = f.get_tensor(name)
    packed = [n for n in raw if n.endswith(".qweight")]
    if not packed:  # dense weights under a quantized config would load as dense
        dense = next((n for n in raw if n.endswith("_proj.weight")), "a projection's weight")
        raise ValueError(f"{folder}: config.json declares a {method} checkpoint, but its "
                         f"tensors hold no {dense.removesuffix('.weight')}.qweight (dense "
                         f"weights? drop quantization_config to load them as they are)")
    weights: dict[str, Weight] = {}
    for name in packed:
        module = name.removesuffix(".qweight")
        parts = {p: raw.pop(module + p, None) for p in _PARTS}
        module = module if shard is None else shard.local_name(module)
        if module is None:  # a layer or routed expert another rank holds
            continue
        if parts[".qzeros"] is None or parts[".scales"] is None:
            raise ValueError(f"{folder}: {module} has a qweight without qzeros and scales")
        perm = None
        if method == "gptq":
            q4, zeros, perm = unpack_gptq(parts[".qweight"], parts[".qzeros"], parts[".g_idx"],
                                          group, v2=q.get("checkpoint_format") == "gptq_v2",
                                          name=module)
        else:
            q4, zeros = unpack_awq(parts[".qweight"], parts[".qzeros"])
        if perm is not None and shard is not None and shard.size > 1:
            raise ValueError(f"{folder}: {module}: an act-order (desc_act) GPTQ checkpoint "
                             f"does not split across ranks (--tensor-parallel-size "
                             f"{shard.size}): a row-parallel part would hold scattered "
                             "channels of every group; serve it with one rank a stage")
        scales = parts[".scales"].float().numpy().T  # [out, groups]
        blocks, qtype = gguf_blocks(q4, scales, zeros, group)
        shape = q4.shape
        if shard is not None:
            blocks, shape = shard.take_matrix(module + ".weight", blocks, shape,
                                              GGML_QUANT_SIZES[qtype][1])
        weights[module + ".weight"] = QuantizedWeight(
            module, blocks, qtype, shape, in_perm=None if perm is None else torch.from_numpy(perm))
    if shard is not None:
        raw = {own: shard.take(n, t) for n, t in raw.items()  # not other ranks' layers or experts
               if (own := shard.local_name(n)) is not None}
    weights.update(raw)
    return weights


def _nibbles(words: torch.Tensor, axis: int) -> np.ndarray:
    """The 8 nibbles of each int32 word, lowest first, spread along `axis` (x8 its size)."""
    w = words.numpy().view(np.uint32)
    parts = np.stack([(w >> (4 * i)) & 15 for i in range(8)], axis=axis + 1)
    shape = list(w.shape)
    shape[axis] *= 8
    return parts.reshape(shape).astype(np.uint8)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, g_idx: torch.Tensor | None,
                group: int, v2: bool = False, name: str = "",
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q [out, in] uint8, zeros [out, groups] uint8, perm) of a GPTQ projection: with an
    act-order g_idx, q's columns are the input channels in group order, perm (int64 [in])
    the channel each column holds; else perm is None."""
    q = _nibbles(qweight, 0).T  # [in, out] -> [out, in]
    k = q.shape[1]
    zeros = _nibbles(qzeros, 1).T  # [groups, out] -> [out, groups]
    zeros = (zeros if v2 else zeros + 1).astype(np.uint8)
    consecutive = np.arange(k) // group
    if g_idx is None or np.array_equal(g_idx.numpy(), consecutive):
        return np.ascontiguousarray(q), zeros, None
    perm = np.argsort(g_idx.numpy(), kind="stable")
    if not np.array_equal(g_idx.numpy()[perm], consecutive):
        raise ValueError(f"GPTQ {name}: g_idx gives its groups other than {group} input "
                         "channels each (group_size)")
    return np.ascontiguousarray(q[:, perm]), zeros, perm.astype(np.int64)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(q [out, in] uint8, zeros [out, groups] uint8) of an AWQ (GEMM) projection."""
    order = np.argsort(AWQ_ORDER)  # nibble position of each output channel in its word

    def columns(words: torch.Tensor) -> np.ndarray:
        v = _nibbles(words, 1)  # [rows, out]: nibble order within each word of 8
        rows, out = v.shape
        return v.reshape(rows, out // 8, 8)[:, :, order].reshape(rows, out)
    return np.ascontiguousarray(columns(qweight).T), columns(qzeros).T


def gguf_blocks(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray,
                group: int) -> tuple[np.ndarray, QT]:
    """(bytes [out, in / 32 * block bytes], type) of Q4_0 or Q5_0 blocks holding exactly
    w = scale * (q - zero): q [out, in] (0..15), scales and zeros [out, in / group]."""
    n, k = q.shape
    per = group // 32
    d = np.repeat(scales, per, axis=1).astype(np.float16)[..., None].view(np.uint8)
    centred = (q.astype(np.int16) - np.repeat(zeros, group, axis=1)).reshape(n, k // 32, 32)
    symmetric = bool(np.all(zeros == 8))
    v = (centred + (8 if symmetric else 16)).astype(np.uint8)  # 0..15, or 1..31
    qs = (v[..., :16] & 15) | ((v[..., 16:] & 15) << 4)  # element i low, i + 16 high
    if symmetric:
        return np.ascontiguousarray(np.concatenate([d, qs], -1).reshape(n, -1)), QT.Q4_0
    bits = ((v >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    qh = bits.sum(-1, dtype=np.uint32)[..., None].view(np.uint8)  # bit i: element i's fifth
    blocks = np.concatenate([d, qh, qs], -1)
    return np.ascontiguousarray(blocks.reshape(n, -1)), QT.Q5_0
