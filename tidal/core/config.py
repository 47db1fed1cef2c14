"""Configuration of the KV cache and the scheduler: every knob, its default and why.

Each field carries its help text in `metadata["help"]`, so the CLI and the README table are
built from the same words. A policy's own options are declared by the policy
(tidal/core/policies) and held in `SchedulerConfig.policy_options`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from tidal.core import policies, roles
from tidal.core.knobs import check_at_least_one, check_choice, knob

__all__ = ["BATCH_MODES", "PREEMPTION_ORDERS", "CacheConfig", "SchedulerConfig", "help_table",
           "knob"]

BATCH_MODES = ("separate", "mixed")
PREEMPTION_ORDERS = ("shortest_output", "newest")
MAX_SPECULATIVE_TOKENS = 16  # beyond it a guessed run is almost never accepted whole


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
    """What the scheduler admits, chunks, reserves and preempts. The defaults are those of
    FastDeploy's ratio-based scheduler (ResourceManagerV1, after SGLang's): docs/design/
    scheduler.md says where each comes from.

    The chosen policy's own options are `policy_options`, that policy's `Options` dataclass;
    `from_kwargs` takes them by name, as the engine's flags and `LLM` keywords give them."""

    chunked_prefill_size: int = knob(
        8192, "Largest prefill chunk of the one chunked request in a step (rem_chunk_tokens).")
    max_input_tokens_per_step: int = knob(
        16384, "Tokens one step may compute; running decodes are subtracted (rem_input_tokens).")
    max_step_ms: float | None = knob(
        None, "Most milliseconds a step should take, as the step-time model predicts it: a "
        "step's prefill tokens are capped so that running streams get their next token "
        "within it (at least one block of prefill per step). A server derives it when "
        "unset: on CPU the machine's, as its step-time model learns it (docs/design/"
        "step-time.md), on GPU none (the token budgets alone); offline `LLM` and 0: no "
        "time cap.")
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
        "then longest prompt: SGLang's and FastDeploy's) or 'newest' (last admitted first, "
        "as vLLM v1).")
    background_step_share: float = knob(
        0.25, "A step whose prompts are all background requests' (Batch API lines) is sized "
        "to this share of the step target (max_step_ms): a live request arriving meanwhile "
        "waits for the step in progress, where it cannot be cut short. 1: sized as any step.")
    lone_prompt_fixed_share: float = knob(
        0.02, "A live prompt alone (nothing decoding, no other prompt to compute) keeps no "
        "stream waiting: its steps may exceed the step target (max_step_ms) until a step's "
        "fixed costs (the step's and the prompt's own, as the step-time model prices a "
        "one-token prompt) are at most this share of it, rather than paying them again on "
        "every target-sized chunk (on CPU, dequantizing every weight tile). 0: target-sized "
        "chunks too.")
    cut_background_steps: bool = knob(
        True, "A step that computes a background request's prompt chunk stops between two "
        "layers when a live request arrives, and runs again after the live prompt's (one "
        "worker in the engine core's process, one step at a time).")
    safety_margin: float = knob(
        0.0, "Stop admitting new prefills while free blocks are under this share of the pool.")
    async_scheduling: bool = knob(
        False, "The executor runs one step ahead: preempted requests wait for its "
        "preempted_ack before they rejoin the waiting queue.")
    batches_in_flight: int | None = knob(
        None, "Steps the executor holds at once (unset: one per pipeline stage where the "
        "stages span machines (--nnodes, Ray), else 1; always 1 for a P/D role, which moves "
        "KV between steps). 1 runs a pipeline's stages in turn, each rank with the cores of "
        "its machine's tensor-parallel group. Above 1 a request joins a step only once its "
        "previous one has returned, each step takes an even share of the ready decodes, "
        "and preempted requests wait for the executor's preempted_ack.")
    num_speculative_tokens: int = knob(
        0, "Most tokens a decoding request may guess per step, verified in one forward pass "
        "(0: no speculation). Set with speculative_method, which proposes the guesses.")
    speculative_adaptive: bool = knob(
        True, "Choose each request's guesses per step from the step-time model and the "
        "request's acceptance rate, to maximise expected tokens per second of step time "
        "(0 guesses allowed: at large batches speculation turns itself off). false: every "
        "request guesses as many as its proposer offers, up to num_speculative_tokens.")
    max_loras: int = knob(
        1, "Most distinct LoRA adapters the requests holding KV blocks may use at once: the "
        "model runner's adapter slots. Requests of the base model take none.")
    lora_wait_steps: int = knob(
        32, "Steps a waiting request whose adapter finds no free slot lets later requests of "
        "resident adapters be admitted past it; after that nobody behind it is admitted "
        "until a slot frees up for it.")
    policy_options: policies.Policy.Options | Mapping[str, Any] | None = field(
        default=None, metadata={"help": "The chosen policy's options: its `Options` "
                                "dataclass, or their values by name (unset: the defaults). "
                                "Always the dataclass once built."})

    @property
    def executor_ahead(self) -> bool:
        """Whether the executor holds steps planned after one not yet returned (async
        scheduling, or several in flight): a preempted request waits for its ack."""
        return self.async_scheduling or self.steps_in_flight > 1

    @property
    def steps_in_flight(self) -> int:
        """batches_in_flight, 1 where unset."""
        return self.batches_in_flight or 1

    def __post_init__(self) -> None:
        check_choice("batch_mode", self.batch_mode, BATCH_MODES)
        check_choice("policy", self.policy, tuple(policies.POLICIES))  # tidal/core/policies
        check_choice("role", self.role, tuple(roles.ROLES))
        check_at_least_one(self, "chunked_prefill_size", "max_input_tokens_per_step",
                           "max_num_seqs", "max_model_len", "new_token_ratio_decay_steps",
                           "clip_max_new_tokens", "max_loras")
        if self.batches_in_flight is not None and self.batches_in_flight < 1:
            raise ValueError(f"batches_in_flight must be at least 1, got {self.batches_in_flight}")
        check_choice("preemption_order", self.preemption_order, PREEMPTION_ORDERS)
        if not 0 <= self.init_new_token_ratio <= 1:
            raise ValueError("init_new_token_ratio must be in [0, 1]")
        if not 0 <= self.min_new_token_ratio_factor <= 1:
            raise ValueError("min_new_token_ratio_factor must be in [0, 1]")
        if not 0 < self.background_step_share <= 1:
            raise ValueError(f"background_step_share must be in (0, 1], got "
                             f"{self.background_step_share}")
        if not 0 <= self.lone_prompt_fixed_share < 1:
            raise ValueError(f"lone_prompt_fixed_share must be in [0, 1), got "
                             f"{self.lone_prompt_fixed_share}")
        if not 0 <= self.safety_margin < 1:
            raise ValueError("safety_margin must be in [0, 1)")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if self.lora_wait_steps < 0:
            raise ValueError("lora_wait_steps must be >= 0")
        if self.max_step_ms is not None and self.max_step_ms < 0:
            raise ValueError("max_step_ms must be >= 0")
        if self.retract_decode_steps < 0:
            raise ValueError("retract_decode_steps must be >= 0")
        options = self.policy_options
        if options is None or isinstance(options, Mapping):
            options = policies.make_options(self.policy, options or {})
        elif type(options) is not self.policy_class.Options:
            raise ValueError(f"policy_options is a {type(options).__qualname__}; the "
                             f"{self.policy} policy takes {self.policy_class.Options.__qualname__}")
        object.__setattr__(self, "policy_options", options)  # frozen: set once, built

    @property
    def policy_class(self) -> type[policies.Policy]:
        """The chosen policy's class: what the layers above ask about its capabilities."""
        return policies.POLICIES[self.policy]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "SchedulerConfig":
        """The config from flat options: its own fields and the chosen policy's options, all
        by name (an option of another policy is a ValueError naming that policy)."""
        own = {f.name for f in fields(cls)}
        given = {k: v for k, v in kwargs.items() if k not in own}
        if given and "policy_options" in kwargs:
            raise TypeError("give the policy's options by name or as policy_options, not both")
        mine = {k: v for k, v in kwargs.items() if k in own}
        return cls(**mine, **({"policy_options": given} if given else {}))

    def as_kwargs(self) -> dict[str, Any]:
        """The config as flat options, what `from_kwargs` takes back."""
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "policy_options"}
        opts = self.policy_options
        return {**flat, **{f.name: getattr(opts, f.name) for f in fields(opts)}}


def help_table(cls: type) -> list[tuple[str, Any, str]]:
    """(name, default, help) for each field of a config dataclass."""
    return [(f.name, f.default, f.metadata.get("help", "")) for f in fields(cls)]
