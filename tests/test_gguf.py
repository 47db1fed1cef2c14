"""GGUF conversion against transformers: tiny random HF models of each architecture that
converts, written into GGUF files the way llama.cpp's convert_hf_to_gguf.py lays them out
(its tensor names and metadata keys, q/k rows permuted for llama, experts stacked, Gemma's
norms stored plus one, a llama3 rope_freqs tensor), convert back to exactly the HF tensors
and config (Q8_0 experts to within a quantization step); converted llama and qwen3 folders
generate HF's greedy tokens in tidal; what does not convert is refused by name."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from tokenizers.pre_tokenizers import ByteLevel

from model_fixtures import hf_greedy, small_folder
from tidal import LLM, SamplingParams
from tidal.model.config import ModelArch
from tidal.model.gguf_convert import ARCHITECTURES, convert_gguf

LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=64)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
GEMMA3_ROPE = {"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
               "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}
# name -> (GGUF architecture, transformers model_type, config fields over SMALL's)
CASES = {
    "llama3": ("llama", "llama", dict(tie_word_embeddings=True, rope_parameters=LLAMA3)),
    "qwen2": ("qwen2", "qwen2", {}),
    "qwen2-yarn": ("qwen2", "qwen2", dict(max_position_embeddings=128, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32))),
    "qwen3": ("qwen3", "qwen3", {}),
    "phi3": ("phi3", "phi3", dict(sliding_window=12, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    "qwen2_moe": ("qwen2moe", "qwen2_moe", dict(shared_expert_intermediate_size=48, **MOE)),
    "qwen3_moe": ("qwen3moe", "qwen3_moe", dict(norm_topk_prob=True, **MOE)),
    "gemma2": ("gemma2", "gemma2", dict(sliding_window=8, query_pre_attn_scalar=16)),
    "gemma3": ("gemma3", "gemma3_text", dict(sliding_window=8, query_pre_attn_scalar=16,
                                             rope_parameters=GEMMA3_ROPE)),
}
# config.json fields the conversion must reproduce (where the HF config has them).
CONFIG_KEYS = ("model_type", "architectures", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "rms_norm_eps", "rope_parameters", "partial_rotary_factor",
               "max_position_embeddings", "vocab_size", "tie_word_embeddings", "bos_token_id",
               "eos_token_id", "sliding_window", "layer_types", "hidden_act",
               "hidden_activation", "num_experts", "num_local_experts", "num_experts_per_tok",
               "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
               "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
# The GGUF's whole tokenizer: byte-level BPE over 255 byte symbols and one merge of two.
_BYTES = sorted(ByteLevel.alphabet())
MERGES = [f"{_BYTES[0]} {_BYTES[1]}"]
TOKENS = _BYTES[:255] + [_BYTES[0] + _BYTES[1]]


def hf_folder(tmp: Path, name: str) -> Path:
    """small_folder with every tensor redrawn (norms too, so a swapped name shows)."""
    _, model_type, config = CASES[name]
    folder = small_folder(tmp, name, model_type, **config)
    path = folder / "model.safetensors"
    rng = np.random.default_rng(0)
    tensors = {k: (0.2 * rng.standard_normal(v.shape)).astype(np.float32)
               for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


def write_gguf(folder: Path, arch: str, path: Path, extra: dict | None = None,
               qtype=gguf.GGMLQuantizationType.F32) -> Path:
    """The GGUF llama.cpp's convert_hf_to_gguf.py writes for `folder` (matrices as `qtype`,
    or as `qtype(gguf_name)` for a callable, the rest float32), with a byte-level tokenizer;
    `extra`: more tensors, by GGUF name."""
    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(arch_id, layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg["rope_parameters"]
    full = rope.get("full_attention", rope)
    w.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if full["rope_type"] in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(full["rope_type"]))
        w.add_rope_scaling_factor(full["factor"])
    if full["rope_type"] == "yarn":
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
    if arch != "phi3":  # Phi-3's set_gguf_parameters writes no key length
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if experts := cfg.get("num_local_experts", cfg.get("num_experts")):
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in cfg:
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg["head_dim"])
    if arch == "phi3":
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg["hidden_size"])
                                   // heads)
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
    if arch in ("phi3", "gemma2", "gemma3"):
        w.add_sliding_window(cfg["sliding_window"] or 0)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([gguf.TokenType.NORMAL] * len(TOKENS))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])

    def add(name: str, t: np.ndarray) -> None:
        name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        q = qtype(name) if callable(qtype) else qtype
        if t.ndim >= 2 and q != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(t, q), raw_dtype=q)
        else:
            w.add_tensor(name, t)

    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, t in tensors.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if "q_proj" in name else cfg["num_key_value_heads"]
            t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1  # Gemma's RMSNorm computes x * (1 + w); llama.cpp stores 1 + w
        if m := re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name):
            experts.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = t
        else:
            add(name, t)
    for name, parts in experts.items():  # one [experts, out, in] tensor per projection
        add(name, np.stack([parts[e] for e in sorted(parts)]))
    if cfg["model_type"] == "llama" and rope.get("rope_type") == "llama3":
        extra = {"rope_freqs.weight": llama3_divisors(rope, cfg["head_dim"]), **(extra or {})}
    for name, t in (extra or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_divisors(rope: dict, dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for a llama3 schedule (LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (HF folder, converted folder), built once per case on first use."""
    tmp, cache = tmp_path_factory.mktemp("gguf"), {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in cache:
            hf = hf_folder(tmp, name)
            path = write_gguf(hf, CASES[name][0], tmp / f"{name}.gguf")
            cache[name] = hf, convert_gguf(path, tmp / f"{name}-converted")
        return cache[name]
    return get


@pytest.mark.parametrize("name", CASES)
def test_tensors_and_config_round_trip(converted, name):
    from transformers import AutoConfig, AutoTokenizer

    hf, out = converted(name)
    want, got = load_file(str(hf / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == np.float32 and got[key].shape == tensor.shape, key
        np.testing.assert_allclose(got[key], tensor, rtol=0, atol=1e-6, err_msg=key)
    hf_cfg = AutoConfig.from_pretrained(str(hf)).to_dict()
    # What the file leaves out, config.json leaves out: transformers reads its defaults
    # back, and tidal reads the same architecture from either.
    cfg = AutoConfig.from_pretrained(str(out)).to_dict()
    wrong = {k: (hf_cfg[k], cfg.get(k)) for k in CONFIG_KEYS
             if k in hf_cfg and hf_cfg[k] != cfg.get(k)}
    raw = json.loads((out / "config.json").read_text())
    assert not wrong and raw["dtype"] == "float32"
    assert ModelArch.from_dict(raw) == ModelArch.from_dict(hf_cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.convert_ids_to_tokens(list(range(256))) == TOKENS


@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen3_moe", "gemma2"])
def test_converted_folder_generates_hf_tokens(converted, name):
    from transformers import AutoModelForCausalLM

    hf, out = converted(name)
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 13, 30)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matmuls this small: threads only wait on a busy machine
    try:
        want = [hf_greedy(model, p, 10, eos=None) for p in prompts]
    finally:
        torch.set_num_threads(threads)
    llm = LLM(str(out), dtype="float32", num_kv_blocks=64, block_size=4)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_quantized_experts_dequantize(tmp_path):
    hf = hf_folder(tmp_path, "qwen3_moe")
    path = write_gguf(hf, "qwen3moe", tmp_path / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    got = load_file(str(convert_gguf(path, tmp_path / "out") / "model.safetensors"))
    for key, tensor in load_file(str(hf / "model.safetensors")).items():
        # Q8_0: 8-bit steps of each 32-value block's largest magnitude
        np.testing.assert_allclose(got[key], tensor, rtol=0, atol=np.abs(tensor).max() / 127,
                                   err_msg=key)
        assert got[key].dtype == np.float32 and (tensor.ndim == 1 or (got[key] != tensor).any())


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'mamba'.*llama, .*qwen3moe"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [tmp_path / "m.gguf"]
    assert {arch for arch, _, _ in CASES.values()} == set(ARCHITECTURES)  # each one tested


def test_rope_freqs_without_a_llama3_schedule_is_refused(tmp_path):
    hf = small_folder(tmp_path, "llama", "llama")
    path = write_gguf(hf, "llama", tmp_path / "m.gguf",
                      extra={"rope_freqs.weight": np.linspace(1, 3, 8, dtype=np.float32)})
    with pytest.raises(ValueError, match="llama GGUF.*rope_freqs"):
        convert_gguf(path, tmp_path / "out")


def _redrawn(folder: Path, seed: int) -> Path:
    """`folder`'s model with every tensor drawn again from `seed`: same shapes, other values."""
    path = folder / "model.safetensors"
    rng = np.random.default_rng(seed)
    save_file({k: (0.2 * rng.standard_normal(v.shape)).astype(np.float32)
               for k, v in load_file(str(path)).items()}, str(path), metadata={"format": "pt"})
    return folder


@pytest.fixture
def conversions(monkeypatch, tmp_path):
    """resolve_model's cache in tmp_path; the list of GGUFs it converts, in order."""
    import tidal.model.gguf_convert as gguf_convert

    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    calls = []

    def counting(path, out, **options):
        calls.append(Path(path))
        return convert_gguf(path, out, **options)
    monkeypatch.setattr(gguf_convert, "convert_gguf", counting)
    return calls


@pytest.mark.parametrize("same_mtime", [True, False])
def test_a_gguf_replaced_by_one_of_its_name_and_size_converts_anew(tmp_path, conversions,
                                                                   same_mtime):
    from tidal.model.registry import dense_weights, resolve_model

    path = tmp_path / "m.gguf"
    old = write_gguf(_redrawn(hf_folder(tmp_path / "a", "qwen2"), 1), "qwen2", path)
    folder, _ = resolve_model(str(path))
    dense_weights(folder)
    old_weights = load_file(str(folder / "model.safetensors"))
    stat = path.stat()
    new = write_gguf(_redrawn(hf_folder(tmp_path / "b", "qwen2"), 2), "qwen2",
                     tmp_path / "b" / "m.gguf")
    assert new.stat().st_size == stat.st_size and new.read_bytes() != old.read_bytes()
    new.replace(path)
    if same_mtime:  # as `cp -p` or an unpacked archive leaves it: only the bytes differ
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert path.stat().st_mtime_ns == stat.st_mtime_ns
    folder2, _ = resolve_model(str(path))
    assert conversions == [path, path] and folder2 != folder
    dense_weights(folder2)
    got = load_file(str(folder2 / "model.safetensors"))
    want = load_file(str(convert_gguf(path, tmp_path / "fresh") / "model.safetensors"))
    assert got.keys() == want.keys() == old_weights.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert all((got[k] != old_weights[k]).any() for k in got)


def test_an_unchanged_gguf_converts_once(tmp_path, conversions):
    from tidal.model.registry import dense_weights, gguf_source, resolve_model

    path = write_gguf(hf_folder(tmp_path, "qwen2"), "qwen2", tmp_path / "m.gguf")
    first, _ = resolve_model(str(path))
    # the weights stay in the GGUF until a run asks for dense ones
    assert gguf_source(first) == path.resolve() and not (first / "model.safetensors").exists()
    dense_weights(first)
    written = (first / "model.safetensors").stat().st_mtime_ns
    second, _ = resolve_model(str(path))
    dense_weights(second)
    assert conversions == [path] and second == first
    assert (second / "model.safetensors").stat().st_mtime_ns == written


def test_a_conversion_finished_first_elsewhere_is_kept(tmp_path, monkeypatch):
    """Two servers starting at once on a new GGUF both convert it: the one finishing second
    keeps the folder the first wrote (a server may be reading it), not its own copy."""
    import tidal.model.gguf_convert as gguf_convert

    path = write_gguf(hf_folder(tmp_path, "qwen2"), "qwen2", tmp_path / "m.gguf")
    out = tmp_path / "cache" / "m"
    save = gguf_convert.save_tokenizer

    def beaten(reader, gguf_path, folder):  # the other process renames its folder in now
        save(reader, gguf_path, folder)
        shutil.copytree(folder, out)
        (out / "theirs").touch()
    monkeypatch.setattr(gguf_convert, "save_tokenizer", beaten)
    assert convert_gguf(path, out, weights=False) == out
    assert (out / "theirs").is_file() and (out / "config.json").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["m"]  # no copy of ours left


def test_gguf_fingerprint_sees_its_head_tail_and_slices(tmp_path):
    from tidal.model import registry

    path = tmp_path / "big.gguf"
    size = 40 << 20
    with open(path, "wb") as f:
        f.truncate(size)
    stat = path.stat()
    base = registry.gguf_fingerprint(path)
    assert registry.gguf_fingerprint(path) == base
    for offset in (16, 5 << 20, size - 16, size * 3 // (registry._SLICES + 1) + 7):
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(b"\1")
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert registry.gguf_fingerprint(path) != base, offset
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(b"\0")
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert registry.gguf_fingerprint(path) == base, offset
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert registry.gguf_fingerprint(path) != base  # a touched file converts anew too


def test_the_one_pass_reader_reads_every_field_as_the_plain_reader(tmp_path):
    """tidal's reader (and what it lends transformers for the tokenizer) parses array fields
    in one pass over the bytes: every field of the embedded file (its 49k-token vocabulary,
    merges, scalars, strings) has the plain reader's parts, data indices and contents; a
    file cut inside the vocabulary is refused as truncated."""
    from tidal.model.gguf_file import lent_to_gguf, open_gguf
    from tidal.model.registry import embedded_gguf

    path = embedded_gguf("smollm2-135m")
    plain, fast = gguf.GGUFReader(path), open_gguf(path)
    assert list(plain.fields) == list(fast.fields)
    for key, a in plain.fields.items():
        b = fast.fields[key]
        assert (a.offset, a.name, a.types, a.data) == (b.offset, b.name, b.types, b.data), key
        assert len(a.parts) == len(b.parts), key
        assert all(p.dtype == q.dtype and np.array_equal(p, q)
                   for p, q in zip(a.parts, b.parts)), key
        assert a.contents() == b.contents(), key
    assert len(fast.fields["tokenizer.ggml.tokens"].data) == 49152
    with lent_to_gguf():
        assert gguf.GGUFReader is type(fast)
    assert gguf.GGUFReader is not type(fast)
    tokens = fast.fields["tokenizer.ggml.tokens"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(path).read_bytes()[:int(tokens.parts[tokens.data[1000]].ctypes.data
                                                 - fast.data.ctypes.data)])
    with pytest.raises(ValueError, match="truncated"):
        open_gguf(cut)
