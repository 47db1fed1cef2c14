"""GGUF weights in their own formats against the gguf package: GGUFLinear equals
gguf.quants.dequantize(W) @ x (float64) for every block format, in both row layouts, at
decode sizes (the C++ integer kernel, 1-16 rows) and prefill sizes (dequantized tiles).

Tolerances. With activations that int8 rounding leaves unchanged (a * 2^-7, |a| <= 127, one
of 127 a group) the kernel's integer products are exact, so the result must match to float32
accumulation: |y - ref| <= 1e-5 * (|W| @ |x|), plus 2^-8 of it where bf16 rounds the output
or the weights of a bf16 tile. With Gaussian activations the int8 rounding (half a step of
amax / 127 a value) leaves a relative error of ~0.5% rms, ~2.5% at worst over thousands of
outputs (measured); the bounds, 1.2% rms and 6% max of the output's rms, fail a nibble swap
or a wrong scale by far (checked below).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.model import cpu_decode
from tidal.model.gguf_quants import (BLOCK_FIELDS, K_QUANTS, NIBBLES, PLANAR, GGUFLinear,
                                     PromptRows, QuantizedWeight, _from_planes, _to_planes)

EXT = cpu_decode.extension()
needs_ext = pytest.mark.skipif(EXT is None, reason="needs tidal's C++ extension")
FORMATS = list(BLOCK_FIELDS)
QUANTIZABLE = {QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1}  # gguf only dequantizes K-quants
SCALE_AT = {QT.Q4_1: (0, 2), QT.Q5_1: (0, 2), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2),
            QT.Q6_K: (208,)}  # byte offsets of a block's float16 scales (else (0,))
ROWS = [*range(1, 17), 40, 300]
RMS_TOL, MAX_TOL = 1.2e-2, 6e-2


def weight_bytes(qtype: QT, n: int, k: int, rng: np.random.Generator,
                 random: bool = False) -> np.ndarray:
    """[n, row bytes]: gguf's quantization of Gaussian weights where it has one (and not
    `random`), else random quants (every bit pattern) with small float16 scales of either
    sign."""
    if qtype in QUANTIZABLE and not random:
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in SCALE_AT.get(qtype, (0,)):
        d = rng.uniform(1e-3, 2e-2, (n, k // block)) * rng.choice([-1, 1], (n, k // block))
        raw[:, :, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def exact_x(rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Activations int8 rounding per group of 32 leaves unchanged (and bf16 holds)."""
    a = rng.integers(-127, 128, (rows, k))
    a[:, ::32] = rng.choice([-127, 127], (rows, k // 32))
    return (a * 2.0 ** -7).astype(np.float32)


def dequantized(raw: np.ndarray, qtype: QT) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype).astype(np.float64)


def run(layer: GGUFLinear, x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return layer(torch.from_numpy(x).to(dtype)).double().numpy()


def k_for(qtype: QT, blocks: int) -> int:
    return GGML_QUANT_SIZES[qtype][0] * blocks


@needs_ext
@settings(max_examples=15, deadline=None)
@given(qtype=st.sampled_from(FORMATS), n=st.integers(1, 70), blocks=st.integers(1, 4),
       rows=st.sampled_from(ROWS), bf16=st.booleans(), planar=st.sampled_from([None, True, False]),
       random=st.booleans(), tile_bf16=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_equals_gguf_dequantize_with_exact_activations(qtype, n, blocks, rows, bf16, planar,
                                                       random, tile_bf16, seed):
    rng = np.random.default_rng(seed)
    k = k_for(qtype, blocks if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K) else 5 * blocks)
    raw = weight_bytes(qtype, n, k, rng, random)
    w, x = dequantized(raw, qtype), exact_x(rows, k, rng)
    layer = GGUFLinear(QuantizedWeight("blk.0.ffn_up.weight", raw, qtype, (n, k), planar=planar),
                       tile_bf16=tile_bf16)
    got = run(layer, x, torch.bfloat16 if bf16 else torch.float32)
    bound = np.abs(x) @ np.abs(w).T
    bf16_tiles = tile_bf16 and rows > layer.max_rows  # the weights rounded to bf16 too
    assert np.all(np.abs(got - x @ w.T) <= (2.0 ** -8 if bf16 or bf16_tiles else 1e-5) * bound
                  + 1e-30)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_gaussian_activations_within_the_int8_rounding_bound(qtype, dtype):
    rng = np.random.default_rng(int(qtype))
    n, k = 61, k_for(qtype, 3 if GGML_QUANT_SIZES[qtype][0] == 256 else 24)
    raw = weight_bytes(qtype, n, k, rng)
    layer = GGUFLinear(QuantizedWeight("w", raw, qtype, (n, k)))
    w = dequantized(raw, qtype)
    for rows in (1, 3, 8, 16, 40):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        x = torch.from_numpy(x).to(dtype).double().numpy()  # the inputs bf16 holds
        rms, err = relative_errors(run(layer, x, dtype), x @ w.T)
        assert rms <= RMS_TOL and err <= MAX_TOL, (rows, rms, err)


@needs_ext
@pytest.mark.parametrize("planar", [None, False], ids=["default", "file"])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_a_row_is_computed_alike_at_any_number_of_rows(qtype, planar):
    """Bit for bit: a decode row's result does not depend on the rows beside it in the step
    (speculative decoding verifies 1 + k rows of one request, and greedy output with guesses
    must be greedy output without them), in the integer kernels' range of 1-16 rows."""
    rng = np.random.default_rng(int(qtype) + 7)
    k = k_for(qtype, 3 if GGML_QUANT_SIZES[qtype][0] == 256 else 37)  # 16-block runs + a tail
    raw = weight_bytes(qtype, 45, k, rng)
    layer = GGUFLinear(QuantizedWeight("w", raw, qtype, (45, k), planar=planar))
    x = torch.from_numpy(rng.standard_normal((16, k)).astype(np.float32))
    alone = torch.cat([layer(x[i:i + 1]) for i in range(16)])
    for rows in (2, 3, 8, 9, 16):
        together = torch.cat([layer(x[i:i + rows]) for i in range(0, 16, rows)])
        assert torch.equal(together, alone), (rows, (together - alone).abs().max().item())


@pytest.mark.skipif(EXT is None or not EXT.gguf_int8_panels, reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("amx", [False, True], ids=["vnni", "amx"])
@pytest.mark.parametrize("qtype", sorted(PLANAR | K_QUANTS), ids=lambda t: t.name)
def test_int8_panels_give_the_vnni_kernels_sums(qtype, amx):
    """The int8 panels (VNNI; AMX's tiles where granted) against the VNNI kernels at the same
    rows. The 32-weight formats: bit for bit where a row is whole rounds of 16 blocks; with a
    row's last nb % 16 blocks (which the VNNI kernel sums in partial sums) within float32
    rounding. The K-quants (either layout), which the VNNI kernel sums in integers to a
    block's end: within float32 rounding. 45 weight rows: two panels of 16 and 13 rows the
    VNNI kernel takes; 48: three panels, the panels alone. AMX and VNNI give the same
    outputs bit for bit (the same integers, the same float operations)."""
    if amx and not EXT.gguf_amx:
        pytest.skip("needs AMX int8 tiles")
    rng = np.random.default_rng(int(qtype) + 3)
    block = GGML_QUANT_SIZES[qtype][0]
    odd = 37 if block == 32 else 40  # groups of 32: not whole rounds of 16 blocks
    for n, groups, planar in ((45, 32, None), (45, odd, True), (48, 32, None), (48, odd, None)):
        k = 32 * groups
        raw = weight_bytes(qtype, n, k, rng, random=True)
        w = QuantizedWeight("w", raw, qtype, (n, k), planar=planar if block == 256 else None)
        panels, vnni = (GGUFLinear(w, max_rows=300, panel_rows=m, amx=amx) for m in (1, 0))
        other = GGUFLinear(w, max_rows=300, panel_rows=1, amx=False) if amx else None
        bound = 2.0 ** -22 * (k // 32) * np.abs(dequantized(raw, qtype)).T  # ~4 ulp a group
        for rows in (1, 2, 7, 16, 17, 35, 40, 300):  # last tiles: 1, 2, 7, 16, 1, 3, 8, 12
            x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
            got, want = panels(x), vnni(x)
            if block == 32 and k % 512 == 0:
                assert torch.equal(got, want), (rows, (got - want).abs().max().item())
                assert torch.equal(panels(x.bfloat16()), vnni(x.bfloat16())), rows  # bf16 out
            else:
                assert np.all(np.abs((got - want).numpy()) <= np.abs(x.numpy()) @ bound), rows
            if other is not None:
                assert torch.equal(got, other(x)), rows


@needs_ext
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_prompt_rows_are_rounded_twice(qtype):
    """Rows PromptRows names (a prompt's tokens) are rounded to int8 and their residual once
    more: ~127x nearer x @ W^T than once-rounded rows, alike on the integer kernels and the
    tiles, beside any rows; the other rows of the step stay exactly as rounded once."""
    rng = np.random.default_rng(int(qtype) + 11)
    n, k = 45, k_for(qtype, 3 if GGML_QUANT_SIZES[qtype][0] == 256 else 24)
    raw = weight_bytes(qtype, n, k, rng)
    w = dequantized(raw, qtype)
    layers = [GGUFLinear(QuantizedWeight("w", raw, qtype, (n, k)), max_rows=m, tile_bf16=False)
              for m in (64, 0)]  # the integer kernels, then float32 tiles
    x = rng.standard_normal((9, k)).astype(np.float32)
    twice = [1, 4, 5, 8]
    got = []
    for layer in layers:  # the integer kernels, then the tiles
        once = run(layer, x, torch.float32)
        layer.prompt_rows = PromptRows()
        layer.prompt_rows.set(torch.tensor(twice), len(x), None, 0)
        y = run(layer, x, torch.float32)
        rest = [i for i in range(len(x)) if i not in twice]
        assert np.array_equal(y[rest], once[rest])
        ref = x @ w.T
        rms_once, _ = relative_errors(once[twice], ref[twice])
        rms, err = relative_errors(y[twice], ref[twice])
        assert rms < 2e-4 and err < 1e-3 and rms < rms_once / 30, (rms, err, rms_once)
        layer.prompt_rows.set(torch.tensor([0]), 1, None, 0)  # a row alone: the same sums
        alone = np.concatenate([run(layer, x[i:i + 1], torch.float32) for i in twice])
        np.testing.assert_allclose(alone, y[twice], rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        got.append(y)
    np.testing.assert_allclose(got[0], got[1], rtol=1e-5, atol=1e-5 * np.abs(got[0]).max())


def relative_errors(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(rms, max) of got - ref over the rms of ref."""
    scale = np.sqrt(np.mean(ref ** 2))
    return np.sqrt(np.mean((got - ref) ** 2)) / scale, np.abs(got - ref).max() / scale


def _swap_nibbles(raw: np.ndarray, qtype: QT) -> np.ndarray:
    out = raw.reshape(raw.shape[0], -1, GGML_QUANT_SIZES[qtype][1]).copy()
    qs = out[:, :, -128:] if qtype == QT.Q4_K else out[:, :, 2:]
    qs[:] = (qs >> 4) | (qs << 4)
    return out.reshape(raw.shape)


def _swap_q6_scale_halves(raw: np.ndarray, qtype: QT) -> np.ndarray:
    out = raw.reshape(raw.shape[0], -1, 210).copy()
    scales = out[:, :, 192:208]
    scales[:] = scales.reshape(*scales.shape[:2], 8, 2)[..., ::-1].reshape(scales.shape)
    return out.reshape(raw.shape)


@needs_ext
@pytest.mark.parametrize("qtype, corrupt", [(QT.Q4_0, _swap_nibbles), (QT.Q4_K, _swap_nibbles),
                                            (QT.Q6_K, _swap_q6_scale_halves)],
                         ids=["Q4_0-nibbles", "Q4_K-nibbles", "Q6_K-scale-halves"])
def test_the_gaussian_bounds_catch_a_wrong_layout(qtype, corrupt):
    rng = np.random.default_rng(7)
    n, k = 61, 512
    raw = weight_bytes(qtype, n, k, rng)
    x = rng.standard_normal((4, k)).astype(np.float32)
    wrong = GGUFLinear(QuantizedWeight("w", corrupt(raw, qtype), qtype, (n, k)))
    rms, err = relative_errors(run(wrong, x, torch.float32), x @ dequantized(raw, qtype).T)
    assert rms > 10 * RMS_TOL and err > MAX_TOL


@needs_ext
@pytest.mark.parametrize("planar", [True, False], ids=["planar", "file"])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_dequantize_rows_equals_gguf(qtype, planar):
    rng = np.random.default_rng(3)
    n, k = 19, k_for(qtype, 2 if GGML_QUANT_SIZES[qtype][0] == 256 else 6)
    raw = weight_bytes(qtype, n, k, rng, random=True)
    ref = dequantized(raw, qtype)
    for use_extension in (True, False):
        weight = QuantizedWeight("w", raw, qtype, (n, k), planar, use_extension=use_extension)
        for start, stop in ((0, n), (5, 12)):
            got = weight.dequantize_rows(start, stop).double().numpy()
            np.testing.assert_allclose(got, ref[start:stop], rtol=1e-6, atol=0)
        bf16 = weight.dequantize_rows(2, 9, torch.bfloat16).double().numpy()
        np.testing.assert_allclose(bf16, ref[2:9], rtol=2.0 ** -8, atol=0)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_K], ids=lambda t: t.name)
def test_without_the_extension_every_step_takes_the_tiles(qtype):
    rng = np.random.default_rng(4)
    n, k = 37, 512
    raw = weight_bytes(qtype, n, k, rng, random=True)
    layer = GGUFLinear(QuantizedWeight("w", raw, qtype, (n, k), use_extension=False),
                       tile_rows=16)
    assert layer.max_rows == 0
    x = exact_x(3, k, rng)
    w = dequantized(raw, qtype)
    np.testing.assert_allclose(run(layer, x, torch.float32), x @ w.T, rtol=1e-5,
                               atol=1e-5 * np.abs(x @ w.T).max())


@needs_ext
@pytest.mark.parametrize("rows", [2, 40])
def test_bias_and_leading_dimensions(rows):
    rng = np.random.default_rng(5)
    n, k = 45, 256
    raw = weight_bytes(QT.Q6_K, n, k, rng)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    layer = GGUFLinear(QuantizedWeight("w", raw, QT.Q6_K, (n, k)), bias, tile_rows=32,
                       tile_bf16=False)
    x = torch.from_numpy(exact_x(2 * rows, k, rng)).view(2, rows, k)
    w = torch.from_numpy(dequantized(raw, QT.Q6_K))
    want, bound = F.linear(x.double(), w, bias.double()), F.linear(x.double().abs(), w.abs())
    got = layer(x)
    assert got.shape == (2, rows, n)
    assert torch.all((got.double() - want).abs() <= 1e-5 * bound)
    got16 = layer(x.bfloat16())
    assert got16.dtype == torch.bfloat16
    assert torch.all((got16.double() - want).abs() <= 2.0 ** -8 * (bound + bias.abs()))


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=lambda t: t.name)
def test_float_types_become_dense_layers(qtype):
    """A float-typed matrix (alone, or fused with a quantized part) multiplies as a dense
    layer of its values; GGUFLinear itself takes block formats only, and says so."""
    from tidal.model.quantized_model import projection

    rng = np.random.default_rng(6)
    n, k = 23, 64
    raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    q8 = gguf.quants.quantize(rng.standard_normal((16, k)).astype(np.float32), QT.Q8_0)
    with pytest.raises(ValueError, match=f"'w', '{qtype.name}'"):
        GGUFLinear(QuantizedWeight("w", raw, qtype, (n, k)))
    parts = [QuantizedWeight("w", raw, qtype, (n, k)), QuantizedWeight("v", q8, QT.Q8_0, (16, k))]
    w = torch.from_numpy(np.concatenate([dequantized(raw, qtype), dequantized(q8, QT.Q8_0)]))
    for dtype in (torch.float32, torch.bfloat16):
        layer = projection(parts, None, dtype)
        assert not isinstance(layer, GGUFLinear)
        x = torch.from_numpy(rng.standard_normal((3, k))).to(dtype)
        bound = F.linear(x.double().abs(), w.abs())
        tol = 1e-6 if dtype == torch.float32 and qtype != QT.BF16 else 2.0 ** -7
        assert torch.all((layer(x).double() - F.linear(x.double(), w)).abs() <= tol * bound)


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.Q3_K, QT.IQ2_XXS, QT.IQ4_NL, 99],
                         ids=lambda t: getattr(t, "name", str(t)))
def test_an_unsupported_type_names_the_tensor_and_its_type(qtype):
    with pytest.raises(ValueError) as info:
        QuantizedWeight("blk.3.attn_q.weight", np.zeros(4096, np.uint8), qtype, (4, 256))
    assert "blk.3.attn_q.weight" in str(info.value)
    assert (qtype.name if isinstance(qtype, QT) else "99") in str(info.value)


def test_a_row_that_is_no_whole_number_of_blocks_is_refused():
    with pytest.raises(ValueError, match="blk.0.w.*Q4_K.*multiple of its block of 256"):
        QuantizedWeight("blk.0.w", np.zeros(4 * 144, np.uint8), QT.Q4_K, (4, 300))
    with pytest.raises(ValueError, match="blk.0.w.*needs 576 bytes, got 570"):
        QuantizedWeight("blk.0.w", np.zeros(570, np.uint8), QT.Q4_K, (4, 256))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_repacked_bytes_stay_the_files_and_planes_round_trip(qtype):
    rng = np.random.default_rng(8)
    n, k = 7, k_for(qtype, 3 if GGML_QUANT_SIZES[qtype][0] == 256 else 19)
    raw = weight_bytes(qtype, n, k, rng, random=True)
    planar = QuantizedWeight("w", raw, qtype, (n, k), planar=True, use_extension=False)
    assert planar.nbytes <= 1.1 * raw.nbytes and planar.nbytes == raw.nbytes
    rows, sizes = torch.from_numpy(raw), BLOCK_FIELDS[qtype]
    assert not torch.equal(planar.data, rows)  # the fields did move
    plain = _to_planes(rows, sizes)
    assert torch.equal(_from_planes(plain, sizes), rows)
    if qtype not in NIBBLES:
        return
    rounds = _to_planes(rows, sizes, rounds=True)
    assert torch.equal(_from_planes(rounds, sizes, rounds=True), rows)
    # rounds move only the quants of whole runs of 8 blocks (19 blocks: two runs and 3 more)
    quants = slice(rows.shape[1] - 16 * 19, None)
    assert torch.equal(rounds[:, :quants.start], plain[:, :quants.start])
    moved = ~torch.eq(rounds[:, quants], plain[:, quants]).view(n, 19, 16).all(-1).all(0)
    assert moved[:16].any() and not moved[16:].any()
    # dword i of block l at 32 i + 4 l: block 9's (the second run's block 1) dword 2
    assert torch.equal(rounds[:, quants][:, 128 + 64 + 4:128 + 64 + 8],
                       plain[:, quants][:, 16 * 9 + 8:16 * 9 + 12])


@pytest.mark.skipif(cpu_decode.extension() is None, reason="needs tidal's C++ extension")
def test_a_part_in_the_other_layout_is_refused():
    """Quants in rounds (or not) where this build reads the other order: a clear error, not
    wrong numbers."""
    ext = cpu_decode.extension()
    raw = weight_bytes(QT.Q4_1, 4, 256, np.random.default_rng(3), random=True)
    w = QuantizedWeight("w", raw, QT.Q4_1, (4, 256), planar=True,
                        rounds=not ext.gguf_nibble_rounds)
    with pytest.raises(RuntimeError, match="rounds"):
        ext.gguf_linear(torch.ones(1, 256), w.data, int(w.qtype), True, None, rounds=w.rounds)
    with pytest.raises(RuntimeError, match="rounds"):
        GGUFLinear(w)


def test_a_memory_mapped_file_is_used_in_place(tmp_path):
    rng = np.random.default_rng(9)
    q6 = weight_bytes(QT.Q6_K, 6, 512, rng)
    q4 = weight_bytes(QT.Q4_0, 6, 512, rng)
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    writer.add_tensor("q6", q6, raw_dtype=QT.Q6_K)
    writer.add_tensor("q4", q4, raw_dtype=QT.Q4_0)
    writer.add_tensor("f16", rng.standard_normal((6, 64)).astype(np.float16))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()
    for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        weight = QuantizedWeight(t.name, t.data, t.tensor_type, shape, use_extension=False)
        in_place = weight.data.data_ptr() == t.data.ctypes.data
        assert in_place == (t.name != "q4")  # Q4_0 is repacked into planes
        ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        np.testing.assert_allclose(weight.dequantize_rows(0, 6).numpy(), ref, rtol=1e-6)
