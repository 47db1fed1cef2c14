"""GPTQ and AWQ checkpoints, built here with each format's packing from a tiny random model
(4-bit, symmetric or with zero points, groups of 32, 64 and 128), load into the GGUF
kernels' Q4_0 / Q5_0 blocks and run as the same model with the dequantized weights run dense in float32: the same greedy
tokens, and logprobs within the int8 rounding of the activations.
Act-order GPTQ (a g_idx scattering each group over the row) runs the same way, its inputs
gathered into group order. The unpacking is exact (Hypothesis, against the packers); a g_idx
of unequal groups, act-order under tensor parallelism, other bit widths and other methods
are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from model_fixtures import first_near_tie, small_folder
from tidal import LLM, SamplingParams
from tidal.model.config import ModelArch, UnsupportedModelError
from tidal.model import gguf_quants
from tidal.model.gguf_quants import MAX_ROWS, GGUFLinear, PromptRows
from tidal.model.int4_checkpoint import unpack_awq, unpack_gptq

# AutoAWQ's pack order: nibble i of a word holds output channel 8c + AWQ_ORDER[i] (written
# out here, not taken from the implementation, so that a wrong order fails)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[3, 17, 99, 4, 5], [200, 100, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 250, 251, 252]]
# the projections that share an input (GPTQ's act-order follows the input: one order for
# all of them) under the fused module that takes it
INPUTS = {"q_proj": "self_attn.qkv_proj", "k_proj": "self_attn.qkv_proj",
          "v_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj",
          "gate_proj": "mlp.gate_up_proj", "up_proj": "mlp.gate_up_proj",
          "down_proj": "mlp.down_proj"}


def words(nibbles: np.ndarray, axis: int) -> np.ndarray:
    """Pack groups of 8 nibbles along `axis` into int32 words, the first lowest."""
    moved = np.moveaxis(nibbles.astype(np.uint32), axis, -1)
    grouped = moved.reshape(*moved.shape[:-1], -1, 8)
    packed = sum(grouped[..., i] << np.uint32(4 * i) for i in range(8))
    return np.ascontiguousarray(np.moveaxis(packed, -1, axis)).astype(np.uint32).view(np.int32)


def pack_gptq(q: np.ndarray, zeros: np.ndarray, v2: bool = False,
              ) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ packing of q [out, in] and zeros [out, groups]: qweight [in/8, out], qzeros
    [groups, out/8] holding zero - 1 in v1 (a zero of 0 wraps to 15), the zero in v2."""
    stored = zeros if v2 else (zeros.astype(np.int16) - 1) & 15
    return words(q.T, 0), words(stored.T, 1)


def pack_awq(q: np.ndarray, zeros: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """AWQ (GEMM) packing: qweight [in, out/8], qzeros [groups, out/8], nibble i of a word
    holding output channel 8c + AWQ_ORDER[i]."""
    def interleave(m: np.ndarray) -> np.ndarray:  # [rows, out] -> nibble order per word
        rows, out = m.shape
        return m.reshape(rows, out // 8, 8)[:, :, list(AWQ_ORDER)].reshape(rows, out)
    return words(interleave(q.T), 1), words(interleave(zeros.T), 1)


def quantize(w: np.ndarray, group: int, sym: bool, rng, v2: bool = False,
             ) -> tuple[np.ndarray, ...]:
    """q [out, in], scales and zeros [out, groups] with w ~ scale * (q - zero); `v2`: every
    third group's zero 0 (what only GPTQ v2 stores)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    if sym:
        scale = np.abs(g).max(-1) / 7.5
        zero = np.full(scale.shape, 8)
    else:
        lo, hi = g.min(-1), g.max(-1)
        scale = (hi - lo) / 15
        zero = np.clip(np.round(-lo / scale), 1, 15)  # >= 1: GPTQ v1 stores zero - 1
        if v2:
            zero[:, ::3] = 0
    scale = scale.astype(np.float16).astype(np.float32)
    q = np.clip(np.round(g / scale[..., None]) + zero[..., None], 0, 15)
    return q.reshape(n, k).astype(np.uint8), scale, zero.astype(np.uint8)


def checkpoint(tmp: Path, method: str, group: int, sym: bool, act_order: bool = False,
               **shape) -> tuple[Path, Path]:
    """(the quantized folder, the same model with its dequantized weights as a dense one);
    `act_order`: GPTQ with each input's channels assigned to groups at random (g_idx, one
    for the projections sharing the input), `checkpoint.perms` then holding, per fused
    module, the channels in group order; `shape`: config fields over the small Llama's."""
    shape = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32, **shape}
    base = small_folder(tmp, f"base-{method}-{group}-{sym}", "llama",
                        tie_word_embeddings=False, **shape)
    tensors = load_file(str(base / "model.safetensors"))
    rng = np.random.default_rng(group + sym)
    quantized, dense, g_idx = {}, {}, {}
    checkpoint.perms = {}
    for name, t in sorted(tensors.items()):
        module = name.removesuffix(".weight")
        if not module.endswith(PROJECTIONS):
            quantized[name] = t.astype(np.float16)
            dense[name] = t.astype(np.float16).astype(np.float32)
            continue
        v2 = method == "gptq_v2"
        groups = np.arange(t.shape[1]) // group
        if act_order:  # the input's groups in a random order (GPTQ's: by importance)
            layer, proj = module.removeprefix("model.").rsplit(".", 2)[::2]
            key = f"{layer}.{INPUTS[proj]}"
            if key not in g_idx:
                g_idx[key] = rng.permutation(groups)
                checkpoint.perms[key] = np.argsort(g_idx[key], kind="stable")
            groups = g_idx[key]
        order = np.argsort(groups, kind="stable")
        q_ordered, scale, zero = quantize(t[:, order], group, sym, rng, v2)
        q = np.empty_like(q_ordered)
        q[:, order] = q_ordered  # back in the channels' own order, as checkpoints store q
        qweight, qzeros = (pack_awq(q, zero) if method == "awq" else pack_gptq(q, zero, v2))
        quantized[module + ".qweight"], quantized[module + ".qzeros"] = qweight, qzeros
        quantized[module + ".scales"] = np.ascontiguousarray(scale.T).astype(np.float16)
        if method != "awq":
            quantized[module + ".g_idx"] = groups.astype(np.int32)
        per_weight = scale[:, groups] * (q.astype(np.float32) - zero[:, groups])
        dense[name] = np.ascontiguousarray(per_weight, np.float32)  # save_file reads bytes
    folders = []
    for kind, weights in (("q", quantized), ("dense", dense)):
        folder = tmp / f"{method}-{group}-{sym}-{act_order}-{kind}"
        shutil.copytree(base, folder)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        if kind == "q":
            cfg = json.loads((folder / "config.json").read_text())
            cfg["quantization_config"] = (
                dict(quant_method="gptq", bits=4, group_size=group, sym=sym,
                     desc_act=act_order, checkpoint_format="gptq_v2" if v2 else "gptq")
                if method != "awq" else
                dict(quant_method="awq", bits=4, group_size=group, zero_point=not sym,
                     version="gemm"))
            (folder / "config.json").write_text(json.dumps(cfg))
        folders.append(folder)
    return folders[0], folders[1]


# longer than the integer kernels' steps (MAX_ROWS): its prompt runs the dequantized tiles
LONG = [int(t) for t in np.random.default_rng(7).integers(3, 256, MAX_ROWS + 16)]


def int8_rounded(module, args):
    """A projection's input rounded to int8 per 32 values as the integer kernels and the
    tiles of GGUFLinear round it (csrc/gguf_activations.h): each group's scale r * base,
    base = amax / (127 * 128) over 8 groups of a row, r = ceil(128 * the group's amax / it)."""
    x = args[0]
    rows = x.float().reshape(-1, x.shape[-1])
    groups = rows.reshape(rows.shape[0], -1, 32)
    amax = groups.abs().amax(-1)
    n = amax.shape[1]
    top = F.pad(amax, (0, -n % 8)).reshape(len(amax), -1, 8).amax(-1)
    top = top.repeat_interleave(8, dim=1)[:, :n]
    steps = torch.where(top > 0, torch.ceil(amax * 128 / top), torch.ones_like(top))
    d = steps.clamp(1, 128) * (top / (127 * 128))
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(groups * inv[..., None]).clamp(-127, 127)
    return ((q * d[..., None]).reshape(x.shape).to(x.dtype),)


def twice_rounded(prompt_rows: PromptRows, perm: np.ndarray | None = None):
    """A pre-hook rounding a projection's input as GGUFLinear rounds it: the rows of prompt
    tokens twice (int8, then the residual to int8 once more), the others once; with `perm`
    (act-order), in groups of 32 of the channels in that order."""
    def hook(module, args):
        x = args[0]
        if perm is not None:
            x = x[..., perm]
        once = int8_rounded(module, (x,))[0]
        twice = prompt_rows.of(False, x.shape[0])
        out = once
        if twice is not None and len(twice):
            out = once.clone()
            out[twice] += int8_rounded(module, (x[twice] - once[twice],))[0]
        if perm is not None:
            out = torch.empty_like(out).index_copy_(-1, torch.from_numpy(perm), out)
        return (out,)
    return hook


def generate(folder: Path, rounded: bool = False, perms: dict | None = None):
    """(the LLM, each prompt's first 8 greedy outputs, LONG's prompt logprobs). `rounded`:
    every projection but the head sees its inputs rounded as the kernels round them
    (PyTorch ops, no C++ decoder), in the order of `perms` (module name: channels)."""
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=4,
              cpu_decoder=not rounded, kv_cache_dtype="float32")  # both: the reference's KV
    if rounded:
        model = llm.engine.runner.model
        model.prompt_rows = PromptRows()  # each pass's prompt rows, as the GGUF model's
        for name, module in model.named_modules():
            if name.endswith("_proj"):
                module.register_forward_pre_hook(twice_rounded(
                    model.prompt_rows, (perms or {}).get(name)))
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    scored = llm.generate([{"prompt_token_ids": LONG}], SamplingParams(
        max_tokens=1, prompt_logprobs=1, temperature=0), use_tqdm=False)[0]
    return llm, [o.outputs[0] for o in outs], scored.prompt_logprobs[1:]


@pytest.mark.parametrize("method,group,sym,act_order", [
    ("gptq", 128, True, False), ("gptq", 32, False, False), ("gptq_v2", 64, False, False),
    ("awq", 64, False, False), ("awq", 128, True, False), ("gptq", 32, False, True),
    ("gptq", 64, True, True)])
def test_checkpoint_runs_as_its_dequantized_model(tmp_path, monkeypatch, method, group, sym,
                                                  act_order):
    """The checkpoint computes what its dequantized weights compute densely from the inputs
    the kernels see (int8-rounded per 32, a prompt's rows twice; act-order: of the inputs in
    group order): the same greedy tokens up to a near-tie (C++ decoder, integer kernels)
    and the same logprobs over a prompt longer than
    MAX_ROWS (float32 tiles; also for its Q4_0 / Q5_0, whose integer kernels may otherwise
    take more rows).
    Wrong unpacking, or act-order inputs not gathered, misses by whole units."""
    monkeypatch.setattr(gguf_quants, "NIBBLE_MAX_ROWS", MAX_ROWS)
    monkeypatch.setattr(gguf_quants, "TILE_BF16", False)  # float32 tiles on AMX CPUs too
    folder, dense = checkpoint(tmp_path, method, group, sym, act_order)
    llm, got_outs, got = generate(folder)
    _, want_outs, want = generate(dense, rounded=True, perms=checkpoint.perms)
    # up to a near-tie: an activation on an int8 rounding boundary that the reference's
    # float32 sums put one step apart moves a logprob by up to ~0.1 (0.09 on an AMX Xeon)
    for a, b in zip(got_outs, want_outs):
        tie = first_near_tie(a, 0.15)
        assert a.token_ids[:tie] == b.token_ids[:tie]
    diffs = np.array([abs(a.logprob - b.logprob) for a, b in zip(got, want)])
    # float32 rounding; now and then an activation on a rounding boundary of the int8 grid
    # lands one step apart (the dense reference's GEMM sums in another order than the
    # kernels, by CPU: one position 0.035 apart on a Zen 4 EPYC), so the worst position is
    # bounded loosely and the mean tightly (wrong unpacking misses everywhere, by whole units)
    assert diffs.max() < 5e-2 and diffs.mean() < 1e-3, diffs
    runner = llm.engine.runner
    qkv = runner.model.layers[0].self_attn.qkv_proj
    size = 18 if sym else 22  # Q4_0 blocks where every zero is 8, else Q5_0: both exact
    assert isinstance(qkv, GGUFLinear) and qkv.nbytes == 128 * 256 // 32 * size
    assert runner.decoder is not None
    with pytest.raises(ValueError, match=f"is a {method.split('_')[0]} checkpoint"):
        LLM(str(folder), quantization="int4", num_kv_blocks=8)


@settings(max_examples=25, deadline=None)
@given(n=st.sampled_from([8, 16, 24]), k=st.sampled_from([32, 64, 128]),
       seed=st.integers(0, 2**32 - 1))
def test_unpacking_inverts_each_formats_packing(n, k, seed):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    zeros = rng.integers(1, 16, (n, k // 32), dtype=np.uint8)
    qweight, qzeros = pack_gptq(q, zeros)
    got_q, got_z, perm = unpack_gptq(torch.from_numpy(qweight), torch.from_numpy(qzeros), None,
                                     32)
    assert np.array_equal(got_q, q) and np.array_equal(got_z, zeros) and perm is None
    qweight, qzeros = pack_awq(q, zeros)
    got_q, got_z = unpack_awq(torch.from_numpy(qweight), torch.from_numpy(qzeros))
    assert np.array_equal(got_q, q) and np.array_equal(got_z, zeros)


def test_gptq_v1_reads_a_stored_zero_plus_one_and_v2_the_zero_itself():
    """A v1 checkpoint stores zero - 1, so a stored 15 (a zero of 0 wrapped) reads as 16, as
    in every v1 reader; v2 stores the zero: 0 reads as 0."""
    q = np.zeros((8, 32), np.uint8)
    zeros = np.array([[0], [1], [8], [15], [0], [3], [0], [15]], np.uint8)
    _, v1 = pack_gptq(q, zeros)
    _, v2 = pack_gptq(q, zeros, v2=True)
    got_v1 = unpack_gptq(torch.zeros(4, 8, dtype=torch.int32), torch.from_numpy(v1), None, 32)[1]
    got_v2 = unpack_gptq(torch.zeros(4, 8, dtype=torch.int32), torch.from_numpy(v2), None, 32,
                         v2=True)[1]
    assert got_v1[:, 0].tolist() == [16, 1, 8, 15, 16, 3, 16, 15]
    assert np.array_equal(got_v2, zeros)


def test_a_quantized_config_over_dense_tensors_is_refused_naming_the_tensor(tmp_path):
    folder, dense = checkpoint(tmp_path, "gptq", 32, True)
    shutil.copy(dense / "model.safetensors", folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"hold no model\.layers\.0\.\w+\.\w+_proj\.qweight"):
        LLM(str(folder), num_kv_blocks=8)


def test_act_order_that_does_not_map_onto_blocks_or_ranks_is_refused_by_name(tmp_path):
    """A g_idx of unequal groups, a fused q/k/v whose parts' orders differ, and act-order
    split across tensor-parallel ranks."""
    from tidal.model.int4_checkpoint import read_checkpoint
    from tidal.model.tensor_parallel import Shard

    folder, _ = checkpoint(tmp_path, "gptq", 32, True, act_order=True)
    path = folder / "model.safetensors"
    good = load_file(str(path))
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2"):
        read_checkpoint(folder, config["quantization_config"],
                        Shard(0, 2, ModelArch.from_dict(config)))
    unequal = dict(good)
    name = "model.layers.1.mlp.down_proj.g_idx"
    unequal[name] = np.sort(unequal[name])
    unequal[name][:2] = unequal[name][-1]  # the last group 2 channels more, the first less
    save_file(unequal, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj: g_idx gives its "
                                         "groups other than 32"):
        LLM(str(folder), num_kv_blocks=8)
    apart = dict(good)
    name = "model.layers.0.self_attn.k_proj.g_idx"
    apart[name] = np.random.default_rng(1).permutation(apart[name])
    save_file(apart, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="k_proj.*act-order .desc_act. g_idx differ"):
        LLM(str(folder), num_kv_blocks=8)


@pytest.mark.parametrize("config,message", [
    (dict(quant_method="gptq", bits=3, group_size=128), "gptq with 3 bits"),
    (dict(quant_method="awq", bits=4, group_size=128, version="gemv"), "awq version 'gemv'"),
    (dict(quant_method="bitsandbytes"), "quantized checkpoints (bitsandbytes)"),
])
def test_other_quantized_checkpoints_are_refused_by_name(config, message):
    from model_fixtures import SMALL

    with pytest.raises(UnsupportedModelError, match=message.replace("(", r"\(").replace(
            ")", r"\)")):
        ModelArch.from_dict({"model_type": "llama", **SMALL, "quantization_config": config})
