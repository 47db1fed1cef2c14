"""GGUF tensors in their own formats: no float32 copy of a quantized weight.

`QuantizedWeight` holds one tensor's blocks as bytes (a view of the file's memory map where
it can) and `GGUFLinear` multiplies by them: steps of a few rows through the C++ kernels
(`csrc/gguf_quants.cpp`: activations rounded to int8 per 32 and integer dot products, as
ggml does; a decode step reads every weight once, so reading 4-8 bits a weight instead of
16-32 is the speed-up), larger ones through tiles of dequantized rows that oneDNN multiplies,
so the extra memory stays one tile however large the weight.
"""

from __future__ import annotations

import warnings
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
from torch import nn

from tidal.model.cpu_extension import extension
from tidal.model.linear import bf16_gemms_win, cpu_flags
from tidal.model.weight_arena import WeightArena

FLOAT_TYPES = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}
# Each block format's fields, bytes each, in the block's order (ggml's block structs).
BLOCK_FIELDS = {
    QT.Q8_0: (2, 32),               # d, qs
    QT.Q4_0: (2, 16),               # d, qs
    QT.Q4_1: (2, 2, 16),            # d, m, qs
    QT.Q5_0: (2, 4, 16),            # d, qh, qs
    QT.Q5_1: (2, 2, 4, 16),         # d, m, qh, qs
    QT.Q4_K: (2, 2, 12, 128),       # d, dmin, scales, qs
    QT.Q5_K: (2, 2, 12, 32, 128),   # d, dmin, scales, qh, qs
    QT.Q6_K: (128, 64, 16, 2),      # ql, qh, scales, d
}
SUPPORTED = frozenset(FLOAT_TYPES) | frozenset(BLOCK_FIELDS)
# Formats whose kernels read planar rows (each field contiguous: two blocks' quants one
# load, eight blocks' scales another); the K-quants' kernel reads the file's layout.
PLANAR = frozenset({QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1})
# The integer kernels' crossover with dequantized tiles (benchmarks/gguf_kernels.py
# --crossover, --crossover-dtype). With AVX-512 VNNI ~40-64 rows by shape for bf16
# activations on AMX (SmolLM2's 576x1536 Q4_1 at 48 rows: 0.26 ms against 0.32, 2048x2048:
# 1.33 against 1.11), far more against float32 tiles. With AVX2 alone (DOT8 below) 32-48:
# 2048x2048 on a 2-core AMD EPYC (Zen 3) at 32 rows, bf16 activations, Q8_0 4.0 ms against
# 4.5, Q4_K 2.2 against 4.7, Q6_K 4.0 against 4.6; at 48 Q6_K 6.4 against 5.6. Without
# AVX2's F16C and FMA, 16.
VNNI = {"avx512_vnni", "avx512bw"} <= cpu_flags()
# With AVX2 and no AVX-512 VNNI the planar nibble formats take gguf_dot8.h, whose rows share
# each unpacked block: it beats float32 tiles at every size measured (2048x2048 Q4_1 on a
# 2-core AMD EPYC, Zen 3: 0.95 ms against 3.63 at 16 rows, 14.8 against 20.9 at 256). Its
# builds read the quants of those formats' planar rows in rounds of 8 blocks (NIBBLE_ROUNDS;
# csrc/gguf_formats.h), the order the kernel multiplies them in.
DOT8 = {"avx2", "fma", "f16c"} <= cpu_flags() and not VNNI
MAX_ROWS = 48 if VNNI else 32 if DOT8 else 16
NIBBLE_MAX_ROWS = 256 if DOT8 else MAX_ROWS
# The most rows, x's and their residuals together, for which a step with prompt rows to round
# twice takes the integer kernels (at most max_rows, except at the default crossover where
# the tiles are bf16 (AMX's int8 tiles, or the VNNI kernels past max_rows): prompts of up to
# 48 tokens keep their ~15 bits a value, as they did on float32 tiles, and the README's
# first answer its tokens); float32 tiles take a residual for free. The
# embedded model's prefill on a 2-core Zen 3 (min of 4): 32 tokens 141 ms on the kernels
# against 175 on tiles, 48 tokens 198 against 199, 64 tokens 244 against 226.
TWICE_MAX_ROWS = 96
NIBBLE_ROUNDS = DOT8
NIBBLES = frozenset({QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1})
# Steps of PANEL_ROWS rows or more multiply planar 32-weight formats (PLANAR) and the
# K-quants (K_QUANTS) a panel of 16 weight rows at a time in int8 (csrc/gguf_int8_panels.h:
# the VNNI kernels' integer sums, for PLANAR their float operations too where in_features is
# a multiple of 512, else within float32 rounding): in AMX's int8 tiles where the CPU grants
# AMX, else by AVX-512 VNNI. Up to 16 rows (one request verifying 15 guesses) stay on the
# VNNI kernels, so a row's result does not depend on the rows beside it there.
# With AMX the int8 tiles take steps up to AMX_MAX_ROWS rows (K_AMX_MAX_ROWS with a K-quant
# part), past which bf16 tiles take over: AMX bf16 tiles of each panel's weights
# (csrc/gguf_bf16_panels.h), whose sums need no float work a block (2048x2048 at 64 rows:
# Q4_1 0.61 ms against the int8 tiles' 0.82, Q6_K 0.58 against 0.94; at 32 rows K-quants
# 0.43-0.45 against 0.46-0.54, Q4_1 ties), oneDNN's GEMMs over dequantized tiles for steps
# of more than ~1.5 MB of x. Nor do the tiles run steps of 16 rows or fewer faster in a
# model, whose weights stream from memory (a kernel timed alone keeps them cached):
# SmolLM2's decode step at 8 rows took 16.3-17.8 ms with its 576-wide projections on the
# tiles against 12.7-14.1 on VNNI, at 16 rows 21.2-22.2 against 21.4-23.2.
# Without AMX the VNNI panels take every step past 16 rows (VNNI_PANELS_MAX_ROWS: no
# crossover) but those with more prompt rows than TWICE_MAX_ROWS rounds twice: on a 2-core
# Zen 4 (bf16 activations, SmolLM2's Q4_1 and Q8_0 shapes, benchmarks/gguf_kernels.py
# --crossover) at about the bf16 panels' speed (a median 1.1x, 0.8-1.3x by shape and run,
# from 24 to 2,048 rows), with the integer kernels' products where the bf16 panels' are
# ~0.3% apart.
K_QUANTS = frozenset({QT.Q4_K, QT.Q5_K, QT.Q6_K})
PANEL_ROWS = 17
AMX_MAX_ROWS = 48
K_AMX_MAX_ROWS = 32
VNNI_PANELS_MAX_ROWS = 1 << 30
# Dequantized tiles in bf16 (the default of GGUFLinear's `tile_bf16`) where bf16 GEMMs win
# (AMX; AVX512-BF16 on AMD: a 2-core Zen 4's Q4_1 tiles of 576x1536 1.3x faster at 128 rows,
# 2.0x at 2,048, of 2048x2048 2.6-3.2x from 49 rows).
TILE_BF16 = bf16_gemms_win()
# Where bf16 panels (csrc/gguf_bf16_panels.h) run without AMX (VDPBF16PS on Zen 4) and the
# int8 panels do not take a projection, the VNNI kernels' crossover with them: a 2-core
# Zen 4, bf16 activations, Q4_1 at 16 rows: 960x576 0.103 ms against 0.111, 3072x576 0.264
# against 0.348, 576x1536 0.133 against 0.125; at 24 rows 1.25-1.5x faster for every shape
# of SmolLM2.
PANELS_MAX_ROWS = 16
# float32 bytes of a dequantized tile: 512-2048 rows, whose bf16 GEMMs run ~30% faster on
# AMX than 256-512 rows' (a 1024-token prefill of 8192x2048 Q4_K: 24 vs 35 ms, measured)
TILE_BYTES = 16 << 20


class QuantizedWeight:
    """One GGUF tensor of logical shape [out_features, in_features] in its own format.

    `data` is any array of the tensor's bytes as the file holds them (a numpy memmap from
    gguf.GGUFReader: the weight then stays a view of the file unless repacked or given an
    `arena`, a WeightArena its blocks are copied into). With `planar` (None: for the
    formats in PLANAR) each row is repacked so each block field (scales, quants, high bits)
    lies in a plane of its own: contiguous quants and aligned scales for the kernels, in
    exactly the file's bytes (`nbytes`), never floats; `rounds` (None: NIBBLE_ROUNDS, what
    this CPU's kernels read) lays a planar nibble format's quants in rounds of 8 blocks. A
    type outside SUPPORTED raises ValueError naming the tensor and its type. `in_perm`: the
    input features its columns hold, in order (column j multiplies feature in_perm[j]: a
    GPTQ act-order checkpoint's, its groups made contiguous); None: their own order.
    """

    def __init__(self, name: str, data: Any, qtype: int | QT, shape: tuple[int, int],
                 planar: bool | None = None, use_extension: bool = True,
                 arena: WeightArena | None = None, rounds: bool | None = None,
                 in_perm: torch.Tensor | None = None) -> None:
        try:
            qtype = QT(qtype)
        except ValueError:
            raise ValueError(f"GGUF tensor {name!r} has unknown ggml type {qtype}") from None
        if qtype not in SUPPORTED:
            raise ValueError(f"GGUF tensor {name!r} has type {qtype.name}, which tidal does not "
                             f"run; it runs {', '.join(sorted(t.name for t in SUPPORTED))}")
        n, k = (int(d) for d in shape)
        block, size = GGML_QUANT_SIZES[qtype]
        if k % block:
            raise ValueError(f"GGUF tensor {name!r} ({qtype.name}): in_features {k} is not a "
                             f"multiple of its block of {block}")
        raw = _as_bytes(data)
        if raw.numel() != n * (k // block) * size:
            raise ValueError(f"GGUF tensor {name!r} ({qtype.name}, {n}x{k}) needs "
                             f"{n * (k // block) * size} bytes, got {raw.numel()}")
        self.name, self.qtype, self.shape = name, qtype, (n, k)
        self.in_perm = in_perm
        self.ext = extension() if use_extension else None
        self.planar = qtype in BLOCK_FIELDS and (qtype in PLANAR if planar is None else planar)
        self.rounds = self.planar and qtype in NIBBLES and (
            NIBBLE_ROUNDS if rounds is None else rounds)
        rows = raw.view(n, -1)
        if qtype in FLOAT_TYPES:
            self.data = rows.view(FLOAT_TYPES[qtype])
            return
        out = None if arena is None else arena.empty(rows.numel()).view(rows.shape)
        if self.planar:
            self.data = _to_planes(rows, BLOCK_FIELDS[qtype], out, self.rounds)
        else:
            self.data = rows if out is None else out.copy_(rows)

    @property
    def nbytes(self) -> int:
        """Bytes this weight holds (for block formats, those of the file's blocks)."""
        return self.data.numel() * self.data.element_size()

    def dequantize_rows(self, start: int, stop: int,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows start..stop of the weight as a [stop - start, in_features] tensor of `dtype`."""
        return self.take_rows(torch.arange(start, stop), dtype)

    def take_rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` of the weight as a [len(ids), in_features] tensor of `dtype`."""
        ids = ids.to(torch.long)
        if self.qtype in FLOAT_TYPES:
            return self.data[ids].to(dtype)
        if self.ext is not None and dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(len(ids), self.shape[1], dtype=dtype)
            self.ext.gguf_get_rows(self.data, int(self.qtype), self.planar, ids, out,
                                   rounds=self.rounds)
            return out
        blocks = self.data[ids]
        if self.planar:
            blocks = _from_planes(blocks, BLOCK_FIELDS[self.qtype], self.rounds)
        return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), self.qtype)).to(dtype)

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.name!r}, {self.qtype.name}, {list(self.shape)})"


def _as_bytes(data: Any) -> torch.Tensor:
    """The array's bytes as a flat uint8 tensor, sharing its memory."""
    if isinstance(data, torch.Tensor):
        return data.contiguous().view(-1).view(torch.uint8)
    arr = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():  # a read-only memmap: the weights are never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def _to_planes(rows: torch.Tensor, sizes: tuple[int, ...], out: torch.Tensor | None = None,
               rounds: bool = False) -> torch.Tensor:
    """[n, blocks * block_bytes] as the file holds them -> each field in a plane of the row
    (the planes in field order; into `out` if given), one strided copy a field and no
    temporaries; with `rounds` the last field (a nibble format's quants) in rounds."""
    n, block_bytes = rows.shape[0], sum(sizes)
    blocks = rows.view(n, -1, block_bytes)
    nb = blocks.shape[1]
    out = torch.empty_like(rows) if out is None else out
    for field, plane, last in _fields(blocks, out, sizes):
        if rounds and last:
            _copy_rounds(field, plane, nb, to_plane=True)
        else:
            plane.copy_(field)
    return out


def _from_planes(rows: torch.Tensor, sizes: tuple[int, ...],
                 rounds: bool = False) -> torch.Tensor:
    """The inverse of _to_planes: rows back in the file's block layout."""
    n, block_bytes = rows.shape[0], sum(sizes)
    nb = rows.shape[1] // block_bytes
    out = torch.empty(n, nb, block_bytes, dtype=torch.uint8)
    for field, plane, last in _fields(out, rows.contiguous(), sizes):
        if rounds and last:
            _copy_rounds(field, plane, nb, to_plane=False)
        else:
            field.copy_(plane)
    return out.view(n, -1)


def _fields(blocks: torch.Tensor, planes: torch.Tensor, sizes: tuple[int, ...]):
    """Each field as (its bytes in blocks [n, nb, block_bytes], its plane as [n, nb, size],
    whether it is the last)."""
    n, nb = blocks.shape[:2]
    at = 0
    for i, size in enumerate(sizes):
        yield (blocks[:, :, at // nb:at // nb + size],
               planes[:, at:at + nb * size].view(n, nb, size), i == len(sizes) - 1)
        at += nb * size


def _copy_rounds(field: torch.Tensor, plane: torch.Tensor, nb: int, to_plane: bool) -> None:
    """Copies 16-byte quants between the file's block order and the plane's rounds: each
    whole 8 blocks' dword i of block l at 32 i + 4 l; the last nb % 8 blocks as they are."""
    n, whole = field.shape[0], nb // 8 * 8
    blocks = field[:, :whole].view(n, nb // 8, 8, 4, 4)  # [round, block, dword, byte]
    rounds = plane[:, :whole].view(n, nb // 8, 4, 8, 4)  # [round, dword, block, byte]
    if to_plane:
        rounds.copy_(blocks.transpose(2, 3))
        plane[:, whole:].copy_(field[:, whole:])
    else:
        blocks.copy_(rounds.transpose(2, 3))
        field[:, whole:].copy_(plane[:, whole:])


class PromptRows:
    """The rows of the current forward pass that hold prompt tokens, which the GGUF
    projections round twice (int8, plus the int8 rounding of what that left: ~15 bits a
    value, so a prompt reads about as from the dequantized weights; on bf16 tiles x itself,
    which bf16 keeps fewer bits of) while generated tokens' rows are rounded once, as ggml
    rounds them, keeping decoding as fast. Whether a row is
    rounded twice follows from its token alone, so a token never depends on what else its
    step holds. `rows` index the pass's rows and `head` the LM head's (logits) rows; None:
    none. Set by `tidal.engine.batch.forward` before each pass; `attach` shares one among a
    model's GGUFLinear layers."""

    __slots__ = ("rows", "num_rows", "head", "num_head")

    def __init__(self) -> None:
        self.set(None, 0, None, 0)

    def set(self, rows: torch.Tensor | None, num_rows: int, head: torch.Tensor | None,
            num_head: int) -> None:
        self.rows, self.num_rows, self.head, self.num_head = rows, num_rows, head, num_head

    def of(self, is_head: bool, n: int) -> torch.Tensor | None:
        """The rows to round twice of a projection's n input rows; None for a projection over
        other rows than the pass's (or the head's) own."""
        rows, count = (self.head, self.num_head) if is_head else (self.rows, self.num_rows)
        return rows if count == n else None

    def every_row(self, logits_of):
        """`logits_of` (the model's head) over rows that all hold prompt tokens: a prompt's
        logprobs are read from the rows its prefill computed."""
        def run(h: torch.Tensor) -> torch.Tensor:
            saved = self.head, self.num_head
            self.head, self.num_head = torch.arange(h.shape[0], device=h.device), h.shape[0]
            try:
                return logits_of(h)
            finally:
                self.head, self.num_head = saved
        return run

    @classmethod
    def attach(cls, model: nn.Module) -> "PromptRows | None":
        """One PromptRows shared by `model`'s GGUFLinear layers (the LM head's marked as
        such), as `model.prompt_rows`; None when the model has none."""
        layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
        if not layers:
            return None
        shared = cls()
        for m in layers:
            m.prompt_rows, m.is_head = shared, m is getattr(model, "lm_head", None)
        model.prompt_rows = shared
        return shared


class GGUFLinear(nn.Module):
    """y = x @ [W_0; W_1; ...]^T (+ bias) for QuantizedWeights W_i of block formats and one
    in_features: the parts' outputs side by side, so a fused q/k/v or gate/up keeps each
    part in the file's format (a Q4_K_M file has Q6_K v beside Q4_K q and k). With the C++
    extension (`projection`, which the C++ decoder shares) steps of at most `max_rows` rows
    (None: the parts' kernels' crossover: MAX_ROWS, NIBBLE_MAX_ROWS, (K_)AMX_MAX_ROWS,
    VNNI_PANELS_MAX_ROWS, PANELS_MAX_ROWS) run the integer kernels, from `panel_rows` rows
    (None: PANEL_ROWS where every part is a planar 32-weight format or a K-quant and the
    build has AVX-512 VNNI; 0: never) in int8 panels with the same integer sums (in AMX's
    tiles where the CPU grants them and `amx`; False: VNNI, and bf16 panels by VDPBF16PS
    instead of AMX bf16 tiles), and larger ones multiply dequantized weights (with
    `bf16_panels` and bf16 tiles, each panel of 16 weight rows in bf16 where the CPU has
    AVX512-BF16: in AMX tiles, else by VDPBF16PS, no dequantized weight in memory; else
    oneDNN over tiles of `tile_rows` rows)
    by the activations rounded as the integer kernels round them: float32 tiles, the same
    sums up to float32 rounding, so a token does not depend on its step's size; bf16 tiles
    (of float32 inputs too) where bf16 GEMMs run faster (AMX: serving the embedded model to
    64 clients at 1.7x the float32 tiles' tokens/s; Zen 4), ~0.3% apart (`tile_bf16`;
    None: TILE_BF16, linear.bf16_gemms_win).
    Without the extension every step multiplies tiles dequantized by the gguf package.
    The rows of prompt tokens `prompt_rows` names are rounded twice (see PromptRows)."""

    def __init__(self, weights: QuantizedWeight | list[QuantizedWeight],
                 bias: torch.Tensor | None = None, max_rows: int | None = None,
                 tile_rows: int | None = None, tile_bf16: bool | None = None,
                 panel_rows: int | None = None, bf16_panels: bool = True,
                 amx: bool = True) -> None:
        super().__init__()
        self.parts = [weights] if isinstance(weights, QuantizedWeight) else list(weights)
        if any(w.qtype not in BLOCK_FIELDS for w in self.parts):
            raise ValueError(f"GGUFLinear multiplies block formats; got "
                             f"{[(w.name, w.qtype.name) for w in self.parts]}")
        k = self.parts[0].shape[1]
        if any(w.shape[1] != k for w in self.parts):
            raise ValueError(f"GGUF parts of one projection differ in in_features: {self.parts}")
        self.in_features, self.out_features = k, sum(w.shape[0] for w in self.parts)
        # the parts' input order (act-order GPTQ), which x is gathered into: one for all
        self.in_perm = self.parts[0].in_perm
        if any(not _same_perm(w.in_perm, self.in_perm) for w in self.parts):
            raise ValueError(f"{[w.name for w in self.parts]}: fused projections whose "
                             "act-order (desc_act) g_idx differ are not supported")
        self.bias = None if bias is None else bias.detach()
        self.tile_rows = tile_rows or min(2048, max(256, TILE_BYTES // (4 * k) // 16 * 16))
        ext = self.parts[0].ext
        tile_bf16 = TILE_BF16 if tile_bf16 is None else tile_bf16
        # whether the int8 and bf16 panels take every part (csrc/gguf_panel.h)
        paneled = ext is not None and all(
            w.qtype in K_QUANTS or (w.qtype in PLANAR and w.planar) for w in self.parts)
        self.panel_rows = (PANEL_ROWS if panel_rows is None else panel_rows) if (
            paneled and ext.gguf_int8_panels) else 0
        self.amx = bool(amx and ext is not None and ext.gguf_amx)
        panels = (paneled and bf16_panels and tile_bf16 and ext.gguf_bf16_panels
                  and all(w.shape[0] % 16 == 0 for w in self.parts))
        default_max = max_rows is None
        if max_rows is None:  # the crossover of the parts' kernels
            nibbles = all(w.qtype in NIBBLES and w.planar for w in self.parts)
            amx_max = (K_AMX_MAX_ROWS if any(w.qtype in K_QUANTS for w in self.parts)
                       else AMX_MAX_ROWS)
            int8_max = amx_max if self.amx else VNNI_PANELS_MAX_ROWS
            max_rows = (int8_max if self.panel_rows else PANELS_MAX_ROWS if panels
                        else NIBBLE_MAX_ROWS if nibbles else MAX_ROWS)
        self.max_rows = max_rows if ext is not None else 0
        # past the crossover the tiles would round a short prompt to bf16: a default one
        # keeps it on the integer kernels (any count) or the int8 tiles, rounded twice
        self.twice_max_rows = (TWICE_MAX_ROWS if (self.panel_rows or tile_bf16) and default_max
                               and self.max_rows else min(self.max_rows, TWICE_MAX_ROWS))
        self.prompt_rows: PromptRows | None = None  # shared by the model's layers (attach)
        self.is_head = False
        self.tile_bf16, self.bf16_panels = tile_bf16, bf16_panels
        self.projection = None
        self._build()

    def _build(self) -> None:
        ext = self.parts[0].ext
        self.projection = None if ext is None else ext.GGUFProjection(
            [ext.GGUFPart(w.data, int(w.qtype), w.planar, w.rounds) for w in self.parts],
            self.bias, self.max_rows, self.twice_max_rows, self.tile_rows, self.tile_bf16,
            self.panel_rows, self.bf16_panels, self.amx, self.in_perm)

    def one_kernel(self) -> None:
        """Every step through the integer kernels, prompt rows rounded twice included: each
        row's sums are its own at any row count (batch-invariant inference), where the
        crossovers to tiles would change them with the step's size. The int8 panels keep
        their steps only where their sums are the kernels' bit for bit: 32-weight formats
        over whole rounds of 16 blocks (in_features a multiple of 512)."""
        if self.projection is not None:
            self.max_rows = self.twice_max_rows = 1 << 30
            if not (all(w.qtype in PLANAR for w in self.parts) and self.in_features % 512 == 0):
                self.panel_rows, self.amx = 0, False
            self._build()

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.parts)

    takes_bf16_out = True  # forward's bf16_out (linear.products asks for it)

    def forward(self, x: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
        """y = x W^T (+ bias) in x's dtype; with `bf16_out`, in bf16 where bf16 tiles
        computed it and no bias is added (their products, unconverted)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.projection is not None and x.dtype in (torch.float32, torch.bfloat16):
            twice = (None if self.prompt_rows is None
                     else self.prompt_rows.of(self.is_head, x2.shape[0]))
            y = self.projection(x2, twice, bf16_out)  # (it gathers x into in_perm's order)
        else:
            y = self._tiled(x2 if self.in_perm is None else x2.index_select(1, self.in_perm))
        return y.view(*lead, self.out_features)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """The fallback without the extension (or for float16 inputs), in float32."""
        xs = x.float()
        ys = []
        for w in self.parts:
            for a in range(0, w.shape[0], self.tile_rows):
                ys.append(F.linear(xs, w.dequantize_rows(a, min(w.shape[0], a + self.tile_rows))))
        y = torch.cat(ys, dim=1)
        if self.bias is not None:
            y += self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        kinds = "+".join(w.qtype.name for w in self.parts)
        return (f"{kinds}, in_features={self.in_features}, out_features={self.out_features}, "
                f"max_rows={self.max_rows}, panel_rows={self.panel_rows}")


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and torch.equal(a, b))


class GGUFEmbedding(nn.Module):
    """A token embedding looked up in the file's format: a step dequantizes only its tokens'
    rows (into `dtype`). A float-typed table is kept as a tensor of `dtype` instead."""

    def __init__(self, weight: QuantizedWeight | torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.quantized = weight if isinstance(weight, QuantizedWeight) else None
        self.table = None if self.quantized is not None else weight.to(dtype)
        self.num_embeddings, self.embedding_dim = (weight.shape[0], weight.shape[1])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return F.embedding(ids, self.table)
        flat = ids.reshape(-1)
        return self.quantized.take_rows(flat, self.dtype).view(*ids.shape, self.embedding_dim)
