"""P/D KV transfer between two engine cores in this process, over real ZMQ TCP sockets: the
decode side's blocks hold the prefill side's bytes, greedy output equals a mixed engine's,
a decode core with no room holds requests back, and a lost peer frees blocks on both sides."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from model_fixtures import tiny_folder
from tidal.cluster.kv_transfer import KVLink
from tidal.core import SamplingParams
from tidal.engine.config import EngineConfig
from tidal.engine.core import EngineCore

PROMPTS = [list(range(100, 137)), list(range(500, 503)), list(range(900, 964))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def make_core(folder, role: str, blocks: int = 64, **kwargs) -> EngineCore:
    config = EngineConfig.from_kwargs(model=str(folder), dtype="float32", role=role,
                                      num_kv_blocks=blocks, block_size=16, num_threads=1,
                                      **kwargs)
    return EngineCore(config, folder)


class Pair:
    """A prefill core and a decode core with their links, stepped by hand."""

    def __init__(self, folder, decode_blocks: int = 64, decode_kwargs: dict | None = None,
                 **prefill_kwargs) -> None:
        self.ctx = zmq.Context()
        self.p = make_core(folder, "prefill", **prefill_kwargs)
        self.d = make_core(folder, "decode", decode_blocks, **(decode_kwargs or {}))
        self.pl = KVLink(self.p, self.ctx, "127.0.0.1")
        self.dl = KVLink(self.d, self.ctx, "127.0.0.1", timeout=30)
        self.sent: list = []  # every KVBlocks the prefill side sent, as the decode side got it
        self.landed: dict[str, bytes] = {}  # the decode blocks' bytes right after landing
        self.source: dict[str, bytes] = {}  # the prefill blocks' bytes just before freeing
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, object] = {}
        land, kv_sent = self.dl._land, self.p.scheduler.kv_sent

        def spy_land(msg):
            self.sent.append(msg)
            out = land(msg)
            self.landed[msg.request_id] = self.d.executor.read_blocks(msg.dst_block_ids)[0]
            return out

        def spy_sent(rid):
            blocks = self.p.scheduler.kv.block_ids(rid)
            self.source[rid] = self.p.executor.read_blocks(list(blocks))[0]
            kv_sent(rid)
        self.dl._land, self.p.scheduler.kv_sent = spy_land, spy_sent

    def add(self, rid: str, prompt: list[int], params=GREEDY) -> None:
        self.d.add(rid, prompt, params)
        self.dl.on_add(rid, self.pl.address)

    def pump(self, rounds: int = 1) -> None:
        for _ in range(rounds):
            for link, core in ((self.pl, self.p), (self.dl, self.d)):
                outs = []
                for sock in link.sockets:
                    if not sock.closed and sock.poll(5):  # closed: a "dead" side
                        outs += link.handle(sock)
                if core.can_step():
                    outs += core.step()
                for o in link.after_step(outs):
                    self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                    if o.finished:
                        self.finished[o.request_id] = o

    def run(self, until=lambda pair: False, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not until(self) and (self.d.has_work() or self.p.has_work()):
            assert time.monotonic() < deadline, "timed out"
            self.pump()

    def close(self) -> None:
        self.pl.close()
        self.dl.close()
        self.ctx.term()
        self.p.close()
        self.d.close()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("pd"), "llama")


def mixed_greedy(folder, prompts, **kwargs):
    core = make_core(folder, "mixed", **kwargs)
    for i, p in enumerate(prompts):
        core.add(f"r{i}", p, GREEDY)
    tokens: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_decode_blocks_hold_the_prefill_bytes_and_greedy_equals_a_mixed_engine(folder):
    pair = Pair(folder)
    try:
        for i, p in enumerate(PROMPTS):
            pair.add(f"r{i}", p)
        pair.run(until=lambda x: len(x.sent) == len(PROMPTS))
        assert sorted(m.request_id for m in pair.sent) == ["r0", "r1", "r2"]
        for msg in pair.sent:
            n = len(PROMPTS[int(msg.request_id[1:])])
            assert len(msg.src_block_ids) == len(msg.dst_block_ids) == -(-n // 16)
            assert msg.shape[:3] == [2, 2, len(msg.dst_block_ids)]  # layers, K/V, blocks
            assert pair.landed[msg.request_id] == msg.data == pair.source[msg.request_id]
            assert any(msg.data)  # real KV, not an empty cache
        assert pair.p.scheduler.kv.pool.num_used == 0  # sent: the prefill side freed them
        assert not pair.pl.tasks
        pair.run()
        assert [pair.tokens[f"r{i}"] for i in range(3)] == mixed_greedy(folder, PROMPTS)
        assert all(pair.finished[f"r{i}"].finish_reason == "length" for i in range(3))
        assert pair.d.scheduler.kv.pool.num_used == 0 and not pair.dl.prefill_of
    finally:
        pair.close()


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantized_kv_moves_as_its_codes_and_scales(folder, kv):
    pair = Pair(folder, decode_kwargs={"kv_cache_dtype": kv}, kv_cache_dtype=kv)
    try:
        for i, p in enumerate(PROMPTS):
            pair.add(f"r{i}", p)
        pair.run()
        for msg in pair.sent:  # one byte a value and 2 for each row's scale
            assert msg.dtype == str(pair.d.executor.worker.kv.dtype) and msg.shape[-1] == 18
            assert pair.landed[msg.request_id] == msg.data == pair.source[msg.request_id]
        want = mixed_greedy(folder, PROMPTS, kv_cache_dtype=kv)
        assert [pair.tokens[f"r{i}"] for i in range(3)] == want
    finally:
        pair.close()


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_kv_moves_between_instances_of_other_tensor_parallel_sizes(folder, prefill_tp,
                                                                   decode_tp):
    """A split instance sends its blocks as one process holds them (each rank's KV heads
    side by side) and takes them so: greedy through the pair equals a mixed engine's, and
    the decode side's blocks read back the bytes that landed."""
    moved(folder, PROMPTS, dict(tensor_parallel_size=prefill_tp),
          dict(tensor_parallel_size=decode_tp), kv_heads=2)


@pytest.mark.parametrize("prefill, decode", [
    (dict(pipeline_parallel_size=2), {}),
    ({}, dict(pipeline_parallel_size=2)),
    (dict(tensor_parallel_size=2, pipeline_parallel_size=2), {}),
    (dict(async_scheduling=True), {}),
    (dict(tensor_parallel_size=2, async_scheduling=True), {})])
def test_kv_moves_between_instances_split_into_pipeline_stages(folder, prefill, decode):
    """Each stage holds its layers' share of a block: a split prefill side sends every
    layer (a stage's after the one before, each with all of its heads) and a split decode
    side gives each stage its layers. A prefill side planning a step ahead plans no decode
    of a prompt it computed (its blocks stay as sent), and with ranks reads their blocks
    between its worker thread's calls."""
    moved(folder, PROMPTS, prefill, decode, kv_heads=2)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_a_kv_head_replicated_on_the_ranks_moves_once(tmp_path, prefill_tp, decode_tp):
    """One KV head for two ranks: each holds it whole; a split prefill side sends it once,
    and a split decode side gives it to both of its ranks."""
    from model_fixtures import small_folder

    mqa = small_folder(tmp_path, "mqa", "llama", num_key_value_heads=1)
    prompts = [[p % 250 + 3 for p in prompt] for prompt in PROMPTS]
    moved(mqa, prompts, dict(tensor_parallel_size=prefill_tp),
          dict(tensor_parallel_size=decode_tp), kv_heads=1)


def moved(folder, prompts, prefill: dict, decode: dict, kv_heads: int) -> None:
    pair = Pair(folder, decode_kwargs=decode, **prefill)
    try:
        for i, p in enumerate(prompts):
            pair.add(f"r{i}", p)
        pair.run()
        assert [pair.tokens[f"r{i}"] for i in range(3)] == mixed_greedy(folder, prompts)
        assert len(pair.sent) == len(prompts)
        for msg in pair.sent:
            # the model's layers and KV heads, whichever side is split
            assert msg.shape[0] == 2 and msg.shape[4] == kv_heads
            assert pair.landed[msg.request_id] == msg.data == pair.source[msg.request_id]
    finally:
        pair.close()


def test_a_decode_core_without_room_holds_the_request_back_and_loses_nothing(folder):
    pair = Pair(folder, decode_blocks=6)  # room for one 64-token prompt (4 blocks + output)
    try:
        pair.add("a", PROMPTS[2])
        pair.add("b", PROMPTS[2])
        pair.pump(3)
        assert pair.d.scheduler.stats().waiting == 1  # b waits for blocks on the decode side
        assert len(pair.pl.tasks) + len(pair.sent) == 1  # and its prompt is not computed yet
        pair.run()
        assert set(pair.finished) == {"a", "b"}
        assert pair.tokens["a"] == pair.tokens["b"] == mixed_greedy(folder, [PROMPTS[2]])[0]
    finally:
        pair.close()


def test_a_dead_prefill_side_fails_the_request_and_frees_the_decode_blocks(folder):
    pair = Pair(folder)
    try:
        pair.p.step = lambda: []  # the prefill core hangs: it never answers
        pair.add("a", PROMPTS[0])
        pair.pump(3)
        assert pair.dl.prefill_of["a"][1] is not None  # the task went out
        assert pair.d.scheduler.kv.pool.num_used > 0
        pair.pl.inbox.close(linger=0)  # the prefill process is gone: its socket drops
        deadline = time.monotonic() + 10
        while "a" not in pair.finished:
            assert time.monotonic() < deadline, "the lost peer was not noticed"
            pair.pump()
        assert pair.finished["a"].finish_reason == "error"
        assert "prefill instance" in pair.finished["a"].finish_message
        assert pair.d.scheduler.kv.pool.num_used == 0 and not pair.d.has_work()
        pair.add("b", PROMPTS[1])  # sent to the lost address: fails at once, no timeout
        pair.pump(3)
        assert "is gone" in pair.finished["b"].finish_message
        assert pair.d.scheduler.kv.pool.num_used == 0 and not pair.d.has_work()
    finally:
        pair.close()


def test_a_dead_decode_side_makes_the_prefill_side_drop_its_requests(folder):
    pair = Pair(folder, max_input_tokens_per_step=16)  # 64-token prompt: four prefill steps
    try:
        pair.add("a", PROMPTS[2])
        pair.pump(2)  # the decode core sent the task; the prefill core ran a chunk
        assert "a" in pair.pl.tasks and pair.p.scheduler.kv.pool.num_used == 4
        assert not pair.sent
        pair.dl.inbox.close(linger=0)  # the decode process is gone
        deadline = time.monotonic() + 10
        while pair.pl.tasks:  # only the connections are watched: no more prefill steps
            assert time.monotonic() < deadline, "the lost peer was not noticed"
            for sock in pair.pl.sockets:
                if sock.poll(5):
                    pair.pl.handle(sock)
        assert pair.p.scheduler.kv.pool.num_used == 0 and not pair.p.has_work()
    finally:
        pair.close()


def test_kv_from_a_different_model_shape_is_refused_clearly(folder):
    core = make_core(folder, "decode")
    data, shape, dtype = core.executor.read_blocks([0, 1])
    with pytest.raises(ValueError, match="same model, dtype, block size"):
        core.executor.write_blocks([0], data, shape, dtype)
    with pytest.raises(ValueError, match="same model"):
        core.executor.write_blocks([0, 1], data, shape, "torch.bfloat16")
    core.executor.write_blocks([2, 3], data, shape, dtype)
    assert torch.equal(core.executor.worker.kv.layers[0][0][2], core.executor.worker.kv.layers[0][0][0])
