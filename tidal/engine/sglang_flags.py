"""SGLang's `launch_server` words for tidal's options, so that an SGLang command line (or its
`--config` YAML file) starts `tidal serve` too: flags of another name for the same option,
switches that set one, and switches that ask for what tidal does anyway (read beside vLLM's,
vllm_flags.py). An SGLang flag with no meaning here stays an error."""

from __future__ import annotations

# SGLang's flag -> (tidal's option of the same meaning, its type)
ALIASES = {
    "--model-path": ("model", str), "--tokenizer-path": ("tokenizer", str),
    "--tp": ("tensor_parallel_size", int), "--tp-size": ("tensor_parallel_size", int),
    "--dp": ("data_parallel_size", int), "--dp-size": ("data_parallel_size", int),
    "--pp-size": ("pipeline_parallel_size", int),
    "--context-length": ("max_model_len", int),
    "--max-running-requests": ("max_num_seqs", int),
    "--max-prefill-tokens": ("max_input_tokens_per_step", int),
    "--page-size": ("block_size", int),
    "--random-seed": ("seed", int),
    "--mem-fraction-static": ("gpu_memory_utilization", float),
    "--schedule-policy": ("policy", str),
    "--speculative-algorithm": ("speculative_method", str),
    "--speculative-num-draft-tokens": ("num_speculative_tokens", int),
    "--speculative-draft-model-path": ("speculative_model", str),
    "--lora-paths": ("lora_modules", str),
    "--max-loras-per-batch": ("max_loras", int),
    "--log-level-http": ("uvicorn_log_level", str),  # its --log-level is tidal's too
}
# SGLang's words for values of tidal's options: option -> {SGLang's value: tidal's}
VALUES = {"policy": {"lpm": "longest_prefix_match"},
          "speculative_method": {"NGRAM": "ngram", "STANDALONE": "draft"},
          "tool_call_parser": {"qwen25": "hermes", "qwen": "hermes", "llama3": "llama3_json"},
          "reasoning_parser": {"deepseek-r1": "deepseek_r1", "qwen3-thinking": "qwen3"}}
# SGLang's switches that set one of tidal's options to a value
SWITCHES = {"--disable-radix-cache": ("enable_prefix_caching", False),
            "--disable-cuda-graph": ("enforce_eager", True),
            "--is-embedding": ("task", "embed"),
            "--log-requests": ("enable_log_requests", True)}
# SGLang's switches that ask for what tidal does anyway, and why
ACCEPTED = {
    "--enable-metrics": "/metrics is always served",
    "--enable-cache-report": "usage always carries prompt_tokens_details.cached_tokens",
    "--skip-server-warmup": "the server sends itself no warm-up request",
    "--enable-mixed-chunk": "prefill chunks always share steps with decodes"}
# --grammar-backend's names of the backend structured outputs run on here
GRAMMAR_BACKENDS = ("llguidance",)
