"""GGUF projections on bf16 tiles (the default where bf16 GEMMs win: AMX, Zen 4): each
panel of 16 weight rows multiplied in bf16 (AMX tiles, or VDPBF16PS) gives the dequantized
tiles' products; without AMX the int8 panels take steps past 16 rows without prompt rows,
at any count, and the bf16 panels those they cannot take; prompt rows
on bf16 tiles are x itself, and short prompts keep their rounding twice on the integer
kernels; bf16 outputs are the tiles' products unconverted. Tolerances as in
test_gguf_quants.py: bf16 rounds a product to 2^-8."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
from test_gguf_quants import (EXT, FORMATS, dequantized, exact_x, k_for, needs_ext,
                              relative_errors, run, weight_bytes)

from tidal.model.gguf_quants import (MAX_ROWS, PANELS_MAX_ROWS, TILE_BF16,
                                     VNNI_PANELS_MAX_ROWS, GGUFLinear, PromptRows,
                                     QuantizedWeight)


@pytest.mark.skipif(EXT is None or not TILE_BF16, reason="needs bf16 tiles by default")
@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q4_K], ids=lambda t: t.name)
def test_short_prompts_keep_their_twice_rounding_past_the_tiles_crossover(qtype):
    """At the default crossover where tiles are bf16 (AMX, Zen 4), a step of up to 48 prompt
    tokens (96 rows with their residuals) stays on the integer kernels (the int8 panels or
    the VNNI kernels), rounded twice, where on AMX steps without prompt rows of that size take
    bf16 tiles: a prompt row comes out as the integer kernels give it, not as bf16 x would."""
    rng = np.random.default_rng(int(qtype) + 31)
    n, k = 32, k_for(qtype, 3 if GGML_QUANT_SIZES[qtype][0] == 256 else 24)
    weight = QuantizedWeight("w", weight_bytes(qtype, n, k, rng), qtype, (n, k))
    default, integer = GGUFLinear(weight), GGUFLinear(weight, max_rows=10**9)
    assert 2 * 40 <= default.twice_max_rows  # past AMX's int8 tiles, yet integer
    x = rng.standard_normal((40, k)).astype(np.float32)
    for layer in (default, integer):
        layer.prompt_rows = PromptRows()
        layer.prompt_rows.set(torch.arange(40), 40, None, 0)
    assert np.array_equal(run(default, x, torch.float32), run(integer, x, torch.float32))


@pytest.mark.skipif(EXT is None or not EXT.gguf_bf16_panels, reason="needs AVX512-BF16")
@pytest.mark.parametrize("amx", [True, False], ids=["amx-where-granted", "vdpbf16ps"])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_bf16_panels_give_the_dequantized_tiles_products(qtype, amx):
    """Steps past the integer kernels, in whole panels of 16 weight rows, multiply each panel
    in bf16 (AMX tiles where granted, else VDPBF16PS): each output is bf16(x) @ bf16(W)^T
    summed in float32 and rounded to bf16 (in float32 and bf16 outputs alike), at row counts
    that fill 16-row tiles and 6-row blocks or leave 1-5 rows of a last one, two parts side
    by side (a fused q/k/v's) each into its own columns, an odd count of panels (43: taken two
    by two on AMX, the last alone; four by four by VDPBF16PS, a thread's last 1-3 alone) and
    more than a thread's group of them (20 of 768 values), and steps taken in passes of rows
    (1,100 rows of 768: a pass holds 1,024)."""
    rng = np.random.default_rng(int(qtype) + 29)
    n, other, k = 688, 32, k_for(qtype, 3 if GGML_QUANT_SIZES[qtype][0] == 256 else 24)
    raw, raw2 = weight_bytes(qtype, n, k, rng), weight_bytes(QT.Q8_0, other, k, rng)
    layer = GGUFLinear([QuantizedWeight("w", raw, qtype, (n, k)),
                        QuantizedWeight("v", raw2, QT.Q8_0, (other, k))], max_rows=0,
                       tile_bf16=True, amx=amx)
    assert layer.projection.bf16_panels

    def bf16(a):
        return torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16).double().numpy()
    w = bf16(np.concatenate([dequantized(raw, qtype), dequantized(raw2, QT.Q8_0)]))
    for rows in (3, 8, 17, 64, 100, 301, 1100):
        x = exact_x(rows, k, rng)  # as the int8 grid and bf16 hold it
        got = layer(torch.from_numpy(x)).double().numpy()
        assert np.array_equal(got, bf16(got))  # products rounded to bf16
        assert np.array_equal(layer(torch.from_numpy(x), bf16_out=True).double().numpy(), got)
        ref = x.astype(np.float64) @ w.T
        np.testing.assert_allclose(got, ref, rtol=2 ** -8, atol=1e-5 * np.abs(ref).max())


@pytest.mark.skipif(EXT is None or not EXT.gguf_int8_panels or EXT.gguf_amx,
                    reason="needs the int8 panels without AMX")
def test_steps_past_16_rows_take_the_int8_panels_where_they_run_without_amx():
    """Without AMX the int8 panels (VNNI) take every step of more than 16 rows of a projection
    they take (planar 32-weight formats, K-quants), at any count (VNNI_PANELS_MAX_ROWS): a
    step of 17 or 300 rows gives the VNNI kernels' products bit for bit (rows of whole rounds
    of 16 blocks), not bf16 ones. One they cannot take (a file-layout Q4_1) keeps MAX_ROWS,
    as one without them does (panel_rows=0) unless the bf16 panels take it past
    PANELS_MAX_ROWS; a step of more prompt rows than the integer kernels round twice takes
    the bf16 tiles (products rounded to bf16)."""
    rng = np.random.default_rng(5)
    k = 512
    w = QuantizedWeight("w", weight_bytes(QT.Q4_1, 32, k, rng), QT.Q4_1, (32, k))
    kq = QuantizedWeight("k", weight_bytes(QT.Q4_K, 32, k, rng), QT.Q4_K, (32, k))
    file = QuantizedWeight("f", weight_bytes(QT.Q4_1, 32, k, rng), QT.Q4_1, (32, k),
                           planar=False)
    default = GGUFLinear(w, tile_bf16=True)
    assert default.max_rows == VNNI_PANELS_MAX_ROWS == GGUFLinear([w, kq]).max_rows
    assert GGUFLinear(file, tile_bf16=True).max_rows == MAX_ROWS
    assert GGUFLinear(w, panel_rows=0, tile_bf16=False).max_rows == MAX_ROWS
    if EXT.gguf_bf16_panels:
        assert GGUFLinear(w, panel_rows=0, tile_bf16=True).max_rows == PANELS_MAX_ROWS
    vnni = GGUFLinear(w, max_rows=10**9, panel_rows=0)
    for rows in (17, 300):
        x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
        assert torch.equal(default(x), vnni(x)), rows
    rows = default.twice_max_rows // 2 + 1
    default.prompt_rows = PromptRows()
    default.prompt_rows.set(torch.arange(rows), rows, None, 0)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    got = default(x)
    assert torch.equal(got, got.to(torch.bfloat16).float())  # bf16 products
    assert not torch.equal(got, vnni(x))


@needs_ext
@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_prompt_rows_on_bf16_tiles_are_x_itself(qtype):
    """On bf16 tiles (CPUs with AMX) a prompt row is x itself, rounded to bf16 alone: bf16
    keeps fewer bits of a value than rounding twice would. Such rows come out as
    bf16(x) @ bf16(W)^T (to the bf16 rounding of the output), nearer x @ W^T than rows rounded
    once; the other rows stay exactly as rounded once, and a step of prompt rows alone gives
    its rows as a step beside other rows does."""
    rng = np.random.default_rng(int(qtype) + 13)
    n, k = 45, k_for(qtype, 3 if GGML_QUANT_SIZES[qtype][0] == 256 else 24)
    raw = weight_bytes(qtype, n, k, rng)
    w = dequantized(raw, qtype)
    layer = GGUFLinear(QuantizedWeight("w", raw, qtype, (n, k)), max_rows=0, tile_bf16=True)
    x = rng.standard_normal((9, k)).astype(np.float32)
    twice = [1, 4, 5, 8]
    rest = [i for i in range(len(x)) if i not in twice]
    once = run(layer, x, torch.float32)
    layer.prompt_rows = PromptRows()
    layer.prompt_rows.set(torch.tensor(twice), len(x), None, 0)
    y = run(layer, x, torch.float32)
    assert np.array_equal(y[rest], once[rest])

    def bf16(a: np.ndarray) -> np.ndarray:
        return torch.from_numpy(a).to(torch.bfloat16).double().numpy()
    near = bf16(x[twice]) @ bf16(w).T
    np.testing.assert_allclose(y[twice], near, rtol=2 ** -7, atol=1e-4 * np.abs(near).max())
    ref = x[twice] @ w.T
    assert relative_errors(y[twice], ref)[0] < relative_errors(once[twice], ref)[0] / 1.5
    layer.prompt_rows.set(torch.arange(len(twice)), len(twice), None, 0)  # prompt rows alone
    alone = run(layer, x[twice], torch.float32)
    np.testing.assert_allclose(alone, y[twice], rtol=2 ** -7, atol=1e-4 * np.abs(near).max())


@needs_ext
@pytest.mark.parametrize("rows", [16, 9])
def test_a_bf16_step_with_prompt_rows_leaves_x_as_it_was(rows):
    """Rounding a step's decode rows for the bf16 tiles happens in a copy of x: a bf16 x
    (a bf16 model's, also read after the projection, e.g. by LoRA) of whole tiles of rows or
    not comes back unchanged."""
    rng = np.random.default_rng(rows)
    raw = weight_bytes(QT.Q4_1, 32, 256, rng)
    layer = GGUFLinear(QuantizedWeight("w", raw, QT.Q4_1, (32, 256)), max_rows=0,
                       tile_bf16=True)
    layer.prompt_rows = PromptRows()
    layer.prompt_rows.set(torch.tensor([0, 2]), rows, None, 0)
    x = torch.from_numpy(rng.standard_normal((rows, 256)).astype(np.float32)).bfloat16()
    before = x.clone()
    layer(x)
    assert torch.equal(x, before)


@needs_ext
def test_bf16_out_gives_the_tiles_products_unconverted():
    """bf16_out (MLP.fused's gate/up): a step on bf16 tiles comes back in bf16 holding the
    very values the float32 output holds; steps the integer kernels take, and projections
    with a bias (added in x's dtype), come back in x's dtype."""
    rng = np.random.default_rng(5)
    qtype, n, k = QT.Q8_0, 48, k_for(QT.Q8_0, 4)
    raw = weight_bytes(qtype, n, k, rng)
    x = torch.from_numpy(rng.standard_normal((20, k)).astype(np.float32))
    tiles = GGUFLinear(QuantizedWeight("w", raw, qtype, (n, k)), max_rows=4, tile_bf16=True)
    tiles.prompt_rows = PromptRows()
    tiles.prompt_rows.set(torch.arange(3, 17), len(x), None, 0)
    got = tiles(x, bf16_out=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), tiles(x))
    assert tiles(x[:4], bf16_out=True).dtype == torch.float32  # the integer kernels'
    bias = torch.randn(n)
    biased = GGUFLinear(QuantizedWeight("w", raw, qtype, (n, k)), bias, max_rows=4,
                        tile_bf16=True)
    assert torch.equal(biased(x, bf16_out=True), biased(x))
