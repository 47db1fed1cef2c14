"""The disk tier below the prefix cache: the scheduler's protocol (pure core: stores after
publishing, a load inline before the step that computes the rest, a load beside a step with
async scheduling or while waiting for room, a failed load computed instead, an abort while
loading), and on a real tiny model the same greedy tokens and logprobs after an
eviction, after a restart, and from a truncated file (ignored); a full tier evicts."""

from __future__ import annotations

import time

import pytest

from tidal.core import (CacheConfig, KVCacheManager, ModelOutput, Scheduler, SchedulerConfig,
                        SamplingParams)
from tidal.core.kv_tiers import KVTiers, TierIndex, tier_key

from conftest import add, sampled_for

BS = 4


def test_a_key_is_its_blocks_tokens_its_prefix_and_its_salt():
    a = tier_key(None, (1, 2, 3, 4), None)
    assert a == tier_key(None, (1, 2, 3, 4), None)  # no per-process salt, unlike hash()
    assert a != tier_key(None, (1, 2, 3, 5), None)
    assert tier_key(a, (5, 6, 7, 8), None) != tier_key(None, (5, 6, 7, 8), None)
    assert tier_key(None, (1, 2, 3, 4), (None, "lora", "x")) != a  # an adapter's KV differs


def test_the_index_forgets_the_least_recently_used_past_its_capacity():
    index = TierIndex(2, [b"a", b"b"])
    index.touch(b"a")
    index.add(b"c")
    assert b"a" in index and b"c" in index and b"b" not in index and index.evicted == 1


def tiered(num_blocks: int = 12, **config) -> Scheduler:
    kv = KVCacheManager(CacheConfig(num_blocks=num_blocks, block_size=BS), KVTiers(64))
    return Scheduler(SchedulerConfig(max_model_len=64, **config), kv)


def run(s: Scheduler, loaded: dict[str, int] | None = None):
    """One step; loads come back as `loaded` says (default: whole), and a request whose
    inline load failed samples nothing (it was left out of the forward pass)."""
    out = s.schedule()
    s.check_invariants()
    whole = {x.request_id: len(x.keys) for x in out.kv_loads}
    whole.update(loaded or {})
    sampled = sampled_for(s, out, 7)
    for x in out.kv_loads:
        if x.inline and whole[x.request_id] < len(x.keys):
            sampled.pop(x.request_id, None)
    s.update(out, ModelOutput(sampled=sampled, kv_loaded=whole))
    s.check_invariants()
    return out


def drain(s: Scheduler) -> list:
    outs = []
    while s.requests or s.kv.tiers.pending:
        outs.append(run(s))
    return outs


def evict_all(s: Scheduler) -> None:
    """Other prompts through the whole pool, four times: every cached block is evicted."""
    for i in range(4):
        add(s, f"other{i}", list(range(200 + 100 * i, 244 + 100 * i)), max_tokens=1)
        drain(s)


def stored_then_evicted(s: Scheduler, prompt: list[int]) -> None:
    """`prompt` computed (its blocks stored), then evicted from the pool."""
    add(s, "a", prompt, max_tokens=1)
    drain(s)
    evict_all(s)


def test_a_published_block_is_stored_by_the_next_step_and_loaded_after_its_eviction():
    s = tiered()
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks
    add(s, "a", prompt, max_tokens=1)
    outs = drain(s)
    stored = [key for out in outs for _, key in out.kv_stores]
    assert len(stored) == 3 and s.kv.tiers.stored_blocks == 3
    evict_all(s)
    assert s.kv.match_prefix(add(s, "c", prompt, max_tokens=2)) == []
    out = run(s, {})
    (load,) = out.kv_loads
    assert load.request_id == "c" and load.keys == stored and load.inline
    (entry,) = out.scheduled  # the same step computes the rest of the prompt
    assert entry.num_computed_tokens == 12 and entry.num_new_tokens == 1
    assert entry.block_ids[:3] == load.block_ids
    assert s.requests["c"].num_cached_tokens == 12 and s.kv.tiers.hit_blocks == 3
    assert s.requests["c"].tier_loading == [] and s.requests["c"].output_token_ids == [7]
    add(s, "d", prompt, max_tokens=1)  # published once loaded: a pool hit now
    assert len(s.kv.match_prefix(s.requests["d"])) == 3


def test_with_async_scheduling_an_admitted_load_waits_beside_the_step_then_rejoins():
    """The step after is planned before this one's loads are known: the request loads
    beside a step, computing nothing, and is a prefix hit once back in the queue."""
    s = tiered(async_scheduling=True)
    prompt = list(range(100, 113))
    stored_then_evicted(s, prompt)
    add(s, "c", prompt, max_tokens=1)
    out = run(s)
    (load,) = out.kv_loads
    assert not load.inline and not out.scheduled
    assert s.waiting[0].request_id == "c" and s.requests["c"].tier_loading == []
    out = run(s)
    (entry,) = out.scheduled
    assert entry.num_computed_tokens == 12 and entry.num_new_tokens == 1  # a prefix hit


def test_the_head_of_the_queue_loads_while_it_waits_for_room():
    """A step whose token budget another prompt takes still starts the next request's
    load: once admitted, it is a prefix hit from its first step."""
    s = tiered(num_blocks=16, max_input_tokens_per_step=8, chunked_prefill_size=8)
    prompt = list(range(100, 113))
    stored_then_evicted(s, prompt)
    add(s, "x", list(range(900, 920)), max_tokens=1)  # 20 tokens: chunks of 8
    add(s, "c", prompt, max_tokens=1)
    out = run(s)
    assert [x.request_id for x in out.scheduled] == ["x"]
    assert [load.request_id for load in out.kv_loads] == ["c"]
    assert s.waiting[0].request_id == "c" and s.requests["c"].tier_loading == []
    while not any(x.request_id == "c" for x in out.scheduled):
        out = run(s)
    (entry,) = [x for x in out.scheduled if x.request_id == "c"]
    assert entry.num_computed_tokens == 12 and s.kv.tiers.hit_blocks == 3


def test_a_block_that_fails_to_load_is_computed_instead():
    s = tiered()
    prompt = list(range(100, 113))
    stored_then_evicted(s, prompt)
    add(s, "c", prompt, max_tokens=1)
    out = run(s, {"c": 1})  # the second block's file was corrupt
    (load,) = out.kv_loads
    assert load.inline and [x.request_id for x in out.scheduled] == ["c"]
    assert load.keys[1] not in s.kv.tiers.index and s.kv.tiers.failed_blocks == 1
    assert s.waiting[0].request_id == "c" and not s.requests["c"].output_token_ids
    out = run(s)
    (entry,) = out.scheduled
    assert entry.num_computed_tokens == 4 and entry.num_new_tokens == 9
    drain(s)  # c publishes its blocks again: the failed one is stored anew
    assert load.keys[1] in s.kv.tiers.index


def test_an_abort_while_loading_gives_the_blocks_back_and_the_late_result_is_ignored():
    s = tiered(async_scheduling=True)  # loads beside a step: an abort can come meanwhile
    prompt = list(range(100, 113))
    stored_then_evicted(s, prompt)
    add(s, "c", prompt, max_tokens=1)
    out = s.schedule()
    assert out.kv_loads and "c" in s.transferring
    s.abort("c")
    s.check_invariants()
    assert s.kv.pool.num_free == s.kv.num_blocks
    s.update(out, ModelOutput(kv_loaded={"c": 3}))  # the step carrying the load ends
    s.check_invariants()
    assert s.kv.tiers.hit_blocks == 0 and not s.requests


def test_loading_is_skipped_where_computing_is_predicted_faster():
    class Fast:  # computing a block's tokens costs nothing next to a slow disk
        def shape_time(self, shape):
            return 1e-6 * shape.tokens

    kv = KVCacheManager(CacheConfig(num_blocks=12, block_size=BS), KVTiers(64))
    s = Scheduler(SchedulerConfig(max_model_len=64), kv, step_time=Fast())
    kv.tiers.load_seconds = 0.01  # measured: 10 ms a block
    prompt = list(range(100, 113))
    stored_then_evicted(s, prompt)
    add(s, "c", prompt, max_tokens=1)
    out = run(s)
    assert not out.kv_loads and out.scheduled[0].num_new_tokens == 13


# ---------------------------------------------------------------- on a real tiny model


def tiny_model(tmp_path, monkeypatch):
    """A tiny random Llama, with a cache folder of the test's own."""
    from model_fixtures import small_folder

    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    return small_folder(tmp_path, "tiny", "llama", max_position_embeddings=512)


@pytest.fixture()
def folder(tmp_path, monkeypatch):
    return tiny_model(tmp_path, monkeypatch)


PROMPT = {"prompt_token_ids": [(7 * i) % 200 + 3 for i in range(70)]}  # 4 full blocks of 16
OTHERS = [{"prompt_token_ids": [(11 * i + j) % 200 + 3 for i in range(70)]} for j in range(4)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)


def engine(folder, cache_dir, **kwargs):
    from tidal.engine.llm import LLM

    return LLM(str(folder), num_kv_blocks=12, num_threads=1, kv_cache_dir=str(cache_dir),
               **kwargs)


def answer(llm) -> tuple[list[int], list[float]]:
    (out,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    (seq,) = out.outputs
    return seq.token_ids, [lp.logprob for lp in seq.logprobs]


def tiers(llm) -> KVTiers:
    return llm.engine.core.scheduler.kv.tiers


@pytest.mark.parametrize("spec", [{}, {"speculative_method": "ngram",
                                      "num_speculative_tokens": 2},
                                  {"kv_cache_dtype": "int8"}, {"staging_bytes": 1}],
                         ids=["plain", "ngram", "int8", "a-block-a-read"])
def test_an_evicted_prefix_loads_from_disk_with_the_same_tokens_and_logprobs(folder, tmp_path,
                                                                             spec, monkeypatch):
    from tidal.engine.llm import LLM

    spec = dict(spec)
    if "staging_bytes" in spec:  # a load read into rows of one block: four reads and writes
        monkeypatch.setattr("tidal.engine.worker.STAGING_BYTES", spec.pop("staging_bytes"))
    kv = {k: v for k, v in spec.items() if k == "kv_cache_dtype"}
    plain = LLM(str(folder), num_kv_blocks=12, num_threads=1, **kv)
    fresh = answer(plain)
    want = answer(plain)  # a hit in the pool: quantized KV is read where float KV was not
    assert plain.engine.core.scheduler.prefix_hit_tokens == 64
    plain.close()
    llm = engine(folder, tmp_path / "kv", **spec)
    assert answer(llm) == fresh and tiers(llm).hit_blocks == 0
    llm.generate(OTHERS, GREEDY, use_tqdm=False)  # 4 x 5 blocks through a pool of 12
    tokens, logprobs = answer(llm)
    assert tiers(llm).hit_blocks == 4 and tokens == want[0]
    assert logprobs == pytest.approx(want[1], abs=1e-5)
    llm.close()
    # a restart: the first request of the prompt is a hit, loaded from the files
    again = engine(folder, tmp_path / "kv", **spec)
    tokens, logprobs = answer(again)
    assert tiers(again).hit_blocks == 4 and tokens == want[0]
    assert logprobs == pytest.approx(want[1], abs=1e-5)
    again.close()


@pytest.mark.parametrize("layout", [
    {"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "async_scheduling": True},
    {"pipeline_parallel_size": 2}], ids=["tp2-inline", "tp2-beside", "pp2-in-flight"])
def test_ranks_and_stages_store_and_load_their_share_of_every_block(folder, tmp_path,
                                                                    layout):
    """Each rank (its KV heads) and stage (its layers) keeps its share of every block in a
    folder of its own: an evicted prefix and a restart load on every rank, with one
    process's tokens; a block one rank lacks is computed by all."""
    from tidal.engine.llm import LLM

    plain = LLM(str(folder), num_kv_blocks=12, num_threads=1, dtype="float32")
    answer(plain)
    want = answer(plain)  # a pool hit
    plain.close()
    layout = {**layout, "dtype": "float32"}  # sums split across ranks: float32 rounding
    llm = engine(folder, tmp_path / "kv", **layout)
    try:  # closed whatever happens: a group left open fails the next one's start
        answer(llm)
        llm.generate(OTHERS, GREEDY, use_tqdm=False)  # the prompt's blocks evicted
        tokens, logprobs = answer(llm)
        assert tiers(llm).hit_blocks == 4 and tokens == want[0]
        assert logprobs == pytest.approx(want[1], abs=1e-4)
        rank0 = llm.engine.core.executor.worker.tier.folder  # whose listing is the index
    finally:
        llm.close()
    shares = sorted((tmp_path / "kv").iterdir())
    assert len(shares) == 2 and rank0 in shares  # a folder per rank or stage
    # the other rank's copy of the prompt's second block is lost: every rank computes it
    first = tier_key(None, tuple(PROMPT["prompt_token_ids"][:16]), None)
    other = next(s for s in shares if s != rank0)
    (other / f"{tier_key(first, tuple(PROMPT['prompt_token_ids'][16:32]), None).hex()}"
             ".kv").unlink()
    again = engine(folder, tmp_path / "kv", **layout)
    try:
        tokens, logprobs = answer(again)
        assert tokens == want[0] and logprobs == pytest.approx(want[1], abs=1e-4)
        assert tiers(again).failed_blocks == 1 and tiers(again).hit_blocks == 1
    finally:
        again.close()


def test_a_disk_tier_serves_only_engines_of_its_kv_dtype(folder, tmp_path):
    for kv, hits in (("int8", 0), ("auto", 0), ("fp8_e4m3", 0), ("int8", 4)):
        llm = engine(folder, tmp_path / "kv", kv_cache_dtype=kv)
        answer(llm)
        assert tiers(llm).hit_blocks == hits, kv
        llm.close()


def test_a_truncated_block_file_is_ignored_and_the_answer_is_still_right(folder, tmp_path):
    llm = engine(folder, tmp_path / "kv")
    want = answer(llm)
    llm.close()
    files = sorted((tmp_path / "kv").glob("*/*.kv"))
    assert len(files) >= 4
    for path in files:
        path.write_bytes(path.read_bytes()[:-100])
    again = engine(folder, tmp_path / "kv")
    tokens, logprobs = answer(again)
    assert tokens == want[0] and logprobs == pytest.approx(want[1], abs=1e-5)
    assert tiers(again).hit_blocks == 0 and tiers(again).failed_blocks == 1
    again.close()


def wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_disk_tier_learns_the_blocks_another_process_writes_and_deletes(tmp_path):
    """Two tiers on one folder, as two engine cores of a machine: what one writes after
    the other started becomes the other's news (and loads there); a file deleted behind
    its back leaves it as news too."""
    import torch

    from tidal.engine.kv_disk import DiskKVTier

    a, b = (DiskKVTier(tmp_path, 64, 1 << 20) for _ in range(2))
    try:
        keys = [bytes([i]) * 16 for i in range(3)]
        for i, key in enumerate(keys):
            a.store(key, bytes([i]) * 64)
        wait_for(lambda: all(b.knows(k) for k in keys))
        assert b.report().news == dict.fromkeys(keys, True) and b.report().news == {}
        out = torch.empty(64, dtype=torch.uint8)
        assert b.load_into(keys[1], out) and out.tolist() == [1] * 64
        assert a.report().news == {}  # its own writes are no news
        (tmp_path / f"{keys[0].hex()}.kv").unlink()  # another core's eviction
        wait_for(lambda: not b.knows(keys[0]))
        assert b.report().news == {keys[0]: False}
    finally:
        a.close()
        b.close()


def test_another_engine_core_hits_what_one_stored_after_it_started(folder, tmp_path):
    """Two engines on one disk tier, the second started before the first computed the
    prompt: the second's first request of it loads the first's blocks, same answer."""
    later = engine(folder, tmp_path / "kv")
    first = engine(folder, tmp_path / "kv")
    want = answer(first)
    first.close()  # its blocks written out
    written = [bytes.fromhex(path.stem) for path in (tmp_path / "kv").glob("*/*.kv")]
    assert len(written) == 4
    disk = later.engine.core.executor.worker.tier
    wait_for(lambda: all(map(disk.knows, written)))
    tokens, logprobs = answer(later)
    assert tiers(later).hit_blocks == 4 and tokens == want[0]
    assert logprobs == pytest.approx(want[1], abs=1e-5)
    later.close()


def test_a_folder_that_cannot_be_made_is_refused_by_its_flag(folder, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ValueError, match="--kv-cache-dir: cannot make"):
        engine(folder, tmp_path / "file" / "kv")


def test_a_full_disk_tier_evicts_and_never_errors(folder, tmp_path):
    block = engine(folder, tmp_path / "probe")
    block_bytes = block.engine.core.executor.worker.kv.block_nbytes
    block.close()
    llm = engine(folder, tmp_path / "kv", kv_disk_size=3.5 * block_bytes / 2**30)
    llm.generate(OTHERS, GREEDY, use_tqdm=False)
    llm.close()
    assert len(list((tmp_path / "kv").glob("*/*.kv"))) == 3


def test_a_restarted_server_answers_a_known_prompt_from_the_disk_tier(tmp_path):
    """The served path: a prompt, a restart, the same prompt: its first request after the
    restart is a prefix hit (the tier's loaded blocks, and the prompt tokens computed, in
    /metrics) with the same answer."""
    import torch

    from server_fixtures import Server, metric, openai_client
    from tidal.engine.device import pick_kv_cache_dtype
    from tidal.model.config import ModelArch
    from tidal.model.kv_quant import KVFormat
    from tidal.model.registry import resolve_model

    prompt = " ".join(f"word{i}" for i in range(120))  # a few hundred tokens: many blocks
    flags = ("--kv-cache-dir", str(tmp_path / "kv"))
    answers = []
    for _ in range(2):
        server = Server(*flags)
        try:
            done = openai_client(server).completions.create(
                model="smollm2-135m", prompt=prompt, max_tokens=8, temperature=0.0)
            time.sleep(1.0)  # the core's stats reach /metrics twice a second
            loaded = metric(server.url, "tidal:kv_disk_loaded_blocks_total")
            computed = metric(server.url, "tidal:prompt_tokens_total")
            held = metric(server.url, "tidal:kv_disk_blocks")
            # bytes: the embedded model's K and V of 16 tokens a block, in the default's
            # format (float32, or bf16 rows on a CPU with AMX or AVX512-BF16)
            kv = KVFormat(pick_kv_cache_dtype("auto", "cpu", "gguf", torch.float32))
            block = 16 * kv.bytes_per_token(
                ModelArch.from_folder(resolve_model("smollm2-135m")[0]), torch.float32)
            assert metric(server.url, "tidal:kv_cache_bytes") == 256 * block
            assert held > 0 and metric(server.url, "tidal:kv_disk_bytes") == held * block
        finally:
            server.stop()
        answers.append((done.choices[0].text, loaded, computed, done.usage.prompt_tokens))
    (first, cold, _, tokens), (second, warm, computed, _) = answers
    assert second == first and cold == 0
    full = (tokens - 1) // 16  # blocks a hit may cover: one token is always computed
    assert warm == full and computed == tokens - 16 * full
