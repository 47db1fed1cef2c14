"""Tensor parallelism on CPU ranks over loopback (tidal/model/tensor_parallel.py,
tidal/engine/tp_executor.py): two ranks give one process's greedy and seeded tokens, and
its logprobs within float32 rounding, for Llama (GQA), Qwen2 (q/k/v biases) and a model of
one key/value head (replicated on each rank) and a tied head over a vocabulary that does
not divide, with ngram speculation too; so do GGUF,
GPTQ and AWQ files in their own formats; a served model answers, and a rank that dies fails its step and the core
is restarted; sizes and options that do not split are refused at start, naming the flag."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT

from model_fixtures import first_near_tie, small_folder
from test_models import GRANITE
from server_fixtures import Server, openai_client, wait_for_new_core

from tidal import LLM, SamplingParams
from tidal.engine.tp_executor import RankFailed
from tidal.model.gguf_quants import GGUFLinear

PROMPTS = [[5, 9, 33, 7, 100, 3], [17, 4, 200, 8], [60, 61, 62, 60, 61, 62, 60, 61]]
# float32 sums in another order (one all-reduce per projection pair); in bfloat16 each
# rank's partial sum is rounded before the all-reduce, which can flip a near-tie
LOGPROB_BOUND = 1e-4
# a checkpoint's own formats round the activations to int8: a sum in another order can
# move a value across a rounding boundary (a step of ~1% of its group's largest), which
# moves a logprob of these small models by up to ~0.1 (0.07 seen on an AMX Xeon)
QUANTIZED_BOUND = 0.1


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    return {"llama": small_folder(tmp, "llama", "llama"),
            "qwen2": small_folder(tmp, "qwen2", "qwen2", seed=1),
            # one key/value head for four query heads: each rank holds it whole; a tied
            # head over a vocabulary that two ranks split unevenly (126 + 125 rows)
            "mqa": small_folder(tmp, "mqa", "llama", seed=2, num_key_value_heads=1,
                                vocab_size=251, tie_word_embeddings=True),
            # its multipliers folded into each rank's share of the weights
            "granite": small_folder(tmp, "granite", "granite", seed=3, attention_bias=True,
                                    tie_word_embeddings=True, **GRANITE)}


def run(folder: Path, tp: int, params: SamplingParams, **options):
    llm = LLM(str(folder), tensor_parallel_size=tp, num_kv_blocks=64, num_threads=1,
              **{"dtype": "float32", **options})
    try:
        return [r.outputs[0] for r in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params)]
    finally:
        llm.close()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mqa", "granite"])
@pytest.mark.parametrize("sampled", [False, True])
def test_two_ranks_give_one_process_tokens_and_logprobs(folders, family, sampled):
    params = SamplingParams(max_tokens=12, temperature=0.8 if sampled else 0.0,
                            seed=7 if sampled else None, logprobs=2, ignore_eos=True)
    one, two = (run(folders[family], tp, params) for tp in (1, 2))
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for a, b in zip(one, two):
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < LOGPROB_BOUND
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_ranks_placed_as_ray_actors_give_one_processs_tokens(folders):
    """--distributed-executor-backend ray: rank 1 is an actor of a Ray cluster (a local one
    here), meeting rank 0 at this node's address; the same tokens and logprobs."""
    pytest.importorskip("ray")
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    one = run(folders["llama"], 1, params)
    llm = LLM(str(folders["llama"]), tensor_parallel_size=2, num_kv_blocks=64, num_threads=1,
              dtype="float32", distributed_executor_backend="ray")
    try:
        (rank,) = llm.engine.executor.procs
        assert type(rank).__name__ == "_RayRank" and rank.poll() is None
        two = [r.outputs[0] for r in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params)]
    finally:
        llm.close()
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for a, b in zip(one, two):
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < LOGPROB_BOUND


def test_two_ranks_speculate_the_same_tokens(folders):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = run(folders["llama"], 1, params)
    guessed = run(folders["llama"], 2, params, speculative_method="ngram",
                  num_speculative_tokens=3)
    assert [o.token_ids for o in guessed] == [o.token_ids for o in plain]


def test_a_rank_that_dies_fails_the_step_and_stops_the_engine(folders):
    llm = LLM(str(folders["llama"]), tensor_parallel_size=2, num_kv_blocks=64,
              num_threads=1, distributed_timeout=5)
    try:
        (rank,) = llm.engine.executor.procs
        rank.kill()
        rank.wait(5)
        t0 = time.monotonic()
        with pytest.raises(RankFailed, match="rank 1"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4))
        assert time.monotonic() - t0 < 15  # within the collectives' timeout, never a hang
    finally:
        llm.close()


def test_sizes_and_options_that_do_not_split_are_refused_naming_the_flag(folders):
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 does not divide"):
        LLM(str(folders["llama"]), tensor_parallel_size=3, num_kv_blocks=16)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2: .* --quantization int8"):
        LLM(str(folders["llama"]), tensor_parallel_size=2, quantization="int8")
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        LLM(str(folders["llama"]), tensor_parallel_size=0)


def _formats(k_quants: bool):
    """Per-tensor formats: a Q4_K_M-like mix (v and down in Q6_K, the rest Q4_K), or the
    same with Q8_0 and Q4_1's blocks of 32."""
    def pick(name: str) -> QT:
        if "attn_v" in name or "ffn_down" in name:
            return QT.Q6_K if k_quants else QT.Q8_0
        return QT.Q4_K if k_quants else QT.Q4_1
    return pick


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """Llama files whose split columns fall on 256 (the activations' rounding grid and a
    K-quant block): K-quant blocks, and the planar formats' blocks of 32."""
    import gguf

    from test_gguf import write_gguf
    from test_gguf_weights import random_blocks

    tmp = tmp_path_factory.mktemp("tp-gguf")
    folder = small_folder(tmp, "wide", "llama", hidden_size=512, intermediate_size=1024,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    quantize, files = gguf.quants.quantize, {}
    # gguf has no K-quant quantizer: random valid blocks (test_gguf_weights)
    gguf.quants.quantize = lambda t, q: (random_blocks(t, q) if q in (QT.Q4_K, QT.Q6_K)
                                         else quantize(t, q))
    try:
        for mix in ("k", "32"):
            files[mix] = write_gguf(folder, "llama", tmp / f"{mix}.gguf",
                                    qtype=_formats(mix == "k"))
    finally:
        gguf.quants.quantize = quantize
    with pytest.MonkeyPatch.context() as env:  # the module's converted files, then unset
        env.setenv("TIDAL_CACHE", str(tmp / "cache"))
        yield files


@pytest.mark.parametrize("mix", ["k", "32"])
def test_a_ggufs_own_formats_split_into_each_ranks_blocks(gguf_files, mix):
    """Two ranks over a GGUF in its own bits give one process's tokens and logprobs, decoding
    through the C++ decoder as one process does, and rank 0 holds half of each split
    projection's bytes, as the file stores them."""
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    # the file's own formats compute in float32 by default (an explicit float32: a float copy)
    whole = LLM(str(gguf_files[mix]), num_kv_blocks=64, num_threads=1)
    split = LLM(str(gguf_files[mix]), tensor_parallel_size=2, num_kv_blocks=64, num_threads=1)
    try:
        one, two = ([r.outputs[0] for r in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params)] for llm in (whole, split))
        assert [o.token_ids for o in two] == [o.token_ids for o in one]
        for a, b in zip(one, two):
            for x, y in zip(a.logprobs, b.logprobs):
                assert abs(x.logprob - y.logprob) < QUANTIZED_BOUND
        assert whole.engine.executor.info.decoder and split.engine.executor.info.decoder
        layer = (whole.engine.runner.model.layers[0],
                 split.engine.executor.worker.model.layers[0])
        for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                     "mlp.down_proj"):
            full, part = (layer[i].get_submodule(path) for i in (0, 1))
            part = getattr(part, "linear", part)  # a row-parallel projection's own
            assert isinstance(part, GGUFLinear), path
            assert [w.qtype for w in part.parts] == [w.qtype for w in full.parts]
            assert part.nbytes * 2 == full.nbytes, path
        model = split.engine.executor.worker.model  # half the vocabulary's rows, in its bits
        assert model.embed_tokens.inner.num_embeddings == 256 // 2
        head = whole.engine.runner.model.lm_head
        assert model.lm_head.head.nbytes * 2 == head.nbytes
    finally:
        whole.close()
        split.close()


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_gptq_or_awq_checkpoint_splits_into_each_ranks_blocks(tmp_path, method):
    """Two ranks over a GPTQ or AWQ checkpoint (repacked into blocks of 32 as read) give one
    process's tokens, and logprobs within the int8 rounding of the activations."""
    from test_int4_checkpoints import checkpoint

    folder, _ = checkpoint(tmp_path, method, 128, sym=method == "gptq", hidden_size=512,
                           intermediate_size=1024, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=128)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    one, two = (run(folder, tp, params, dtype="auto") for tp in (1, 2))
    for a, b in zip(one, two):  # a rank's partial sums add in another order: ties may part
        tie = first_near_tie(a, 2 * QUANTIZED_BOUND)
        assert b.token_ids[:tie] == a.token_ids[:tie]
        for x, y in zip(a.logprobs[:tie + 1], b.logprobs[:tie + 1]):
            assert abs(x.logprob - y.logprob) < QUANTIZED_BOUND


def _tp_ranks(core_pid: int) -> list[int]:
    """The core's tensor-parallel ranks (its child processes running them)."""
    ranks = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == core_pid and b"tidal.engine.tp_executor" in cmdline:
            ranks.append(int(proc.name))
    return ranks


def test_a_served_split_model_answers_and_a_dead_rank_restarts_its_core(folders):
    want = run(folders["llama"], 1, SamplingParams(max_tokens=6, temperature=0.0,
                                                   ignore_eos=True))[0].text
    server = Server("--model", str(folders["llama"]), "--dtype", "float32",
                    "--tensor-parallel-size", "2",
                    "--distributed-timeout", "5", "--restart-core", "2")
    try:
        client = openai_client(server)

        def complete():
            return client.completions.create(model="llama", prompt=PROMPTS[0], max_tokens=6,
                                             temperature=0, extra_body={"ignore_eos": True})

        assert complete().choices[0].text == want
        core = server.core_pid()
        (rank,) = _tp_ranks(core)
        os.kill(rank, signal.SIGKILL)
        with pytest.raises(Exception):
            complete()  # its step fails; the core stops
        wait_for_new_core(server, core)  # restarted, with a new group
        assert complete().choices[0].text == want
    finally:
        server.stop()


@pytest.mark.parametrize("mode", ["python", "native", "mixed"])
def test_the_shared_memory_sum_is_every_ranks_and_the_same_bits_on_each(mode):
    """Three ranks (threads here) sum tensors larger than a slot, in float32 and bfloat16,
    call after call, through numpy, the C++ extension (the C++ decoder's sum), or each
    rank taking turns between the two: each gets the sum in rank order, bit for bit the
    same; gathers of rows larger than a slot between the sums give every rank each rank's
    rows side by side; a rank that never comes makes the others raise within the
    timeout."""
    import threading

    import torch

    from tidal.model.cpu_extension import extension
    from tidal.model.shm_all_reduce import ShmAllReduce

    ext = extension()
    if mode != "python" and ext is None:
        pytest.skip("the C++ extension is not built here")
    first = ShmAllReduce(0, 3, timeout_s=2.0, slot_floats=100)
    ranks = [first] + [ShmAllReduce(r, 3, 2.0, name=first.name, slot_floats=100)
                       for r in (1, 2)]
    native = [r.use_extension(ext) if mode != "python" else None for r in ranks]
    gen = torch.Generator().manual_seed(0)
    calls = [[torch.randn(7, 45, generator=gen, dtype=dtype) for _ in range(3)]
             for dtype in (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)]
    got = [[None] * 3 for _ in calls]
    logits = [torch.randn(7, 30, generator=gen) for _ in range(3)]  # 3 rows a slot
    gathered = [[None] * 3 for _ in calls]

    def rank(r: int) -> None:
        for i, parts in enumerate(calls):
            if mode == "mixed":  # numpy and C++ by turns: the call numbers are the segment's
                ranks[r].native = native[r] if (i + r) % 2 else None
            got[i][r] = ranks[r].all_reduce(parts[r].clone())
            gathered[i][r] = ranks[r].all_gather(logits[r] + i)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for parts, sums in zip(calls, got):
        want = ((parts[0].float() + parts[1].float()) + parts[2].float()).to(parts[0].dtype)
        assert all(torch.equal(s, want) for s in sums)
    for i, rows in enumerate(gathered):
        want = torch.cat([part + i for part in logits], dim=1)
        assert all(torch.equal(g, want) for g in rows)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks? \[?1.* did not reach all-reduce"):
        first.all_reduce(torch.ones(3))
    assert time.monotonic() - t0 < 10
    for r in reversed(ranks):
        r.close()
