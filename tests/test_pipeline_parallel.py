"""Pipeline parallelism on CPU ranks over loopback (tidal/model/pipeline_parallel.py):
each stage holds a contiguous run of the layers and their KV cache, the hidden states go
stage to stage, and every stage samples from the last stage's logits (sent where the stages
share a machine, computed from its final states elsewhere). Two and three
stages, and two stages of two tensor-parallel ranks, with a step in flight per stage or one
in all, give one process's greedy and seeded tokens and its logprobs within float32
rounding, for Llama (layers that do not divide),
Gemma 2 (its embedding scale on the first stage only, soft-capping on the last), Mixtral
with its experts split whole, and a GGUF in its own bits; with prefix-cache hits, n > 1
and ngram speculation too; steps in flight share the decodes; a stage reads only its
layers; served through the official client, a killed stage fails its request and the core
restarts; what does not split is refused naming the flag; on one machine the stages take
turns, each rank with all the cores of its stage."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from model_fixtures import small_folder
from test_models import GRANITE

from tidal import LLM, SamplingParams

PROMPTS = [[5, 9, 33, 7, 100, 3], [17, 4, 200, 8], [60, 61, 62, 60, 61, 62, 60, 61]]
LOGPROB_BOUND = 1e-4  # float32 sums in another order (tensor-parallel stages)
QUANTIZED_BOUND = 0.05  # the int8 rounding of the activations (test_tensor_parallel.py)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp")
    return {"llama": small_folder(tmp, "llama", "llama", num_hidden_layers=3),
            "gemma2": small_folder(tmp, "gemma2", "gemma2", seed=1, num_hidden_layers=4,
                                   sliding_window=4, final_logit_softcapping=30.0),
            "mixtral": small_folder(tmp, "mixtral", "mixtral", seed=2, num_local_experts=4,
                                    num_experts_per_tok=2),
            # tied: the last stage's head is the embeddings, folded with the first stage's
            "granite": small_folder(tmp, "granite", "granite", seed=3, num_hidden_layers=3,
                                    tie_word_embeddings=True, **GRANITE),
            # the first layer without RoPE: the second stage's one layer rotates
            "smollm3": small_folder(tmp, "smollm3", "smollm3", seed=4, num_hidden_layers=3,
                                    no_rope_layers=[0, 1, 1], tie_word_embeddings=False)}


def run(model: str, params: SamplingParams, prompts=PROMPTS, **options) -> list:
    llm = LLM(model, num_kv_blocks=64, num_threads=1, **options)
    try:
        return [r.outputs for r in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                params)]
    finally:
        llm.close()


def assert_same(one: list, other: list, bound: float) -> None:
    assert [[o.token_ids for o in r] for r in other] == [[o.token_ids for o in r] for r in one]
    for a, b in zip((o for r in one for o in r), (o for r in other for o in r)):
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < bound


@pytest.mark.parametrize("family, layout", [  # (TP, PP, steps in flight: the stages')
    ("llama", (1, 2, 2)), ("llama", (1, 3, 3)), ("llama", (2, 2, 2)), ("llama", (1, 2, 1)),
    ("gemma2", (1, 2, 2)), ("mixtral", (2, 2, 2)), ("granite", (1, 2, 2)),
    ("smollm3", (1, 2, 2))])
@pytest.mark.parametrize("sampled", [False, True])
def test_stages_give_one_process_tokens_and_logprobs(folders, family, layout, sampled):
    tp, pp, batches = layout
    params = SamplingParams(max_tokens=10, temperature=0.8 if sampled else 0.0,
                            seed=7 if sampled else None, logprobs=2, ignore_eos=True)
    one = run(str(folders[family]), params, dtype="float32")
    split = run(str(folders[family]), params, dtype="float32", tensor_parallel_size=tp,
                pipeline_parallel_size=pp, batches_in_flight=batches,
                enable_expert_parallel=family == "mixtral")
    assert_same(one, split, LOGPROB_BOUND)


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_ranks_and_stages_over_quantized_kv_rows_give_one_process_tokens(folders, kv):
    """TP=2 x PP=2: each rank codes the rows of its own heads and layers as one process
    does; a float32 sum in another order can move a value across a code's rounding
    boundary, hence a looser bound than float KV's."""
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
    one = run(str(folders["llama"]), params, dtype="float32", kv_cache_dtype=kv)
    split = run(str(folders["llama"]), params, dtype="float32", kv_cache_dtype=kv,
                tensor_parallel_size=2, pipeline_parallel_size=2)
    assert_same(one, split, 0.05)


def _stage_end(rank: int, store: str, local: bool, results) -> None:
    """Stage `rank` of two, one rank each: stage 0's states go to stage 1, whose layers
    scale them by 10; its final states' head, and its hidden rows, are each stage's end."""
    import torch.distributed as dist

    from tidal.model.pipeline_parallel import StageLinks

    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    try:
        links = StageLinks(rank, 1, 2, dist.new_group([0, 1]), local)
        links.vocab = 5
        weight = torch.arange(15.0).reshape(5, 3)
        heads = []

        def head(final, hidden):
            heads.append(final.clone())
            logits = final @ weight.T
            return logits if hidden is None else (logits, hidden)

        h = links.start(torch.zeros(4, dtype=torch.long), 3, torch.float32)
        h = torch.arange(12.0).reshape(4, 3) if h is None else h * 10
        logits, hidden = links.finish(h, h[[1, 3]] + 1, head, h[[0]] * 2)
        results.put((rank, logits.tolist(), hidden.tolist(), len(heads)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("local", [True, False])
def test_every_stage_ends_a_step_with_the_last_stages_logits(tmp_path, local):
    """On one machine the last stage alone runs the head and sends its logits; across
    machines it sends its final states and each stage runs the head on them."""
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ranks = [spawn.Process(target=_stage_end, args=(r, f"file://{tmp_path}/store", local,
                                                    results)) for r in (0, 1)]
    for p in ranks:
        p.start()
    got = {r: rest for r, *rest in (results.get(timeout=120) for _ in ranks)}
    for p in ranks:
        p.join(30)
    last = torch.arange(12.0).reshape(4, 3) * 10
    want = ((last[[1, 3]] + 1) @ torch.arange(15.0).reshape(5, 3).T).tolist()
    for rank in (0, 1):
        logits, hidden, heads = got[rank]
        assert logits == want and hidden == (last[[0]] * 2).tolist()
        assert heads == (1 if rank == 1 or not local else 0)


def test_two_stages_keep_two_steps_in_flight_of_half_the_decodes_each(folders):
    """Four requests decoding over two stages with two steps in flight: each step takes
    two of them (the other two are in the other step), through each stage's C++ decoder.
    Once every step has completed, stage 0 holds none of the states it sent on."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(str(folders["llama"]), num_kv_blocks=64, num_threads=1, dtype="float32",
              pipeline_parallel_size=2, batches_in_flight=2)
    try:
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS + [[9, 8, 7]]], params)
        decodes = [s.decode_tokens for s in llm.engine.core.history.steps
                   if not s.prefill_tokens]
        assert max(decodes) == 2 and decodes.count(2) >= 10
        assert llm.engine.executor.info.decoder
        assert llm.engine.executor.worker.runner.model.stage.held == 0
    finally:
        llm.close()


@pytest.mark.parametrize("spin", [None, "10000"])
def test_stages_taking_turns_give_the_other_rank_a_short_spin_and_ask_for_this_ones(
        folders, monkeypatch, caplog, spin):
    """Two stages taking turns on this machine: rank 1 starts with a short OpenMP spin, so
    its idle threads leave the cores to the computing stage. Rank 0 runs in this process,
    whose libgomp read its environment when torch loaded: without GOMP_SPINCOUNT set there,
    the engine says how to start Python."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    if spin is None:
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    else:
        monkeypatch.setenv("GOMP_SPINCOUNT", spin)
    with caplog.at_level(logging.WARNING, logger="tidal.engine"):
        llm = LLM(str(folders["llama"]), num_kv_blocks=64, num_threads=1, dtype="float32",
                  pipeline_parallel_size=2)
    try:
        rank1 = llm.engine.executor.procs[0].pid
        with open(f"/proc/{rank1}/environ", "rb") as f:
            assert b"GOMP_SPINCOUNT=10000" in f.read().split(b"\0")
    finally:
        llm.close()
    asked = [r for r in caplog.records if "GOMP_SPINCOUNT=10000" in r.getMessage()]
    assert len(asked) == (1 if spin is None else 0)


def test_tidal_generate_gives_its_own_rank_0_the_short_spin(folders):
    """`tidal generate` computes rank 0 in its own process: its LLM sets the spin before
    torch loads, so the engine has nothing to ask for."""
    code = ("import os; from tidal.cli import run; run(['generate', '--model', "
            f"{str(folders['llama'])!r}, '--pipeline-parallel-size', '2', '--raw', "
            "'--max-tokens', '3', '--temperature', '0', '--num-kv-blocks', '64', '--dtype', "
            "'float32', '1 2 3']); print('SPIN', os.environ.get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[3 tokens, length]" in proc.stdout and "SPIN 10000" in proc.stdout
    assert "GOMP_SPINCOUNT=" not in proc.stderr, proc.stderr[-2000:]


def test_stages_hit_the_prefix_cache_sample_n_and_speculate_as_one_process(folders):
    """A prompt that repeats an earlier one's prefix hits the cache, n = 3 siblings share
    the prompt's blocks, and ngram guesses are verified, each stage over its own layers'
    KV."""
    base = [60, 61, 62, 60, 61, 62, 60, 61] * 3
    params = SamplingParams(max_tokens=12, temperature=0.0, n=3, logprobs=1, ignore_eos=True)
    options = dict(dtype="float32", speculative_method="ngram", num_speculative_tokens=3,
                   enable_prefix_caching=True, num_kv_blocks=64, num_threads=1)
    outs = []
    for stages in (1, 2):
        llm = LLM(str(folders["llama"]), pipeline_parallel_size=stages, **options)
        try:
            outs.append([r.outputs for prompts in ([base], [base + [7, 8], [17, 4, 200, 8]])
                         for r in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                               params)])
            assert llm.engine.scheduler.prefix_hit_tokens >= 16
            if stages == 2:  # stage 0: layers 0-1 of 3, and their KV alone
                worker = llm.engine.executor.worker
                assert len(worker.model.layers) == len(worker.kv.layers) == 2
        finally:
            llm.close()
    assert_same(*outs, LOGPROB_BOUND)


def test_a_ggufs_stages_read_only_their_layers(tmp_path, folders, monkeypatch):
    """Two stages over a GGUF in its own bits (Q8_0) give one process's tokens; stage 0
    holds layers 0-1 as the file stores them and never reads layer 2."""
    from test_gguf import write_gguf

    from tidal.model.gguf_quants import GGUFLinear

    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    path = str(write_gguf(folders["llama"], "llama", tmp_path / "llama.gguf", qtype=QT.Q8_0))
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
    one = LLM(path, num_kv_blocks=64, num_threads=1)
    two = LLM(path, num_kv_blocks=64, num_threads=1, pipeline_parallel_size=2)
    try:
        outs = [[r.outputs for r in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                 params)] for llm in (one, two)]
        assert_same(*outs, QUANTIZED_BOUND)
        whole, stage = one.engine.runner.model, two.engine.executor.worker.model
        assert len(stage.layers) == 2 and len(whole.layers) == 3
        for mine, same in zip(stage.layers, whole.layers):  # layers 0 and 1, in the file's bits
            part, full = mine.mlp.down_proj, same.mlp.down_proj
            assert isinstance(part, GGUFLinear) and part.parts[0].qtype == QT.Q8_0
            assert torch.equal(part.parts[0].data, full.parts[0].data)
        # every tensor but the third layer's (stage 1's), which stage 0 never read
        assert sorted(stage.gguf) == sorted(n for n in whole.gguf if ".layers.2." not in n)
    finally:
        one.close()
        two.close()


def test_a_served_pipeline_answers_and_a_dead_stage_restarts_its_core(folders):
    """Two stages behind the OpenAI API: the official client's completion matches one
    process's; a stage killed with steps in flight fails the request with an error body,
    the core restarts with a new group, and answers again."""
    import openai

    from server_fixtures import Server, openai_client, wait_for_new_core
    from test_tensor_parallel import _tp_ranks

    want = run(str(folders["llama"]), SamplingParams(max_tokens=6, temperature=0.0,
                                                     ignore_eos=True), dtype="float32")
    server = Server("--model", str(folders["llama"]), "--dtype", "float32",
                    "--pipeline-parallel-size", "2", "--distributed-timeout", "5",
                    "--restart-core", "2")
    try:
        client = openai_client(server)

        def complete():
            return client.completions.create(model="llama", prompt=PROMPTS[0], max_tokens=6,
                                             temperature=0, extra_body={"ignore_eos": True})

        assert complete().choices[0].text == want[0][0].text
        core = server.core_pid()
        (stage,) = _tp_ranks(core)
        os.kill(stage, signal.SIGKILL)
        with pytest.raises(openai.APIError):
            complete()  # its step fails; the core stops
        wait_for_new_core(server, core)  # restarted, with a new group
        assert complete().choices[0].text == want[0][0].text
    finally:
        server.stop()


def test_stage_counts_and_options_that_do_not_split_are_refused_naming_the_flag(folders):
    with pytest.raises(ValueError, match=r"--pipeline-parallel-size 4 must be in 1\.\.3"):
        LLM(str(folders["llama"]), pipeline_parallel_size=4, num_kv_blocks=16)
    with pytest.raises(ValueError, match="--batches-in-flight 2: a P/D instance"):
        LLM(str(folders["llama"]), pipeline_parallel_size=2, role="prefill",
            batches_in_flight=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be at least 1"):
        LLM(str(folders["llama"]), pipeline_parallel_size=0)


@pytest.mark.parametrize("where, in_flight", [
    ({}, 1), (dict(nnodes=2), 2), (dict(distributed_executor_backend="ray"), 2),
    (dict(async_scheduling=True, nnodes=2), 1), (dict(nnodes=2, role="decode"), 1)])
def test_stages_on_one_machine_take_turns_and_across_machines_overlap(where, in_flight):
    """Unset, batches_in_flight is one per stage only where the stages may have cores of
    their own: on one machine, overlapped steps would split the cores each stage takes in
    turn (async scheduling runs one step ahead instead). Stages taking turns spin briefly
    when idle, unless told otherwise."""
    from tidal.engine.config import STAGE_SPIN_COUNT, EngineConfig

    config = EngineConfig.from_kwargs(pipeline_parallel_size=2, **where)
    assert config.scheduler.batches_in_flight == in_flight
    assert config.model.omp_spin_count == (STAGE_SPIN_COUNT if in_flight == 1 else None)
    told = EngineConfig.from_kwargs(pipeline_parallel_size=2, omp_spin_count=0, **where)
    assert told.model.omp_spin_count == 0


def test_a_stage_taking_turns_computes_with_its_machines_cores(folders):
    """Rank 0 (this process) of two stages: all the cores while the stages take turns,
    half of them with a step in flight in each (both stages compute at once)."""
    cores, before = len(os.sched_getaffinity(0)), torch.get_num_threads()
    try:
        for in_flight, threads in ((None, cores), (2, max(1, cores // 2))):
            llm = LLM(str(folders["llama"]), num_kv_blocks=64, dtype="float32",
                      pipeline_parallel_size=2, batches_in_flight=in_flight)
            try:
                assert torch.get_num_threads() == threads
            finally:
                llm.close()
    finally:
        torch.set_num_threads(before)
