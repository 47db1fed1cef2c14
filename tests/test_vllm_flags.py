"""vLLM's command line starts tidal as it is (tidal/engine/vllm_flags.py): flags of another
name (--max-num-batched-tokens, --scheduling-policy), switches that ask for what tidal does
anyway, `--no-` for every switch, --speculative-config as JSON, --config YAML whose flags
the command line overrides; bad values end the command naming them; and a served check
that the engine runs with what the vLLM words said."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from server_fixtures import Server
from tidal.cli import build_parser
from tidal.engine.config import EngineConfig
from tidal.engine.flags import config_from_args, engine_kwargs
from tidal.engine.vllm_flags import apply_vllm_flags, expand_config_file, model_word
from tidal.model.registry import resolve_model
from tidal.server.config import ServerConfig

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})


def configs(*argv: str) -> tuple[EngineConfig, ServerConfig]:
    args = build_parser().parse_args(expand_config_file(model_word(["serve", *argv])))
    apply_vllm_flags(args)
    return EngineConfig.from_kwargs(**engine_kwargs(args)), config_from_args(ServerConfig, args)


def test_vllm_words_set_tidals_options():
    engine, server = configs("--max-num-batched-tokens", "4096", "--scheduling-policy",
                             "priority", "--trust-remote-code", "--enable-auto-tool-choice",
                             "--enable-chunked-prefill", "--disable-log-requests",
                             "--enable-prompt-tokens-details", "--no-enable-prefix-caching",
                             "--enable-server-load-tracking",
                             "--speculative-config", SPEC, "--served-model-name", "a", "b",
                             "--disable-log-stats", "--logprobs-mode", "processed_logprobs",
                             "--swap-space", "16")
    assert engine.scheduler.max_input_tokens_per_step == 4096
    assert engine.model.logprobs_mode == "processed_logprobs"
    assert engine.scheduler.policy == "priority"
    assert engine.cache.enable_prefix_caching is False
    assert engine.speculative.speculative_method == "ngram"
    assert engine.scheduler.num_speculative_tokens == 3
    assert engine.speculative.prompt_lookup_max == 5
    assert server.served_model_name == ("a", "b")
    assert engine.model.log_stats_interval == 0
    default, _ = configs()
    assert default.model.log_stats_interval == 1.0
    assert default.cache.enable_prefix_caching is True
    assert default.speculative.speculative_method is None
    assert default.model.logprobs_mode == "adjusted_logprobs"
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        configs("--logprobs-mode", "logits")
    draft, _ = configs("--speculative-config", '{"model": "smollm2-135m", '
                                               '"num_speculative_tokens": 2}')
    assert (draft.speculative.speculative_method, draft.speculative.speculative_model) == \
        ("draft", "smollm2-135m")


def test_vllms_short_flags_and_value_words_mean_tidals():
    engine, server = configs("-tp", "1", "-dp", "2", "-pp", "1",
                             "--num-gpu-blocks-override", "99",
                             "--kv-cache-memory-bytes", "123456789", "--dtype", "half",
                             "--kv-cache-dtype", "fp8", "--enable-sleep-mode",
                             "--enable-request-id-headers", "--max-logprobs", "-1",
                             "--distributed-timeout-seconds", "7", "-dpb", "mp",
                             "--long-prefill-token-threshold", "256",
                             "--kv-offloading-size", "1.5", "--shutdown-timeout", "0")
    assert (engine.parallel.tensor_parallel_size, engine.parallel.data_parallel_size,
            engine.parallel.pipeline_parallel_size) == (1, 2, 1)
    assert (engine.parallel.distributed_timeout, engine.parallel.dp_backend) == (7, "local")
    assert engine.scheduler.chunked_prefill_size == 256
    assert (engine.model.kv_host_memory, server.drain_timeout) == (1.5, 0)
    assert configs("--data-parallel-backend", "ray")[0].parallel.dp_backend == "ray"
    assert (engine.model.num_kv_blocks, engine.model.kv_cache_memory) == (99, 123456789)
    assert (engine.model.dtype, engine.model.kv_cache_dtype) == ("float16", "fp8_e4m3")
    assert configs("--dtype", "float")[0].model.dtype == "float32"
    assert server.max_logprobs == -1
    with pytest.raises(ValueError, match="max_logprobs"):
        configs("--max-logprobs", "-2")
    with pytest.raises(ValueError, match="dtype"):  # a word neither spells is still refused
        configs("--dtype", "double")


def test_sglangs_launch_server_words_mean_tidals(tmp_path):
    engine, server = configs(
        "--model-path", "some/model", "--tp", "1", "--dp-size", "2", "--pp-size", "1",
        "--context-length", "1024", "--max-running-requests", "8",
        "--max-prefill-tokens", "512", "--page-size", "32", "--random-seed", "3",
        "--mem-fraction-static", "0.8", "--schedule-policy", "lpm",
        "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "3",
        "--disable-radix-cache", "--disable-cuda-graph", "--log-requests",
        "--max-loras-per-batch", "2", "--enable-metrics", "--enable-cache-report",
        "--skip-server-warmup", "--is-embedding", "--enable-mixed-chunk",
        "--tool-call-parser", "qwen25", "--reasoning-parser", "deepseek-r1",
        "--log-level", "error", "--log-level-http", "warning", "--tokenizer-path", "tok")
    assert (engine.model.model, engine.model.tokenizer) == ("some/model", "tok")
    assert (engine.model.log_level, server.uvicorn_log_level) == ("error", "warning")
    assert (engine.parallel.tensor_parallel_size, engine.parallel.data_parallel_size) == (1, 2)
    s = engine.scheduler
    assert (s.max_model_len, s.max_num_seqs, s.max_input_tokens_per_step, s.policy) == (
        1024, 8, 512, "longest_prefix_match")
    assert (engine.cache.block_size, engine.cache.enable_prefix_caching) == (32, False)
    assert (engine.model.seed, engine.model.gpu_memory_utilization,
            engine.model.enforce_eager) == (3, 0.8, True)
    assert (engine.speculative.speculative_method,
            engine.scheduler.num_speculative_tokens) == ("ngram", 3)
    assert engine.scheduler.max_loras == 2
    assert server.enable_log_requests and server.task == "embed"
    assert (server.tool_call_parser, server.reasoning_parser) == ("hermes", "deepseek_r1")
    config = tmp_path / "sglang.yaml"  # SGLang's --config: its keys, a switch off is nothing
    config.write_text("context-length: 2048\ndisable-radix-cache: false\n"
                      "enable-metrics: false\ntp-size: 1\n")
    engine, _ = configs("--config", str(config))
    assert engine.scheduler.max_model_len == 2048 and engine.cache.enable_prefix_caching


@pytest.mark.parametrize("words", [["--structured-outputs-config", '{"backend": "guidance"}'],
                                   ["--guided-decoding-backend", "auto"],
                                   ["--grammar-backend", "llguidance"],
                                   ["--structured-outputs-config", "{}"]])
def test_the_structured_outputs_backend_tidal_runs_is_accepted(words):
    configs(*words)


@pytest.mark.parametrize("words, why", [
    (["--guided-decoding-backend", "xgrammar"], "llguidance"),
    (["--grammar-backend", "outlines"], "llguidance"),
    (["--structured-outputs-config", '{"backend": "outlines"}'], "llguidance"),
    (["--structured-outputs-config", '{"disable_any_whitespace": true}'],
     "disable_any_whitespace"),
    (["--structured-outputs-config", "{oops"], "not JSON")])
def test_another_structured_outputs_backend_is_refused_by_name(words, why):
    with pytest.raises(ValueError, match=why):
        configs(*words)


def test_middleware_that_does_not_import_is_named():
    with pytest.raises(ValueError, match="nowhere.at_all"):
        configs("--middleware", "nowhere.at_all")[1].middleware_objects()
    with pytest.raises(ValueError, match="blank"):
        configs("--response-role", " ")


def test_a_tokenizer_that_is_no_local_folder_ends_the_command_by_name():
    """vLLM's --tokenizer takes a hub's name too; tidal downloads nothing."""
    done = subprocess.run([sys.executable, "-m", "tidal.cli", "serve", "--tokenizer",
                           "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "--port", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert ("tidal serve: error: tokenizer 'TinyLlama/TinyLlama-1.1B-Chat-v1.0' is not a "
            "folder with a tokenizer.json") in done.stderr


@pytest.mark.parametrize("kwargs, words", [("{not json", "not JSON"), ("[1]", "JSON object"),
                                           ('{"tools": []}', "'tools'")])
def test_bad_default_chat_template_kwargs_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        configs("--default-chat-template-kwargs", kwargs)


@pytest.mark.parametrize("spec, words", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
    ('{"method": "ngram", "draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size"),
    ("ngram", "not JSON"),
    ("[1]", "JSON object"),
])
def test_a_bad_speculative_config_is_refused_by_name(spec, words):
    with pytest.raises(ValueError, match=words):
        configs("--speculative-config", spec)


def test_a_speculative_option_given_twice_is_refused():
    with pytest.raises(ValueError, match="give it once"):
        configs("--speculative-config", SPEC, "--num-speculative-tokens", "2")


def test_the_model_may_come_first_as_in_vllm_serve():
    engine, _ = configs("smollm2-135m", "--max-num-seqs", "8")
    assert engine.model.model == "smollm2-135m" and engine.scheduler.max_num_seqs == 8
    with pytest.raises(SystemExit, match="give it once"):
        configs("smollm2-135m", "--model", "other")


def test_a_config_file_gives_flags_the_command_line_overrides(tmp_path):
    path = tmp_path / "vllm.yaml"
    path.write_text("max_num_batched_tokens: 2048\nenable_prefix_caching: false\n"
                    "trust_remote_code: true\nenable_auto_tool_choice: false\n"
                    "served-model-name: [first, second]\nport: 9000\n"
                    "speculative_config: {method: ngram, num_speculative_tokens: 2}\n")
    engine, server = configs("--config", str(path), "--port", "9001")
    assert engine.scheduler.max_input_tokens_per_step == 2048
    assert engine.cache.enable_prefix_caching is False
    assert engine.scheduler.num_speculative_tokens == 2
    assert server.served_model_name == ("first", "second") and server.port == 9001
    _, server = configs(f"--config={path}")
    assert server.port == 9000
    path.write_text("- not a mapping\n")
    with pytest.raises(SystemExit, match="a mapping of flags"):
        configs("--config", str(path))
    with pytest.raises(SystemExit, match="No such file"):
        configs("--config", str(tmp_path / "missing.yaml"))


MIDDLEWARE = """
from starlette.responses import PlainTextResponse


async def stamp(request, call_next):
    response = await call_next(request)
    response.headers["x-stamped"] = "yes"
    return response


class Teapot:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/teapot":
            return await PlainTextResponse("short and stout", 418)(scope, receive, send)
        await self.app(scope, receive, send)
"""


def test_a_server_started_with_vllms_words_runs_with_them(tmp_path, monkeypatch):
    (tmp_path / "my_middleware.py").write_text(MIDDLEWARE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(tmp_path), os.environ.get("PYTHONPATH")])))
    # --tokenizer: another folder's tokenizer, whose template reads a variable of its own
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    own = resolve_model("smollm2-135m")[0]
    (tokenizer / "tokenizer.json").write_bytes((own / "tokenizer.json").read_bytes())
    settings = json.loads((own / "tokenizer_config.json").read_text())
    # it reads text parts too, so 'auto' would hand it lists: --chat-template-content-format
    # string keeps text
    settings["chat_template"] = ("{% for m in messages %}{{ greeting | default('none') }}: "
                                 "{% if m.content is string %}{{ m.content }}{% else %}"
                                 "{% for p in m.content %}<{{ p.text }}>{% endfor %}{% endif %}"
                                 "{{ '\\n' }}{% endfor %}"
                                 "{% if add_generation_prompt %}>{% endif %}")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(settings))
    server = Server("--max-num-batched-tokens", "2048", "--enable-auto-tool-choice",
                    "--trust-remote-code", "--no-enable-prefix-caching",
                    "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                    "--tokenizer", str(tokenizer),
                    "--default-chat-template-kwargs", '{"greeting": "hello"}',
                    "--chat-template-content-format", "string",
                    "--return-tokens-as-token-ids", "--enable-force-include-usage",
                    "--disable-fastapi-docs", "--max-logprobs", "25", "--response-role", "bot",
                    "--middleware", "my_middleware.stamp", "my_middleware.Teapot")
    try:
        info = httpx.get(server.url + "/get_server_info").json()["engine"]
        assert info["scheduler"]["max_input_tokens_per_step"] == 2048
        assert info["cache"]["enable_prefix_caching"] is False
        assert info["speculative"]["speculative_method"] == "ngram"
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": "1, 2, 3, 4, 1, 2, 3, 4,", "max_tokens": 8,
                             "logprobs": 1})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 8 and all(t.startswith("token_id:") for t in tokens)
        many = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "logprobs": True, "top_logprobs": 25}).json()  # past 20: --max-logprobs 25
        assert len(many["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25
        for path, body, param in (
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                          "logprobs": True, "top_logprobs": 26}, "top_logprobs"),
                ("/v1/completions", {"prompt": "hi", "logprobs": 26}, "logprobs"),
                ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 26}, "prompt_logprobs")):
            r = httpx.post(server.url + path, json={**body, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == param
            assert "at most 25" in r.json()["error"]["message"]

        def rendered(content="hi", **kwargs) -> str:
            ids = httpx.post(server.url + "/tokenize", json={
                "messages": [{"role": "user", "content": content}], **kwargs}).json()["tokens"]
            return httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
        assert rendered() == "hello: hi\n>"
        assert rendered(chat_template_kwargs={"greeting": "yo"}) == "yo: hi\n>"
        parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        assert rendered(parts) == "hello: a\nb\n>"  # as text, not as <a><b>
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "stream": True}) as stream:
            chunks = [line[6:] for line in stream.iter_lines() if line.startswith("data: {")]
        assert json.loads(chunks[-1])["usage"]["completion_tokens"] == 3  # never asked for
        assert all(json.loads(c)["usage"] is None for c in chunks[:-1])
        for page in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(server.url + page).status_code == 404
        assert httpx.get(server.url + "/health").headers["x-stamped"] == "yes"
        teapot = httpx.get(server.url + "/teapot")
        assert teapot.status_code == 418 and teapot.text == "short and stout"
        assert [json.loads(c)["choices"][0]["delta"].get("role") for c in chunks[:1]] == ["bot"]
        chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).json()
        assert chat["choices"][0]["message"]["role"] == "bot"
        continued = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "Hello"}], "max_tokens": 2,
            "add_generation_prompt": False, "continue_final_message": True}).json()
        assert continued["choices"][0]["message"]["role"] == "assistant"  # the message's own
    finally:
        server.stop()


def test_the_status_line_keeps_its_interval_and_zero_silences_it(caplog):
    """--log-stats-interval (vLLM's --disable-log-stats: 0): an engine core's status line."""
    from types import SimpleNamespace

    from tidal.core.invariants import SchedulerStats
    from tidal.runtime.core_process import StatusLine

    from dataclasses import MISSING, fields

    zeros = SchedulerStats(**{f.name: 0 for f in fields(SchedulerStats)
                              if f.default is MISSING and f.default_factory is MISSING})
    core = SimpleNamespace(prompt_tokens=0, generation_tokens=0,
                           scheduler=SimpleNamespace(stats=lambda: zeros))
    caplog.set_level("INFO", logger="tidal.core")
    quiet, chatty = StatusLine(core, 0.0), StatusLine(core, 1e-9)
    quiet.last = chatty.last = 0.0  # as if long ago
    quiet.maybe_log()
    assert not caplog.records
    chatty.maybe_log()
    assert len(caplog.records) == 1 and "running-decode" in caplog.records[0].getMessage()


def test_the_command_reads_the_model_word_and_the_config_file(tmp_path, monkeypatch):
    """`tidal serve MODEL --config FILE ...` as the console script runs it: the words
    reach the command as flags (and so a --pd instance's command line)."""
    from tidal import cli

    seen = {}
    monkeypatch.setattr(cli, "cmd_serve", lambda args: seen.update(vars(args)))
    path = tmp_path / "vllm.yaml"
    path.write_text("max_num_batched_tokens: 1024\nmax_num_seqs: 8\n")
    cli.run(["serve", "smollm2-135m", "--config", str(path), "--max-num-seqs", "4"])
    assert seen["model"] == "smollm2-135m" and seen["max_input_tokens_per_step"] == 1024
    assert seen["max_num_seqs"] == 4  # the command line over the file
    argv = seen["argv"]
    assert argv[argv.index("--model") + 1] == "smollm2-135m"
    assert "--config" not in argv and "--max-num-batched-tokens" in argv
