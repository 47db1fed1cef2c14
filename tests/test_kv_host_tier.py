"""The host-memory tier below the pool (`--kv-host-memory`): least recently used blocks
leave it first; alone it serves evicted prefixes until a restart; above the disk tier it
keeps what the disk serves for the next hit, and the disk keeps everything across restarts."""

from __future__ import annotations

import pytest
import torch

from test_kv_tiers import GREEDY, OTHERS, answer, tiers, tiny_model
from tidal.engine.kv_disk import HEADER, DiskKVTier
from tidal.engine.kv_host import HostKVTier


@pytest.fixture()
def folder(tmp_path, monkeypatch):
    return tiny_model(tmp_path, monkeypatch)


def loaded(tier, key: bytes, size: int = 8) -> bytes | None:
    """What `load_into` reads of the block, or None for one it does not hold."""
    out = torch.empty(size, dtype=torch.uint8)
    return out.numpy().tobytes() if tier.load_into(key, out) else None


def key(i: int) -> bytes:
    return bytes([i]) * 16


def test_host_memory_keeps_the_recently_used_and_the_disk_keeps_them_all(tmp_path):
    disk = DiskKVTier(tmp_path / "kv", 8, 10 * (8 + HEADER))
    host = HostKVTier(8, 16, pinned=False, below=disk)  # room for two blocks of 8 bytes
    assert host.capacity == 10  # the scheduler's index: what the disk holds
    for i in range(3):
        host.store(key(i), bytes([i]) * 8)
    assert host.held == 2 and list(host._slots) == [key(1), key(2)]
    assert loaded(host, key(0)) == bytes([0]) * 8  # from the disk, held again
    assert list(host._slots) == [key(2), key(0)]  # key 1, least recently used, left
    assert loaded(host, key(1)) == bytes([1]) * 8
    host.close()
    assert sorted(disk.keys()) == [key(0), key(1), key(2)]
    alone = HostKVTier(8, 16, pinned=False)
    alone.store(key(5), b"short")  # not a whole block: never kept
    assert loaded(alone, key(5)) is None and alone.capacity == 2


def llm_with(folder, **tiers_kwargs):
    from tidal.engine.llm import LLM

    return LLM(str(folder), num_kv_blocks=12, num_threads=1, **tiers_kwargs)


def host_gib(folder, blocks: int) -> float:
    probe = llm_with(folder)
    block = probe.engine.core.executor.worker.kv.block_nbytes
    probe.close()
    return blocks * block / 2**30


def test_host_memory_alone_serves_evicted_prefixes_until_a_restart(folder):
    gib = host_gib(folder, 64)
    plain = llm_with(folder)
    want = answer(plain)
    plain.close()
    llm = llm_with(folder, kv_host_memory=gib)
    assert answer(llm) == want and tiers(llm).hit_blocks == 0
    llm.generate(OTHERS, GREEDY, use_tqdm=False)  # evicts the prompt's blocks from the pool
    tokens, logprobs = answer(llm)
    assert tiers(llm).hit_blocks == 4 and tokens == want[0]
    assert logprobs == pytest.approx(want[1], abs=1e-5)
    llm.close()
    again = llm_with(folder, kv_host_memory=gib)  # host memory does not outlive its process
    assert answer(again)[0] == want[0] and tiers(again).hit_blocks == 0
    again.close()


def test_above_the_disk_host_memory_keeps_what_the_disk_served(folder, tmp_path):
    kw = dict(kv_host_memory=host_gib(folder, 64), kv_cache_dir=str(tmp_path / "kv"))
    llm = llm_with(folder, **kw)
    want = answer(llm)
    llm.close()
    again = llm_with(folder, **kw)  # a restart: the disk serves the prefix
    assert answer(again) == want and tiers(again).hit_blocks == 4
    host = again.engine.core.executor.worker.tier
    assert host.held == 4  # what the disk served, kept in memory
    assert tiers(again).memory_hit_blocks == 0  # the report: the disk served them
    again.generate(OTHERS, GREEDY, use_tqdm=False)
    assert answer(again)[0] == want[0] and tiers(again).hit_blocks == 8
    # the worker's report before each plan: memory served the second hit, and holds all
    assert tiers(again).memory_hit_blocks == 4 and tiers(again).memory_blocks == host.held
    again.close()


def test_the_flag_is_checked(folder):
    from tidal.engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv_host_memory must be >= 0"):
        llm_with(folder, kv_host_memory=-1)
    with pytest.raises(ValueError, match="--kv-host-memory: the tiers below the pool store "
                       "the model's KV, not a draft"):
        EngineConfig.from_kwargs(model=str(folder), kv_host_memory=1.0, num_speculative_tokens=2,
                                 speculative_method="draft", speculative_model=str(folder))


@pytest.mark.parametrize("disk", [False, True], ids=["alone", "above-disk"])
def test_a_server_names_host_memory_metrics_alone_and_above_the_disk(tmp_path, disk):
    import time

    import httpx

    from server_fixtures import Server, metric, openai_client

    server = Server("--kv-host-memory", "0.05",
                    *(("--kv-cache-dir", str(tmp_path / "kv")) if disk else ()))
    try:
        openai_client(server).completions.create(
            model="smollm2-135m", prompt=" ".join(f"word{i}" for i in range(60)),
            max_tokens=4, temperature=0.0)
        time.sleep(1.5)  # an idle step stores the published blocks; stats twice a second
        text = httpx.get(server.url + "/metrics").text
        assert "tidal:kv_host_blocks" in text
        assert ("tidal:kv_disk_blocks" in text) == disk
        stored = "disk" if disk else "host"  # with the disk, every block is stored there
        assert metric(server.url, f"tidal:kv_{stored}_stored_blocks_total") > 0
        if disk:  # memory above the disk holds what was stored, as the disk does
            held = metric(server.url, "tidal:kv_host_blocks")
            assert held == metric(server.url, "tidal:kv_disk_blocks") > 0
            assert metric(server.url, "tidal:kv_host_loaded_blocks_total") == 0
    finally:
        server.stop()


def test_a_disk_block_with_a_flipped_byte_is_refused_and_deleted(tmp_path):
    """Same length, one payload byte changed: the checksum finds it; the block reads as
    missing, its file is gone and the failure counted, and an intact block still reads."""
    disk = DiskKVTier(tmp_path, 64, 1 << 20)
    for i in (1, 2):
        disk.store(key(i), bytes([i]) * 64)
    disk.close()  # written out
    path = tmp_path / f"{key(1).hex()}.kv"
    raw = bytearray(path.read_bytes())
    raw[HEADER + 10] ^= 1
    path.write_bytes(raw)
    disk = DiskKVTier(tmp_path, 64, 1 << 20)
    assert loaded(disk, key(1), 64) is None and not path.exists() and disk.load_failures == 1
    assert loaded(disk, key(2), 64) == bytes([2]) * 64
    disk.close()
