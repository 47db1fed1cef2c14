"""Configuration of the KV cache and the scheduler: every knob, its default and why.

Each field carries its help text in `metadata["help"]`, so the CLI and the README table are
built from the same words.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tidal.core import policies, roles
from tidal.core.knobs import check_at_least_one, check_choice, check_positive, knob

__all__ = ["BATCH_MODES", "PREEMPTION_ORDERS", "SLO_OVERLOAD", "CacheConfig", "SchedulerConfig",
           "help_table", "knob"]

BATCH_MODES = ("separate", "mixed")
PREEMPTION_ORDERS = ("shortest_output", "newest")
SLO_OVERLOAD = ("defer", "reject")


@dataclass(frozen=True)
class CacheConfig:
    """Shape of the paged KV cache."""

    num_blocks: int = knob(1024, "KV blocks in the pool. The engine sets it to its resolved "
                           "num_kv_blocks (given, or derived from memory).")
    block_size: int = knob(16, "Tokens per KV block.")
    enable_prefix_caching: bool = knob(True, "Reuse full blocks of identical prefixes.")

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler admits, chunks, reserves and preempts; defaults are the seeds'."""

    chunked_prefill_size: int = knob(
        8192, "Largest prefill chunk of the one chunked request in a step (rem_chunk_tokens).")
    max_input_tokens_per_step: int = knob(
        16384, "Tokens one step may compute; running decodes are subtracted (rem_input_tokens).")
    max_num_seqs: int = knob(256, "Most requests holding KV blocks at once.")
    max_model_len: int = knob(32768, "Longest sequence, prompt plus output.")
    batch_mode: str = knob(
        "mixed", "'separate': decode only in steps without prefill; 'mixed': decodes and "
        "prefill chunks share a step.")
    policy: str = knob(
        "fcfs", "What a step holds and in which order waiting requests are admitted: 'fcfs', "
        "'prefill_first' (no decode while a prefill is chunking), 'priority' (lowest value "
        "first), 'longest_prefix_match' (with aging), 'slo' (latency targets: "
        "docs/design/slo.md); one module each in tidal/core/policies.")
    role: str = knob(
        "mixed", "'mixed' serves whole requests; 'prefill' and 'decode' are the two halves of "
        "P/D disaggregation.")
    init_new_token_ratio: float = knob(
        0.7, "Share of each running request's remaining output that admission reserves "
        "(0: no reservation, as vLLM v1).")
    min_new_token_ratio_factor: float = knob(
        0.30, "The ratio's floor, as a fraction of init_new_token_ratio.")
    new_token_ratio_decay_steps: int = knob(
        600, "Decode-only steps the ratio takes to decay linearly from init to its floor.")
    retract_decode_steps: int = knob(
        20, "Decode steps assumed ahead of each request when the ratio is recomputed after a "
        "retraction.")
    clip_max_new_tokens: int = knob(
        4096, "Cap on one request's remaining output when reserving (estimation only).")
    preemption_order: str = knob(
        "shortest_output", "Retraction victims: 'shortest_output' (fewest generated tokens, "
        "then longest prompt: the seeds') or 'newest' (last admitted first, as vLLM v1).")
    safety_margin: float = knob(
        0.0, "Stop admitting new prefills while free blocks are under this share of the pool.")
    async_scheduling: bool = knob(
        False, "The executor runs one step ahead: preempted requests wait for its "
        "preempted_ack before they rejoin the waiting queue.")
    lpm_aging_steps: int = knob(
        64, "longest_prefix_match: a request waiting this many steps goes first regardless "
        "of its cache hit, so cold requests cannot starve.")
    ttft_slo_ms: float | None = knob(
        None, "slo policy: the time-to-first-token target (ms, from arrival) of requests "
        "that set none; None: no TTFT target.")
    tpot_slo_ms: float | None = knob(
        None, "slo policy: the time-per-output-token target (ms) of requests that set none; "
        "None: no TPOT target.")
    slo_overload: str = knob(
        "defer", "slo policy, for a waiting request predicted to miss its TTFT target: "
        "'defer' (behind every request that can still meet its own) or 'reject' (finish it "
        "before any compute: the server answers 503).")
    slo_max_defer_ms: float = knob(
        30000.0, "slo policy: a request waiting this long (ms, from arrival) goes ahead of "
        "every request that has not, so a deferred one is served within a bounded time.")
    lpm_max_queue: int = knob(
        128, "longest_prefix_match: with more waiting requests than this, fall back to fcfs "
        "(matching every prefix each step would cost more than it saves).")

    def __post_init__(self) -> None:
        check_choice("batch_mode", self.batch_mode, BATCH_MODES)
        check_choice("policy", self.policy, tuple(policies.POLICIES))  # tidal/core/policies
        check_choice("role", self.role, tuple(roles.ROLES))
        check_at_least_one(self, "chunked_prefill_size", "max_input_tokens_per_step",
                           "max_num_seqs", "max_model_len", "new_token_ratio_decay_steps",
                           "clip_max_new_tokens", "lpm_aging_steps")
        check_choice("preemption_order", self.preemption_order, PREEMPTION_ORDERS)
        check_choice("slo_overload", self.slo_overload, SLO_OVERLOAD)
        check_positive(self, "ttft_slo_ms", "tpot_slo_ms", "slo_max_defer_ms")
        if not 0 <= self.init_new_token_ratio <= 1:
            raise ValueError("init_new_token_ratio must be in [0, 1]")
        if not 0 <= self.min_new_token_ratio_factor <= 1:
            raise ValueError("min_new_token_ratio_factor must be in [0, 1]")
        if not 0 <= self.safety_margin < 1:
            raise ValueError("safety_margin must be in [0, 1)")
        if self.retract_decode_steps < 0:
            raise ValueError("retract_decode_steps must be >= 0")


def help_table(cls: type) -> list[tuple[str, Any, str]]:
    """(name, default, help) for each field of a config dataclass."""
    return [(f.name, f.default, f.metadata.get("help", "")) for f in fields(cls)]
