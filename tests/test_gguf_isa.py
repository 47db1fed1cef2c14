"""The GGUF kernels as compiled for other CPUs. The extension builds with -march=native, so
this machine runs only its own instruction set's paths; here the GGUF kernels are built for
AVX2 without AVX-512 (haswell) and for no SIMD at all (x86-64), and each build's integer
kernel must give what the native one gives (the same activation rounding, so equal up to
float32 summation order) and what gguf.quants.dequantize(W) @ x gives, for every block
format in both row layouts and 1-9 rows (each row count its own kernel instance)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
from test_gguf_quants import (MAX_TOL, RMS_TOL, dequantized, exact_x, k_for, relative_errors,
                              weight_bytes)

from tidal.model import cpu_decode
from tidal.model.cpu_extension import _CSRC
from tidal.model.gguf_quants import BLOCK_FIELDS, QuantizedWeight
from tidal.model.linear import cpu_flags

NATIVE = cpu_decode.extension()
MARCHES = {"haswell": {"avx2", "fma", "f16c"}, "x86-64": set()}
# the GGUF kernels' source and a binding of gguf_linear alone: the rest of the extension
# would double the build for nothing compared here
SOURCES = [str(_CSRC / "gguf_quants.cpp"), str(Path(__file__).parent / "gguf_isa_binding.cpp")]


@pytest.fixture(scope="module", params=list(MARCHES))
def variant(request, tmp_path_factory):
    march = request.param
    if NATIVE is None:
        pytest.skip("needs tidal's C++ extension")
    if not MARCHES[march] <= cpu_flags():
        pytest.skip(f"this CPU cannot run code built for {march}")
    from torch.utils.cpp_extension import load

    return load(name=f"tidal_gguf_{march.replace('-', '_')}", sources=SOURCES,
                extra_cflags=["-O3", f"-march={march}", "-fopenmp"], extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(_CSRC)],
                build_directory=str(tmp_path_factory.mktemp(march)), verbose=False)


def weight(ext, raw: np.ndarray, qtype, shape, planar: bool) -> QuantizedWeight:
    """The weight in the layout `ext`'s build reads (planar nibble quants in rounds or not)."""
    return QuantizedWeight("w", raw, qtype, shape, planar, use_extension=False,
                           rounds=ext.gguf_nibble_rounds)


def linear(ext, w: QuantizedWeight, x: np.ndarray) -> np.ndarray:
    y = ext.gguf_linear(torch.from_numpy(x).float(), w.data, int(w.qtype), w.planar, None,
                        rounds=w.rounds)
    return y.double().numpy()


@pytest.mark.parametrize("planar", [True, False], ids=["planar", "file"])
@pytest.mark.parametrize("qtype", list(BLOCK_FIELDS), ids=lambda t: t.name)
def test_each_build_equals_the_native_one_and_gguf(variant, qtype, planar):
    rng = np.random.default_rng(int(qtype) + 100 * planar)
    n, k = 37, k_for(qtype, 3 if GGML_QUANT_SIZES[qtype][0] == 256 else 19)
    raw = weight_bytes(qtype, n, k, rng, random=True)
    w, w_native = (weight(e, raw, qtype, (n, k), planar) for e in (variant, NATIVE))
    ref = dequantized(raw, qtype)
    for rows in range(1, 10):
        x = exact_x(rows, k, rng)  # int8 rounding leaves it as it is: products exact
        got, native = linear(variant, w, x), linear(NATIVE, w_native, x)
        bound = np.abs(x) @ np.abs(ref).T
        assert np.all(np.abs(got - x @ ref.T) <= 1e-5 * bound + 1e-30), rows
        assert np.all(np.abs(got - native) <= 1e-5 * bound + 1e-30), rows
        gauss = rng.standard_normal((rows, k)).astype(np.float32)
        got, native = linear(variant, w, gauss), linear(NATIVE, w_native, gauss)
        bound = np.abs(gauss) @ np.abs(ref).T
        assert np.all(np.abs(got - native) <= 1e-5 * bound + 1e-30), rows
        rms, worst = relative_errors(got, gauss.astype(np.float64) @ ref.T)
        assert rms <= RMS_TOL and worst <= MAX_TOL, (rows, rms, worst)


def test_each_build_keeps_to_its_instruction_set(variant):
    """What the test above compares is the other instruction sets' code: the haswell build
    has no AVX-512 register in it, the x86-64 one no AVX register at all."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("needs objdump")
    code = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", variant.__file__],
                          capture_output=True, text=True, check=True).stdout
    assert "dot_rows<tidal_cpu::gguf::QK<false>" in code  # the Q4_K kernel is in there
    assert "%zmm" not in code
    if variant.__name__.endswith("x86_64"):
        assert "%ymm" not in code
    else:
        assert "vpmaddubsw" in code
