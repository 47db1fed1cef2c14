"""`tidal bench serve` takes a `vllm bench serve` command line: ramped arrivals, the
percentiles asked for, a shared random prefix, the custom dataset, what each request carries
(sampling fields, logprobs, --extra-body, headers, x-request-id), warm-ups of prompts of
their own, the server's profiler around the run, waiting for a server still starting, and
where results go (--result-dir, --append-result, --metadata, --label). Against a recording
HTTP server: what it was sent, in what order."""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from tidal.bench.arrivals import arrival_times, ramp_rates, rps_change_events
from tidal.bench.client import Target, payload, wait_ready
from tidal.bench.dataset import BenchRequest, DatasetSpec, load_dataset
from tidal.bench.flags import add_workload_flags, ramp_up, report_options, save_result
from tidal.bench.metrics import RequestResult, format_report, summarize
from tidal.cli import run as main

from model_fixtures import embedded_folder


def workload_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_workload_flags(p)
    return p.parse_args(list(argv))


# ---------------------------------------------------------------------- arrivals

def test_ramps_go_from_start_to_end_in_even_steps_or_ratios():
    assert ramp_rates("linear", 2, 10, 5).tolist() == [2, 4, 6, 8, 10]
    assert ramp_rates("exponential", 1, 16, 5).tolist() == pytest.approx([1, 2, 4, 8, 16])
    for bad in [("exponential", 0, 10), ("linear", 1, 0), ("linear", -1, 5)]:
        with pytest.raises(ValueError, match="above 0"):
            ramp_rates(*bad, 5)


def test_ramped_arrivals_come_at_each_requests_rate():
    reqs = [BenchRequest([1], 1)] * 20000
    flat = np.diff(arrival_times(reqs, None, 1.0, 1, ("linear", 10, 10)))
    assert flat.mean() == pytest.approx(0.1, rel=0.03)
    gaps = np.diff(arrival_times(reqs, None, 1.0, 1, ("linear", 1, 100)))
    first, last = gaps[1:2000].mean(), gaps[-2000:].mean()  # rates ~1-11 and ~90-100
    assert 1 / last == pytest.approx(95, rel=0.06) and first > 10 * last


def test_rps_change_events_stamp_each_whole_rate_at_its_first_send():
    from datetime import datetime

    events = rps_change_events([1.0, 1.5, 2.2, 4.9, 5.0], [0.0, 1.0, 2.0, 3.0, 4.0], 1000.0)
    at = lambda t: datetime.fromtimestamp(1000.0 + t).isoformat()  # noqa: E731
    assert events == [{"rps": 1, "timestamp": at(0)}, {"rps": 2, "timestamp": at(2)},
                      {"rps": 3, "timestamp": at(3)}, {"rps": 4, "timestamp": at(3)},
                      {"rps": 5, "timestamp": at(4)}]


def test_a_ramp_needs_both_rates_and_no_request_rate():
    assert ramp_up(workload_args()) is None
    args = workload_args("--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1",
                         "--ramp-up-end-rps", "5")
    assert ramp_up(args) == ("linear", 1.0, 5.0)
    for extra, fault in [(["--ramp-up-strategy", "linear", "--ramp-up-end-rps", "5"],
                          "needs --ramp-up-start-rps"),
                         (["--ramp-up-end-rps", "5"], "need --ramp-up-strategy"),
                         (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1",
                           "--ramp-up-end-rps", "5", "--request-rate", "3"],
                          "drop --request-rate")]:
        with pytest.raises(ValueError, match=fault):
            ramp_up(workload_args(*extra))


# ---------------------------------------------------------------------- the report

def test_the_percentiles_asked_for_are_stored_and_printed():
    runs = [RequestResult(4, 3, 0.0, t, [0.1, 0.1], t + 0.2, True) for t in
            np.linspace(0.1, 1.0, 10)]
    out = summarize(runs, 2.0, percentiles=(25, 99.9))
    assert out["p25_ttft_ms"] == pytest.approx(325.0)
    assert out["p99.9_ttft_ms"] == pytest.approx(999.1)
    assert "p99_ttft_ms" not in out
    text = format_report(out, metrics=("ttft", "e2el"), percentiles=(25, 99.9))
    assert "P99.9 TTFT (ms):" in text and "P25 E2EL (ms):" in text
    assert "TPOT" not in text and "Inter-token" not in text
    args = workload_args("--percentile-metrics", "ttft,e2el", "--metric-percentiles", "25,99.9")
    assert report_options(args) == (("ttft", "e2el"), (25.0, 99.9))
    for flags, fault in [(["--percentile-metrics", "ttft,speed"], "--percentile-metrics"),
                         (["--metric-percentiles", "0"], "--metric-percentiles"),
                         (["--metric-percentiles", "p99"], "--metric-percentiles")]:
        with pytest.raises(ValueError, match=fault):
            report_options(workload_args(*flags))


# ---------------------------------------------------------------------- datasets

def test_a_random_prefix_leads_every_prompt():
    reqs = load_dataset(DatasetSpec(num_prompts=20, input_len=30, output_len=4,
                                    random_prefix_len=50, seed=2))
    prefix = reqs[0].prompt_ids[:50]
    assert all(r.prompt_ids[:50] == prefix and r.prompt_len == 80 for r in reqs)
    assert len({tuple(r.prompt_ids[50:52]) for r in reqs}) == 20  # then each its own


def test_custom_prompts_come_as_written_or_in_the_chat_template(tmp_path):
    from tidal.model.tokenizer import Tokenizer

    tok = Tokenizer(embedded_folder())
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "Name three rivers."}) + "\n\n" +
                    json.dumps({"prompt": "Why is the sky blue?", "output_tokens": 9}) + "\n" +
                    json.dumps({"prompt": "unread"}) + "\n")
    spec = DatasetSpec(name="custom", path=str(path), num_prompts=2, output_len=33)
    plain = load_dataset(spec, tok)
    assert [r.text for r in plain] == ["Name three rivers.", "Why is the sky blue?"]
    assert [r.output_len for r in plain] == [33, 9]
    assert plain[0].prompt_ids == tok.encode("Name three rivers.", add_special_tokens=False)
    spec.chat_template = True
    templated = load_dataset(spec, tok)[0].text
    assert templated == tok.apply_chat_template([{"role": "user",
                                                  "content": "Name three rivers."}])
    for bad in ('{"text": "no prompt here"}', '["a list"]', '{"prompt": "a", '):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match="line 1"):
            load_dataset(spec, tok)
    with pytest.raises(ValueError, match="--dataset-path"):
        load_dataset(DatasetSpec(name="custom"), tok)


def test_prefix_repetition_is_shared_prefix_by_vllms_flags_in_a_shuffled_order():
    from tidal.bench.flags import dataset_spec

    args = workload_args("--dataset-name", "prefix_repetition", "--num-prompts", "12",
                         "--prefix-repetition-prefix-len", "40",
                         "--prefix-repetition-suffix-len", "24",
                         "--prefix-repetition-num-prefixes", "3",
                         "--prefix-repetition-output-len", "9")
    spec = dataset_spec(args, 49152)
    reqs = load_dataset(spec)
    assert all(r.prompt_len == 64 and r.output_len == 9 for r in reqs)
    prefixes = [tuple(r.prompt_ids[:40]) for r in reqs]
    assert sorted(map(prefixes.count, set(prefixes))) == [4, 4, 4]  # 3 prefixes, 4 each
    assert len({tuple(r.prompt_ids[40:]) for r in reqs}) == 12  # each suffix its own
    spec.name = "shared-prefix"
    cycled = [tuple(r.prompt_ids[:40]) for r in load_dataset(spec)]
    assert cycled[:3] == cycled[3:6] and prefixes != cycled  # the same groups, shuffled
    assert sorted(prefixes) == sorted(cycled)


def test_burstgpt_replays_the_gpt4_rows_that_got_a_response(tmp_path):
    path = tmp_path / "BurstGPT.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "5,ChatGPT,100,20,120,Conversation log\n"
                    "7,GPT-4,300,40,340,Conversation log\n"
                    "8,GPT-4,50,0,50,Conversation log\n"  # failed: no response
                    "9.5,GPT-4,30,15,45,API log\n"
                    "12,GPT-4,80,8,88,Conversation log\n")
    spec = DatasetSpec(name="burstgpt", path=str(path), num_prompts=2, max_model_len=4096)
    reqs = load_dataset(spec)
    assert [(r.prompt_len, r.output_len, r.arrival) for r in reqs] == [(300, 40, 7.0),
                                                                      (30, 15, 9.5)]
    assert arrival_times(reqs, None) == [0.0, 2.5]  # the trace's own gaps
    spec.num_prompts, spec.max_model_len = 10, 2048
    assert len(load_dataset(spec)) == 3 and spec.length_scale == 1.0
    path.write_text("Timestamp,Model,Request tokens\n1,GPT-4,10\n")
    with pytest.raises(ValueError, match="line 2"):
        load_dataset(spec)
    path.write_text("Timestamp,Model,Request tokens,Response tokens\n1,ChatGPT,10,5\n")
    with pytest.raises(ValueError, match="no GPT-4 row"):
        load_dataset(spec)
    with pytest.raises(ValueError, match="--dataset-path"):
        load_dataset(DatasetSpec(name="burstgpt"))


def leading_lines_in_common(bodies: list[str], lines: list[str]) -> int:
    """How many of the poem's first lines every body starts with."""
    split = [b.splitlines() for b in bodies]
    return next(k for k in range(len(lines) + 1)
                if any(b[:k + 1] != lines[:k + 1] for b in split))


def test_sonnet_prompts_pick_poem_lines_after_a_shared_first_few(tmp_path):
    from tidal.bench.dataset import SONNET_PROMPT
    from tidal.bench.flags import dataset_spec
    from tidal.model.tokenizer import Tokenizer

    tok = Tokenizer(embedded_folder())
    lines = [f"Line {i} of a poem where the {w} sings softly" for i, w in
             enumerate(["lark", "sea", "wind", "rose", "moon", "fire", "stone", "rain"] * 5)]
    path = tmp_path / "sonnet.txt"
    path.write_text("\n".join(lines) + "\n")
    args = workload_args("--dataset-name", "sonnet", "--dataset-path", str(path),
                         "--num-prompts", "6", "--sonnet-input-len", "160",
                         "--sonnet-prefix-len", "70", "--sonnet-output-len", "12")
    args.endpoint = "/v1/completions"
    spec = dataset_spec(args, tok.vocab_size)
    reqs = load_dataset(spec, tok)
    assert len(reqs) == 6 and all(r.output_len == 12 for r in reqs)
    assert all(80 < r.prompt_len <= 160 for r in reqs)
    assert all(r.prompt_ids == tok.encode(r.text, add_special_tokens=False) for r in reqs)
    bodies = [r.text.split(SONNET_PROMPT)[1] for r in reqs]
    assert reqs[0].text.startswith(tok.apply_chat_template(
        [{"role": "user", "content": SONNET_PROMPT + "x"}]).split(SONNET_PROMPT)[0])
    assert len(set(bodies)) == 6
    shared = leading_lines_in_common(bodies, lines)  # the first lines, in every prompt
    args.sonnet_prefix_len = 130  # 60 tokens more: about 5 lines of 12 tokens more
    longer = [r.text.split(SONNET_PROMPT)[1]
              for r in load_dataset(dataset_spec(args, tok.vocab_size), tok)]
    assert shared >= 1 and leading_lines_in_common(longer, lines) >= shared + 4
    args.endpoint = "/v1/chat/completions"  # the server lays out the chat itself
    assert load_dataset(dataset_spec(args, tok.vocab_size), tok)[0].text.startswith(
        SONNET_PROMPT + lines[0])
    args.sonnet_input_len = 5
    with pytest.raises(ValueError, match="input length"):
        load_dataset(dataset_spec(args, tok.vocab_size), tok)


# ---------------------------------------------------------------------- what is sent

def test_each_request_carries_the_sampling_fields_logprobs_and_extra_body():
    t = Target(endpoint="/v1/chat/completions", model="m",
               sampling={"top_k": 5, "min_p": 0.1}, logprobs=2,
               extra_body={"temperature": 0.5, "seed": 7})
    body = payload(t, "hi", 4)
    assert (body["top_k"], body["min_p"], body["logprobs"], body["top_logprobs"]) == (
        5, 0.1, True, 2)
    assert (body["temperature"], body["seed"]) == (0.5, 7)  # --extra-body goes last
    t.endpoint = "/v1/completions"
    assert payload(t, "hi", 4)["logprobs"] == 2 and "top_logprobs" not in payload(t, "hi", 4)
    t = Target(api_key="k", extra_headers={"x-team": "a"}, request_id_prefix="run-")
    assert t.headers(3) == {"x-team": "a", "Authorization": "Bearer k",
                            "x-request-id": "run-3"}
    assert "x-request-id" not in t.headers()


def test_results_go_to_their_folder_and_file_appended_with_metadata(tmp_path):
    from tidal.bench.flags import result_header

    args = workload_args("--result-dir", str(tmp_path / "out"), "--result-filename", "r.json",
                         "--append-result", "--metadata", "gpu=none", "run = 2",
                         "--label", "mine")
    for i in range(2):
        result = {**result_header(args, "openai", "m"), "i": i}
        path = save_result(args, result, "bench")
    assert path == tmp_path / "out" / "r.json"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["i"] for r in lines] == [0, 1]
    assert (lines[0]["gpu"], lines[0]["run"], lines[0]["label"]) == ("none", "2", "mine")
    named = workload_args("--save-result", "--result-dir", str(tmp_path), "--label", "x")
    path = save_result(named, result_header(named, "openai", "m"), "bench")
    assert path.parent == tmp_path and path.name.startswith("x-random-")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        result_header(workload_args("--metadata", "novalue"), "openai", "m")


# ---------------------------------------------------------------------- against a server

class Recorder(BaseHTTPRequestHandler):
    """An OpenAI-style server that streams three tokens and records what it was sent."""

    calls: list = []  # (path, headers, body), in order of arrival
    up_at = 0.0  # before this time.monotonic(), every request is a 503

    def log_message(self, *args) -> None:
        pass

    def _answer(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if time.monotonic() < self.up_at:
            return self._answer(503, b"{}")
        self._answer(200, json.dumps({"data": [{"id": "fake-model"}]}).encode())

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", 0))
        body = json.loads(self.rfile.read(length) or b"{}")
        self.calls.append((self.path, dict(self.headers), body))
        if self.path in ("/start_profile", "/stop_profile"):
            return self._answer(200, b"{}")
        if self.path == "/v1/embeddings":
            return self._answer(200, json.dumps({"data": [{"embedding": [0.6, 0.8]}],
                                                 "usage": {"prompt_tokens": 7}}).encode())
        chunks = [{"choices": [{"text": "ab"[i % 2], "delta": {"content": "ab"[i % 2]}}]}
                  for i in range(3)]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self._answer(200, sse.encode(), "text/event-stream")


@pytest.fixture()
def recorder():
    Recorder.calls, Recorder.up_at = [], 0.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_vllm_command_line_sends_what_it_names(recorder, tmp_path):
    """Warm-ups first (prompts none of the run's), then /start_profile, the run's requests
    with their fields, headers and ids, /stop_profile; the result keeps the percentiles
    asked for and the metadata."""
    Recorder.up_at = time.monotonic() + 1.5  # still starting: the bench waits
    result = main([
        "bench", "serve", "--base-url", recorder, "--endpoint", "/v1/chat/completions",
        "--dataset-name", "random", "--num-prompts", "5", "--random-input-len", "12",
        "--random-output-len", "3", "--num-warmups", "2", "--profile", "--top-p", "0.9",
        "--min-p", "0.05", "--use-beam-search", "--logprobs", "1",
        "--extra-body", '{"priority": 3}', "--header", "x-team=blue",
        "--request-id-prefix", "run-", "--served-model-name", "served",
        "--trust-remote-code", "--tokenizer-mode", "auto", "--ramp-up-strategy", "linear",
        "--ramp-up-start-rps", "20", "--ramp-up-end-rps", "50", "--percentile-metrics",
        "ttft", "--metric-percentiles", "95", "--metadata", "host=ci", "--save-detailed",
        "--ready-check-timeout-sec", "30", "--disable-tqdm", "--save-result",
        "--result-dir", str(tmp_path), "--result-filename", "r.json"])
    paths = [path for path, _, _ in Recorder.calls]
    assert paths == ["/v1/chat/completions"] * 2 + ["/start_profile"] + \
        ["/v1/chat/completions"] * 5 + ["/stop_profile"]
    warm, run = Recorder.calls[:2], Recorder.calls[3:8]
    prompts = lambda calls: {c[2]["messages"][0]["content"] for c in calls}  # noqa: E731
    assert not prompts(warm) & prompts(run) and len(prompts(run)) == 5
    assert sorted(h["x-request-id"] for _, h, _ in run) == [f"run-{i}" for i in range(5)]
    assert all(h["x-request-id"].startswith("run-warmup-") for _, h, _ in warm)
    for _, headers, body in run:
        assert headers["x-team"] == "blue" and body["model"] == "served"
        assert (body["top_p"], body["min_p"], body["use_beam_search"], body["priority"]) == (
            0.9, 0.05, True, 3)
        assert (body["logprobs"], body["top_logprobs"], body["max_tokens"]) == (True, 1, 3)
    assert result["completed"] == 5 and result["total_output_tokens"] == 15
    saved = json.loads((tmp_path / "r.json").read_text())
    assert "p95_ttft_ms" in saved and "p99_ttft_ms" not in saved
    assert (saved["host"], saved["ramp_up_strategy"], saved["request_rate"]) == (
        "ci", "linear", "ramp-up")
    assert [e["rps"] for e in saved["rps_change_events"]] == list(range(20, 51))


def test_an_embeddings_endpoint_is_timed_by_its_whole_answers(recorder, capsys):
    """Each input in its own body (with --extra-body), no sampling fields; TTFT is the
    latency, the prompt's tokens the server's count, and the report is of latency alone."""
    result = main(["bench", "serve", "--base-url", recorder, "--endpoint", "/v1/embeddings",
                   "--num-prompts", "4", "--random-input-len", "10", "--disable-tqdm",
                   "--extra-body", '{"dimensions": 2}', "--temperature", "0.5"])
    bodies = [body for _, _, body in Recorder.calls]
    assert len(bodies) == 4 and all(set(b) == {"model", "input", "dimensions"} for b in bodies)
    assert (result["completed"], result["total_input_tokens"]) == (4, 28)
    assert result["total_output_tokens"] == 0
    assert result["mean_ttft_ms"] == result["mean_e2el_ms"] > 0
    report = capsys.readouterr().out
    assert "End-to-end Latency" in report and "Request throughput" in report
    assert "Time to First Token" not in report and "Output token" not in report


def test_the_ready_check_gives_up_saying_why(recorder):
    Recorder.up_at = time.monotonic() + 60
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match="did not answer within 1.5 s.*HTTP 503"):
        wait_ready(Target(base_url=recorder), 1.5)
    assert time.monotonic() - t0 < 10
    Recorder.up_at = 0.0
    assert wait_ready(Target(base_url=recorder), 1.0) == "fake-model"
