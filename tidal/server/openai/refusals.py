"""The fields tidal refuses unless their value asks for nothing, and why (the `_refused`
tables of the request models in protocol.py; docs/serving.md lists them)."""

from __future__ import annotations

# Why a field is refused, by topic; a table entry is (values that pass, why).
OLD_FUNCTIONS = "OpenAI's older form of tools: use tools and tool_choice"
STRUCTURED = "tidal's structured outputs take response_format, structured_outputs or guided_*"
NOT_YET = "tidal does not implement it yet"

# vLLM's request extensions tidal does not implement (both endpoints).
VLLM_REFUSED: dict[str, tuple[tuple, str]] = {
    "logits_processors": (([],), "tidal takes no per-request logits processors (as vLLM's "
                                 "V1): start the server with --logits-processors and pass "
                                 "vllm_xargs"),
    "guided_decoding_backend": ((), STRUCTURED),
    "guided_whitespace_pattern": ((), STRUCTURED),
    "structural_tag": ((), STRUCTURED),
    "prompt_embeds": ((), "tidal takes text and token ids only"),
    "mm_processor_kwargs": ((), "tidal serves text-only models"),
    "media_io_kwargs": ((), "tidal serves text-only models"),
}

# OpenAI chat fields tidal does not implement, and vLLM's chat-only extensions.
CHAT_REFUSED: dict[str, tuple[tuple, str]] = {
    "functions": (([],), OLD_FUNCTIONS),
    "function_call": (("none",), OLD_FUNCTIONS),
    "audio": ((), "tidal serves text-only models"),
    "modalities": ((["text"],), "tidal serves text-only models"),
    "web_search_options": ((), "tidal has no web search"),
    "moderation": ((), "tidal runs no moderation"),
    "reasoning_effort": (("none",), "this server has no reasoning controls"),
    "verbosity": ((), "this server has no verbosity control"),
    "service_tier": (("auto", "default"), "this server has one service tier, 'default'"),
    "best_of": ((1,), "tidal does not rank candidates"),
}

# OpenAI completion fields tidal does not implement (best_of is checked against n).
COMPLETION_REFUSED: dict[str, tuple[tuple, str]] = {
    "suffix": (("",), "tidal does not implement insertion"),
}

# OpenAI Responses fields tidal does not implement.
RESPONSES_REFUSED: dict[str, tuple[tuple, str]] = {
    "background_options": ((), "background responses take no options here"),
    "access_programs": ((), NOT_YET),
    "context_management": ((), "tidal does not compact conversations"),
    "image": ((), "tidal serves text-only models"),
    "moderation": ((), "tidal runs no moderation"),
    "conversation": ((), "tidal keeps no conversations: chain responses with "
                          "previous_response_id"),
    "prompt": ((), "tidal has no stored prompt templates"),
    "service_tier": (("auto", "default"), "this server has one service tier, 'default'"),
}

# What a beam search (use_beam_search) cannot honour, unless null or the value that asks for
# nothing: it ranks every token by the model's logprobs, ends a beam at a stop token, and
# each step's request holds the beam in its prompt (penalties count a request's output).
NOT_SAMPLED = "beam search ranks every token; it samples none"
PENALTY = "a beam step holds the beam in its prompt, not in an output to read"
BEAM_SEARCH_REFUSED: dict[str, tuple[tuple, str]] = {
    "stop": (("", []), "a beam ends at a stop token (stop_token_ids, EOS), not a string"),
    "top_p": ((1, 1.0), NOT_SAMPLED),
    "top_k": ((0, -1), NOT_SAMPLED),
    "min_p": ((0, 0.0), NOT_SAMPLED),
    "presence_penalty": ((0, 0.0), PENALTY),
    "frequency_penalty": ((0, 0.0), PENALTY),
    "repetition_penalty": ((1, 1.0), PENALTY),
    "bad_words": (([],), PENALTY),
    "vllm_xargs": ((), PENALTY),
    "min_tokens": ((0,), "a beam may end at any step"),
    "logprobs": ((False,), "a beam's score is its cumulative logprob; tokens carry none"),
    "prompt_logprobs": ((), "a beam search reports no prompt logprobs"),
    "tools": (([],), "calls are not searched"),
    "kv_transfer_params": ((), "a beam search runs on one instance"),
    "ttft_slo_ms": ((), "its steps are requests of their own"),
    "tpot_slo_ms": ((), "its steps are requests of their own"),
}
