"""GGUF block kernels at decode sizes: GGUFLinear on each block format against a float32
PackedLinear and F.linear of the same shape, in ms a call and GB/s of weight bytes read;
then, per format, the integer kernels (the int8 panels from PANEL_ROWS rows, and the VNNI
or AVX2 kernel alone) against the dequantized-tile paths at more rows (where GGUFLinear's
max_rows should sit).

usage: .venv/bin/python benchmarks/gguf_kernels.py [--threads 2] [--rows 1,4,8,16]
       [--formats Q4_K,Q6_K] [--layout default|planar|file|both] [--crossover 8,16,24,32]
       [--crossover-dtype bfloat16|float32] [--crossover-shapes 1536x576,2048x2048]
The crossover's activations default to bfloat16: the tiles are then bf16 where bf16 GEMMs
win (AMX, Zen 4: `TILE_BF16`, as for the float32 activations `--dtype auto` serves there;
float32 elsewhere), which cross the integer kernel at other row counts than float32 tiles.
The weights are random valid blocks (the kernels' speed does not depend on the values).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

from tidal.model.gguf_quants import BLOCK_FIELDS, GGUFLinear, QuantizedWeight
from tidal.model.linear import PackedLinear

SHAPES = [(2048, 2048), (8192, 2048)]  # [out_features, in_features]
SCALE_FIELDS = {QT.Q4_1: (0, 2), QT.Q5_1: (0, 2), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2),
                QT.Q6_K: (208,)}  # byte offsets of each block's float16 scales; else (0,)


def random_blocks(qtype: QT, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row bytes] of random quants with small finite float16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in SCALE_FIELDS.get(qtype, (0,)):
        d = rng.uniform(1e-3, 1e-2, (n, k // block)).astype(np.float16)
        raw[:, :, at:at + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def timed(fn, x: torch.Tensor, budget: float = 0.3) -> float:
    """Median seconds a call, over repeats filling about `budget` seconds."""
    fn(x)
    t0 = time.perf_counter()
    fn(x)
    reps = max(3, min(200, int(budget / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def row(label: str, seconds: float, nbytes: int) -> str:
    return f"{label:>14} {seconds * 1e3:8.3f} ms {nbytes / seconds / 1e9:7.1f} GB/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--formats", default=",".join(t.name for t in BLOCK_FIELDS))
    parser.add_argument("--layout", choices=("default", "planar", "file", "both"),
                        default="default", help="default: QuantizedWeight's per format")
    parser.add_argument("--crossover", default="8,16,24,32")
    parser.add_argument("--crossover-dtype", choices=("bfloat16", "float32"),
                        default="bfloat16")
    parser.add_argument("--crossover-shapes", default="x".join(map(str, SHAPES[0])),
                        help="out x in features, comma-separated, e.g. 1536x576,2048x2048")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    formats = [QT[name] for name in args.formats.split(",")]
    layouts = {"default": [None], "planar": [True], "file": [False],
               "both": [True, False]}[args.layout]
    rng = np.random.default_rng(0)
    print(f"threads {torch.get_num_threads()}; ms a call (median) and GB/s of weight bytes")
    for n, k in SHAPES:
        dense = torch.randn(n, k)
        packed = PackedLinear(dense)
        for r in rows:
            x = torch.randn(r, k)
            print(f"--- {n}x{k}, {r} rows")
            print(row("PackedLinear", timed(packed, x), dense.numel() * 4))
            print(row("F.linear", timed(lambda v: F.linear(v, dense), x), dense.numel() * 4))
            for qtype in formats:
                raw = random_blocks(qtype, n, k, rng)
                for planar in layouts:
                    layer = GGUFLinear(QuantizedWeight("w", raw, qtype, (n, k), planar=planar))
                    label = qtype.name + ("" if len(layouts) == 1 else
                                          " planar" if planar else " file")
                    print(row(label, timed(layer, x), layer.nbytes))
    crossover = [int(r) for r in args.crossover.split(",")]
    dtype = args.crossover_dtype
    for shape in args.crossover_shapes.split(","):
        n, k = (int(d) for d in shape.split("x"))
        print(f"--- {n}x{k}: integer kernel (int8 panels from their rows, in AMX's tiles "
              f"where the CPU has them) / VNNI or AVX2 kernel / tiles (each panel in bf16 "
              f"where the CPU has AVX512-BF16: AMX tiles or VDPBF16PS) / oneDNN over "
              f"dequantized tiles, ms, by rows {crossover}, {dtype} activations")
        for qtype in formats:
            if k % GGML_QUANT_SIZES[qtype][0]:
                print(f"{qtype.name:>6} - (in_features {k}: not whole blocks of this format)")
                continue
            weight = QuantizedWeight("w", random_blocks(qtype, n, k, rng), qtype, (n, k))
            layers = [GGUFLinear(weight, max_rows=10**9),
                      GGUFLinear(weight, max_rows=10**9, panel_rows=0),
                      GGUFLinear(weight, max_rows=0),
                      GGUFLinear(weight, max_rows=0, bf16_panels=False)]
            cells = []
            for r in crossover:
                x = torch.randn(r, k).to(getattr(torch, dtype))
                cells.append("/".join(f"{timed(layer, x) * 1e3:.3f}" for layer in layers))
            print(f"{qtype.name:>6} " + "  ".join(cells))


if __name__ == "__main__":
    main()
