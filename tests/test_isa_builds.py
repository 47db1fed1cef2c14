"""The kernels as compiled for other CPUs. The extension builds with -march=native, so this
machine runs only its own instruction set's paths; here the GGUF kernels and the paged
decode attention are built for AVX2 without AVX-512 (haswell) and for no SIMD at all
(x86-64). Each build's integer kernel must give what the native one gives (the same
activation rounding, so equal up to float32 summation order) and what
gguf.quants.dequantize(W) @ x gives, for every block format in both row layouts and 1-9 rows
(each row count its own kernel instance); each build's attention must give attention over
the gathered context, over caches of every row format, in one span and in several."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
from test_cpu_decode import gathered_attention
from test_gguf_quants import (MAX_TOL, RMS_TOL, dequantized, exact_x, k_for, relative_errors,
                              weight_bytes)

from tidal.model import cpu_decode
from tidal.model.cpu_extension import _CSRC
from tidal.model.gguf_quants import BLOCK_FIELDS, QuantizedWeight
from tidal.model.kv_quant import KVFormat
from tidal.model.linear import cpu_flags

NATIVE = cpu_decode.extension()
MARCHES = {"haswell": {"avx2", "fma", "f16c"}, "x86-64": set()}
# the GGUF kernels' and the decode attention's sources and a binding of them alone: the rest
# of the extension would double the build for nothing compared here
SOURCES = [str(_CSRC / "gguf_quants.cpp"), str(_CSRC / "paged_attention.cpp"),
           str(Path(__file__).parent / "isa_binding.cpp")]


_BUILDS: dict[str, subprocess.Popen] = {}  # each build this CPU runs, started at once


def _load_args(march: str, folder: Path) -> dict:
    return dict(name=f"tidal_isa_{march.replace('-', '_')}", sources=SOURCES,
                extra_cflags=["-O3", f"-march={march}", "-fopenmp"], extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(_CSRC)], build_directory=str(folder), verbose=False)


@pytest.fixture(scope="module", params=list(MARCHES))
def variant(request, tmp_path_factory):
    march = request.param
    if NATIVE is None:
        pytest.skip("needs tidal's C++ extension")
    if not MARCHES[march] <= cpu_flags():
        pytest.skip(f"this CPU cannot run code built for {march}")
    from torch.utils.cpp_extension import load

    base = tmp_path_factory.getbasetemp()
    if not _BUILDS:  # all at once: each is mostly one long compile, on a core of its own
        for other in (m for m in MARCHES if MARCHES[m] <= cpu_flags()):
            (base / f"isa-{other}").mkdir(exist_ok=True)
            script = ("from torch.utils.cpp_extension import load; "
                      f"load(**{_load_args(other, base / f'isa-{other}')!r})")
            _BUILDS[other] = subprocess.Popen([sys.executable, "-c", script])
    assert _BUILDS[march].wait() == 0, f"the {march} build failed"
    return load(**_load_args(march, base / f"isa-{march}"))  # built: this only loads it


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


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8_e4m3"])
def test_each_build_attends_over_the_gathered_context(variant, kv):
    """Head sizes of the vector paths (64, 128) and the scalar one (24), groups of query
    heads each path fixes or reads at run time, float32 and bf16, contexts in one span and
    in several: each build within float32's error of attention over the gathered context
    and of the native build."""
    gen = torch.Generator().manual_seed(7)
    fmt = KVFormat(kv)
    for d, (h, hkv), dtype in [(64, (9, 3), torch.float32), (128, (8, 2), torch.float32),
                               (64, (8, 1), torch.bfloat16), (24, (4, 2), torch.float32),
                               (128, (4, 1), torch.float32)]:
        lens = torch.tensor([1, 37, 700, 1300])
        width = -(-int(lens.max()) // 16)
        k, v = (torch.randn(4 * width, 16, hkv, d, generator=gen).to(dtype) for _ in range(2))
        k_cache, v_cache = (fmt.encode(x).view(fmt.storage(dtype)) if fmt.quantized else x
                            for x in (k, v))
        tables = torch.randperm(4 * width, generator=gen).view(4, width)
        q = torch.randn(4, h, d, generator=gen).to(dtype)
        got, native = (e.paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, 0)
                       for e in (variant, NATIVE))
        want = gathered_attention(q, fmt.decode(k_cache, torch.float32),
                                  fmt.decode(v_cache, torch.float32), tables, lens, d ** -0.5)
        tol = 2e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(got.float(), native.float(), atol=tol, rtol=tol)


def disassembly(path: str) -> str:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("needs objdump")
    return subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", path],
                          capture_output=True, text=True, check=True).stdout


def row_kernel_calls(code: str) -> dict[str, set[str]]:
    """What each instance of the GGUF row kernels (dot_rows: 1-16 activation rows against
    a run of weight rows) calls, by instance."""
    calls: dict[str, set[str]] = {}
    kernel = None
    for line in code.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            kernel = head.group(1) if "dot_rows<" in head.group(1) else None
            if kernel:
                calls[kernel] = set()
        elif kernel:
            call = re.search(r"\bcall\s+\S+\s+<(.*)>", line)
            if call:
                calls[kernel].add(call.group(1))
    return calls


def assert_row_kernels_call_nothing(ext) -> None:
    calls = row_kernel_calls(disassembly(ext.__file__))
    assert len(calls) >= 16 * len(BLOCK_FIELDS)  # every format at 1-16 rows
    assert {kernel: c for kernel, c in calls.items() if c} == {}


def test_the_row_kernels_call_nothing():
    """The row kernels' helpers are inlined (TIDAL_INLINE): a call from a kernel's loop,
    once a block, spills every vector register the loop holds (one such call made the
    VNNI 32-weight kernel 1.3x slower at 8 rows). Every format's instance at every row
    count, here in the native build, below in the others."""
    if NATIVE is None:
        pytest.skip("needs tidal's C++ extension")
    assert_row_kernels_call_nothing(NATIVE)


def test_each_builds_row_kernels_call_nothing(variant):
    assert_row_kernels_call_nothing(variant)


def test_each_build_keeps_to_its_instruction_set(variant):
    """What the tests above compare is the other instruction sets' code: the haswell build
    has no AVX-512 register in it, the x86-64 one no AVX register at all."""
    code = disassembly(variant.__file__)
    assert "dot_rows<tidal_cpu::gguf::QK<false>" in code  # the Q4_K kernel is in there
    assert "%zmm" not in code
    if variant.__name__.endswith("x86_64"):
        assert "%ymm" not in code
    else:
        assert "vpmaddubsw" in code
