"""The CPU linear layers: packed bf16 and float32 equal F.linear, weight-only int8/int4 stay
close, and int4 re-creates weights that already lie on a Q4_1 grid. bf16 cases run where
oneDNN has bf16 kernels (not on plain AVX2); float32 ones everywhere."""

import pytest
import torch
import torch.nn.functional as F

from tidal.model import cpu_decode
from tidal.model.linear import (ROW_CHUNK, Int4Linear, Int8Linear, PackedLinear, bf16_kernels,
                                can_pack, replace_linears, row_bucket)

pytestmark = pytest.mark.skipif(not can_pack(torch.float32, "cpu"),
                                reason="needs oneDNN on CPU")
needs_bf16 = pytest.mark.skipif(not bf16_kernels(), reason="oneDNN has no bf16 kernels here")
DTYPES = [torch.float32, torch.bfloat16]


def _linear(n_out: int = 48, n_in: int = 64, bias: bool = True,
            dtype: torch.dtype = torch.bfloat16) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(n_in, n_out, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_packed_linear_gives_the_same_numbers_as_f_linear(rows, dtype):
    lin = _linear(dtype=dtype)
    x = torch.randn(rows, 64, dtype=dtype)
    got = PackedLinear(lin.weight, lin.bias)(x)
    if dtype == torch.bfloat16 and bf16_kernels():
        assert torch.equal(got, F.linear(x, lin.weight, lin.bias))
    elif dtype == torch.bfloat16:  # multiplied in float32 and rounded once
        _within_one_rounding(got, x, lin)
    else:  # float32 GEMMs may block the sum differently from F.linear's
        torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert got.dtype == dtype


def test_row_buckets_are_few_and_pad_by_at_most_an_eighth():
    buckets = [row_bucket(n) for n in range(1, ROW_CHUNK + 1)]
    assert buckets[:16] == list(range(1, 17))  # few rows: exact, the weights bound the time
    assert all(n <= b <= n * 1.125 for n, b in enumerate(buckets, 1))
    assert buckets == sorted(buckets) and buckets[-1] == ROW_CHUNK
    assert len(set(buckets)) == 48


@pytest.mark.parametrize("dtype", DTYPES)
def test_onednn_sees_only_bucketed_row_counts_and_the_rows_asked_come_back(monkeypatch, dtype):
    """Odd and chunked row counts: oneDNN multiplies padded bucket-sized blocks, the layer
    returns exactly the input's rows, equal to F.linear's."""
    seen = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *rest: seen.append(x.shape[0]) or real(x, *rest))
    lin = _linear(dtype=dtype)
    layer = PackedLinear(lin.weight, lin.bias)
    for rows in (17, 33, 255, 257, 700):
        x = torch.randn(rows, 64, dtype=dtype)
        got = layer(x)
        assert got.shape == (rows, 48)
        if dtype == torch.bfloat16 and not bf16_kernels():
            _within_one_rounding(got, x, lin)
        else:
            torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias))
    assert seen == [18, 36, 256, 256, 1, 256, 256, 192]
    assert set(seen) <= {row_bucket(n) for n in range(1, ROW_CHUNK + 1)}


def _within_one_rounding(got, x, lin):
    """bf16 values multiplied in float32, rounded once: within one bf16 rounding of the exact
    product."""
    exact = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-6)


def test_without_bf16_kernels_a_bf16_layer_multiplies_every_row_in_float32(monkeypatch):
    import tidal.model.linear as linear

    monkeypatch.setattr(linear, "bf16_kernels", lambda: False)
    lin = _linear()
    layer = PackedLinear(lin.weight, lin.bias)
    used = []
    real = linear._pointwise
    monkeypatch.setattr(linear, "_pointwise",
                        lambda x, w, b: used.append((x.dtype, w.dtype)) or real(x, w, b))
    for rows in (1, 3, 17):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        got = layer(x)
        assert used.pop() == (torch.float32, torch.float32) and got.dtype == torch.bfloat16
        _within_one_rounding(got, x, lin)


def test_a_float32_packed_linear_keeps_no_copy():
    lin = _linear(dtype=torch.float32)
    assert PackedLinear(lin.weight, lin.bias, fp32_rows=4).weight32 is None


@needs_bf16
def test_packed_linear_multiplies_in_float32_from_fp32_rows(monkeypatch):
    import tidal.model.linear as linear

    lin = _linear()
    layer = PackedLinear(lin.weight, lin.bias, fp32_rows=4)
    used = []
    real = linear._pointwise
    monkeypatch.setattr(linear, "_pointwise",
                        lambda x, w, b: used.append((x.dtype, w.dtype)) or real(x, w, b))
    few = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(few), F.linear(few, lin.weight, lin.bias))  # the bf16 kernel
    assert used.pop() == (torch.bfloat16, torch.bfloat16)
    for rows in (4, 17):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        got = layer(x)
        assert used.pop() == (torch.float32, torch.float32) and got.dtype == torch.bfloat16
        _within_one_rounding(got, x, lin)
    assert PackedLinear(lin.weight, lin.bias).weight32 is None  # no copy unless asked


@pytest.mark.parametrize("vendor,flags,wins", [
    ("GenuineIntel", "avx512f avx512_bf16 amx_bf16 amx_tile", True),  # Sapphire Rapids on
    ("GenuineIntel", "avx512f avx512_bf16", False),  # Cooper Lake: bf16 at half float32's rate
    ("AuthenticAMD", "avx2 avx512f avx512_bf16", True),  # Zen 4 on: twice float32's rate
    ("AuthenticAMD", "avx2 fma f16c", False),  # Zen 3: no bf16 dot products
    ("", "", False),  # no /proc/cpuinfo
])
def test_bf16_gemms_win_by_cpu_and_decide_the_float32_copies(monkeypatch, vendor, flags,
                                                                wins):
    import tidal.model.linear as linear

    monkeypatch.setattr(linear, "cpuinfo", {"vendor_id": vendor, "flags": flags}.get)
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset(flags.split()))
    assert linear.bf16_gemms_win() is wins
    assert linear.default_fp32_rows() == (0 if wins else 16)


def test_cpuinfo_reads_this_machines_fields():
    from tidal.model.linear import cpu_flags, cpuinfo

    assert cpu_flags() == frozenset(cpuinfo("flags").split())
    assert cpuinfo("no such field") == ""
    if cpu_flags():  # a Linux /proc/cpuinfo: x86's vendor_id, or another arch's fields
        assert cpuinfo("processor") == "0"


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_linear_is_close_to_the_dense_one(dtype):
    lin = _linear(dtype=dtype)
    x = torch.randn(5, 64, dtype=dtype)
    ref = lin(x).float()
    got = Int8Linear(lin.weight, lin.bias)(x).float()
    assert got.shape == ref.shape
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("kernel", ["torch", "tidal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_recreates_q4_1_weights_and_switches_to_dense_for_many_rows(dtype, kernel):
    """torch's int4 kernel, or tidal's (activations rounded to int8 per group, as llama.cpp)."""
    ext = cpu_decode.extension() if kernel == "tidal" else None
    if kernel == "tidal" and ext is None:
        pytest.skip("no C++ compiler here")
    torch.manual_seed(0)
    n, k, g = 48, 96, Int4Linear.GROUP
    # Weights on a Q4_1 grid: per group of 32, scale * q + min with q in 0..15 (both ends used).
    q = torch.randint(0, 16, (n, k // g, g))
    q[..., 0], q[..., 1] = 0, 15
    scale = torch.rand(n, k // g, 1) * 0.01 + 0.001
    low = torch.randn(n, k // g, 1) * 0.05
    weight = (q * scale + low).view(n, k).to(dtype)
    bias = torch.randn(n, dtype=dtype)
    layer = Int4Linear(weight, bias, ext=ext)
    for rows in range(1, layer.max_rows + 1):
        few = torch.randn(rows, k, dtype=dtype)
        ref = few.float() @ weight.float().t() + bias.float()
        err = (layer(few).float() - ref).abs().max()
        assert err < 0.02 * ref.abs().max()  # bf16 scales/zeros, int8 x, accumulation only
    many = torch.randn(layer.max_rows + 1, k, dtype=dtype)
    assert torch.equal(layer(many), layer.dense(many))  # the dense path
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # bf16: F.linear may round differently
    torch.testing.assert_close(layer(many), F.linear(many, weight, bias), rtol=tol, atol=tol)


def test_int4_refuses_widths_that_are_not_whole_groups():
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Linear(torch.zeros(16, 40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="by 16"):
        Int4Linear(torch.zeros(8, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_replace_linears_gives_a_tied_model_its_own_head(dtype):
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(50, 64).to(dtype)
            self.proj = _linear(64, 64, dtype=dtype)
            self.lm_head = None

    model = replace_linears(Tiny(), PackedLinear)
    assert isinstance(model.proj, PackedLinear) and isinstance(model.lm_head, PackedLinear)
    x = torch.randn(2, 64, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 0 if bf16_kernels() else 2**-7
    torch.testing.assert_close(model.lm_head(x), F.linear(x, model.embed_tokens.weight),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int4_engine_runs_small_steps_in_int4_and_batches_dense(tmp_path, dtype):
    from model_fixtures import tiny_folder
    from tidal import LLM, SamplingParams

    folder = tiny_folder(tmp_path, "llama")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5 + i, 20 + 2 * i))} for i in range(12)]
    dense = LLM(str(folder), dtype=dtype, num_kv_blocks=128, block_size=4)
    int4 = LLM(str(folder), dtype=dtype, num_kv_blocks=128, block_size=4, quantization="int4")

    def tokens(llm, batch):
        return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]

    # All twelve together: every step has more rows than int4 takes, so dense weights only.
    assert tokens(int4, prompts) == tokens(dense, prompts)
    # One at a time: decode steps of one row take the int4 weights, which round differently.
    alone = [tokens(int4, [p])[0] for p in prompts]
    assert alone != tokens(dense, prompts)
