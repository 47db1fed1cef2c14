"""read_gguf against gguf_convert.hf_tensors: tiny GGUF files (test_gguf's writer: llama.cpp's
names, llama's q/k rows permuted, experts stacked, Gemma norms plus one) with Q8_0/Q4_0
matrices from gguf's quantizer, K-quant ones from random valid blocks, and float ones; each
weight read in its own format dequantizes to exactly the float32 tensor the conversion
writes under the same name, is a view of the file's memory map unless reordered or
repacked, and holds the file's bytes, no more. Unsupported types and truncated files are
refused with the file's name."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

from model_fixtures import small_folder
from test_gguf import _redrawn, write_gguf
from tidal.model import cpu_decode
from tidal.model.gguf_convert import _unpermute, convert_gguf, hf_config, hf_tensors
from tidal.model.gguf_quants import QuantizedWeight
from tidal.model.gguf_weights import read_gguf

WIDE = dict(hidden_size=256, intermediate_size=256, head_dim=64)  # K-quant rows: 256 wide
MOE = dict(num_experts=4, num_experts_per_tok=2)
# name -> (transformers model_type, GGUF architecture, config over SMALL's)
MODELS = {
    "llama": ("llama", "llama", {}),
    "llama-wide": ("llama", "llama", WIDE),
    "qwen2_moe": ("qwen2_moe", "qwen2moe", dict(moe_intermediate_size=32,
                                                shared_expert_intermediate_size=64, **MOE)),
    "qwen3_moe-wide": ("qwen3_moe", "qwen3moe", dict(moe_intermediate_size=256, **WIDE, **MOE)),
    "gemma2": ("gemma2", "gemma2", dict(sliding_window=8, query_pre_attn_scalar=16)),
}
CASES = [("llama", QT.Q8_0), ("llama", QT.Q4_0), ("llama-wide", QT.Q4_K),
         ("llama-wide", QT.Q5_K), ("llama-wide", QT.Q6_K), ("qwen2_moe", QT.Q4_0),
         ("qwen2_moe", QT.Q8_0), ("qwen3_moe-wide", QT.Q6_K), ("gemma2", QT.Q8_0),
         ("llama", QT.F16), ("llama", QT.BF16)]
# Byte offsets of a block's float16 scales.
SCALE_AT = {QT.Q4_0: (0,), QT.Q5_1: (0, 2), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}
EXT = cpu_decode.extension()


def random_blocks(t: np.ndarray, qtype: QT) -> np.ndarray:
    """Valid blocks of `qtype` for a tensor of t's shape: random quants (every bit pattern)
    and small float16 scales of either sign (gguf has no K-quant quantizer); the scales of
    types outside SCALE_AT stay random too."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(t.size)
    rows, nb = t.size // t.shape[-1], t.shape[-1] // block
    raw = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    for at in SCALE_AT.get(qtype, ()):
        d = rng.uniform(1e-3, 2e-2, (rows, nb)) * rng.choice([-1, 1], (rows, nb))
        raw[:, :, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(*t.shape[:-1], nb * size)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """(model name, qtype) -> a GGUF of that model with its matrices in qtype, written once."""
    tmp, cache = tmp_path_factory.mktemp("gguf-weights"), {}
    quantize = gguf.quants.quantize

    def get(name: str, qtype: QT) -> Path:
        if (name, qtype) not in cache:
            model_type, arch, config = MODELS[name]
            folder = tmp / name
            if not folder.exists():
                _redrawn(small_folder(tmp, name, model_type, **config), 0)
            if qtype in (QT.Q8_0, QT.Q4_0, QT.F16, QT.BF16):
                write = quantize
            else:
                write = random_blocks
            gguf.quants.quantize = write
            try:
                cache[name, qtype] = write_gguf(folder, arch, tmp / f"{name}-{qtype.name}.gguf",
                                                qtype=qtype)
            finally:
                gguf.quants.quantize = quantize
        return cache[name, qtype]
    return get


def converted(path: Path) -> dict[str, np.ndarray]:
    reader = gguf.GGUFReader(path)
    return hf_tensors(reader, hf_config(reader))


def as_float(w) -> np.ndarray:
    return (w.dequantize_rows(0, w.shape[0]) if isinstance(w, QuantizedWeight)
            else w.float()).numpy()


@pytest.mark.parametrize("planar", [False, None, True], ids=["file", "default", "planar"])
@pytest.mark.parametrize("name, qtype", CASES, ids=lambda c: getattr(c, "name", c))
def test_every_weight_dequantizes_to_the_converted_tensor(gguf_file, name, qtype, planar):
    path = gguf_file(name, qtype)
    want = converted(path)
    weights = read_gguf(path, planar=planar, use_extension=False)
    assert sorted(weights) == sorted(want)
    assert weights.config == hf_config(gguf.GGUFReader(path))
    for key, w in weights.items():
        if want[key].ndim == 1:
            assert w.dtype == torch.float32, key
        elif qtype in (QT.F16, QT.BF16):
            assert w.dtype == {QT.F16: torch.float16, QT.BF16: torch.bfloat16}[qtype], key
        else:
            assert isinstance(w, QuantizedWeight) and w.qtype == qtype, key
        assert w.shape == want[key].shape, key
        np.testing.assert_array_equal(as_float(w), want[key], err_msg=key)
    if "moe" in name:
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in weights


@pytest.mark.skipif(EXT is None, reason="needs tidal's C++ extension")
@pytest.mark.parametrize("name, qtype", [("llama-wide", QT.Q4_K), ("qwen2_moe", QT.Q4_0)],
                         ids=lambda c: getattr(c, "name", c))
def test_the_extensions_dequantization_matches_too(gguf_file, name, qtype):
    path = gguf_file(name, qtype)
    want = converted(path)
    for key, w in read_gguf(path).items():
        np.testing.assert_allclose(as_float(w), want[key], rtol=1e-6, atol=0, err_msg=key)


@pytest.mark.parametrize("planar", [False, True], ids=["file", "planar"])
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q5_1, QT.Q6_K], ids=lambda t: t.name)
def test_reordering_rows_of_blocks_is_unpermute_of_the_floats(qtype, planar):
    heads, n, k = 4, 32, 512
    raw = random_blocks(np.zeros((n, k)), qtype)
    w = QuantizedWeight("w", _unpermute(raw, heads), qtype, (n, k), planar, use_extension=False)
    want = _unpermute(gguf.quants.dequantize(raw, qtype), heads)
    np.testing.assert_array_equal(w.dequantize_rows(0, n).numpy(), want)
    assert not np.array_equal(want, gguf.quants.dequantize(raw, qtype))  # rows did move


def _in_map(t: torch.Tensor, mm: np.memmap) -> bool:
    start = mm.ctypes.data
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + mm.size


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "in-memory"])
@pytest.mark.parametrize("name, qtype", [("qwen3_moe-wide", QT.Q6_K), ("llama", QT.Q4_0),
                                         ("llama", QT.F16), ("llama", QT.BF16)],
                         ids=lambda c: getattr(c, "name", c))
def test_weights_hold_the_files_bytes_once(gguf_file, name, qtype, in_place):
    """In place, matrices view the map (but reordered q/k rows); by default the quantized
    ones are copied out of it (into huge-page memory), the float ones still view it."""
    weights = read_gguf(gguf_file(name, qtype), planar=False, use_extension=False,
                        in_place=in_place)
    mm, tensors = weights.reader.data, weights.reader.tensors
    quant_bytes = sum(int(t.n_bytes) for t in tensors if t.tensor_type not in (QT.F32, QT.F16,
                                                                                  QT.BF16))
    float_bytes = sum(int(t.n_bytes) for t in tensors) - quant_bytes
    assert weights.nbytes == quant_bytes + float_bytes
    held = {"quant": 0, "float": 0}
    for key, w in weights.items():
        quantized = isinstance(w, QuantizedWeight)
        data = w.data if quantized else w
        held["quant" if quantized else "float"] += data.numel() * data.element_size()
        reordered = "q_proj" in key or "k_proj" in key
        if data.dim() == 2:  # matrices: the file's own bytes
            viewed = not (reordered and name.startswith("llama")) and (in_place or not quantized)
            assert _in_map(data, mm) == viewed, key
        else:
            assert data.dtype == torch.float32 and not _in_map(data, mm), key
    assert held["quant"] == quant_bytes  # not one float copy of a quantized weight
    assert held["float"] <= float_bytes  # a rope_freqs tensor is read into the config only


def test_weights_in_memory_equal_those_in_place(gguf_file):
    path = gguf_file("llama", QT.Q6_K)
    copied, viewed = read_gguf(path, use_extension=False), read_gguf(path, use_extension=False,
                                                                     in_place=True)
    for key, w in copied.items():
        if isinstance(w, QuantizedWeight):
            assert w.data.data_ptr() % 64 == 0, key
            assert torch.equal(w.data, viewed[key].data), key


def test_planar_formats_are_repacked_in_the_files_bytes(gguf_file):
    weights = read_gguf(gguf_file("llama", QT.Q4_0), use_extension=False)
    w = weights["model.layers.0.mlp.down_proj.weight"]
    assert w.planar and not _in_map(w.data, weights.reader.data)
    assert w.nbytes == 64 * 128 // 32 * 18


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.Q3_K, QT.IQ2_XXS], ids=lambda t: t.name)
def test_an_unsupported_type_names_the_file_tensor_and_type(gguf_file, qtype):
    path = gguf_file("llama-wide", qtype)
    with pytest.raises(ValueError) as info:
        read_gguf(path, use_extension=False)
    assert re.match(rf"{re.escape(str(path))}: GGUF tensor '[\w.]+\.weight' has type "
                    rf"{qtype.name}, which tidal does not run", str(info.value))


def _cut(path: Path, size: int, tmp: Path) -> Path:
    out = tmp / f"cut-{size}.gguf"
    out.write_bytes(path.read_bytes()[:size])
    return out


def test_a_file_cut_in_its_tensor_data_is_truncated(gguf_file, tmp_path):
    path = gguf_file("qwen2_moe", QT.Q4_0)
    last = gguf.GGUFReader(path).tensors[-1]
    cut = _cut(path, last.data_offset + last.n_bytes // 2, tmp_path)
    for read in (read_gguf, lambda p: convert_gguf(p, tmp_path / "out")):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(cut))} is truncated: tensor "
                                             rf"'{last.name}' "
                                             rf"\(\w+\) ends at byte \d+, the file at byte"):
            read(cut)
    assert not (tmp_path / "out").exists()


def test_a_file_cut_in_its_header_is_truncated(gguf_file, tmp_path):
    path = gguf_file("llama", QT.Q8_0)
    first = gguf.GGUFReader(path).tensors[0]
    data_start = first.data_offset
    config = read_gguf(path).config
    for size in (3, 40, 300, data_start // 2):
        cut = re.escape(str(_cut(path, size, tmp_path)))
        for known in (None, config):  # the tokenizer's arrays read, or stepped over
            with pytest.raises(ValueError, match=rf"^{cut} is truncated: "
                                                 "its header runs past byte"):
                read_gguf(tmp_path / f"cut-{size}.gguf", config=known)
    with pytest.raises(ValueError, match=rf"is truncated: tensor '{first.name}'"):
        read_gguf(_cut(path, data_start, tmp_path))  # every header byte, no tensor data
    with pytest.raises(ValueError, match=r"cut-0.gguf is truncated: it is empty"):
        read_gguf(_cut(path, 0, tmp_path))


def test_a_known_config_skips_the_tokenizers_arrays_and_reads_the_same_weights(gguf_file):
    path = gguf_file("llama", QT.Q8_0)
    full = read_gguf(path)
    fast = read_gguf(path, config=full.config)
    tokens = "tokenizer.ggml.tokens"
    assert len(full.reader.fields[tokens].data) == 256 and fast.reader.fields[tokens].data == []
    assert fast.keys() == full.keys()
    for name in full:
        np.testing.assert_array_equal(as_float(fast[name]), as_float(full[name]), err_msg=name)


def test_a_file_that_is_no_gguf_is_named(tmp_path):
    path = tmp_path / "notes.gguf"
    shutil.copy(__file__, path)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} is not a GGUF file tidal "
                                         "reads: .*magic"):
        read_gguf(path)
