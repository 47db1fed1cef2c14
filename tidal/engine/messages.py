"""What the frontend and the engine-core process say to each other over ZMQ (msgspec)."""

from __future__ import annotations

import msgspec

from tidal.core import RequestOutput, SamplingParams
from tidal.core.invariants import SchedulerStats
from tidal.core.snapshot import SchedulerView

# frontend -> core


class Add(msgspec.Struct, tag=True):
    """A new request for the core (the frontend checked it already)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prefill_address: str | None = None  # decode role: the prefill core computing its prompt


class Abort(msgspec.Struct, tag=True):
    """End a request and its n>1 siblings (client gone, or shutting down)."""

    request_id: str


class Finish(msgspec.Struct, tag=True):
    """End one sequence whose text met a stop string."""

    seq_id: str


class Adapters(msgspec.Struct, tag=True):
    """Serve exactly these LoRA adapters (name -> PEFT folder): load the new, forget the
    rest (the frontend checked them; it unloads none still in use)."""

    adapters: dict[str, str]


class ResetPrefixCache(msgspec.Struct, tag=True):
    """Forget every cached prefix (vLLM's /reset_prefix_cache)."""


class Pause(msgspec.Struct, tag=True):
    """Plan no steps until Resume; requests keep their state (vLLM's pause mode keep)."""


class Resume(msgspec.Struct, tag=True):
    """Plan steps again after a Pause."""


class StartProfile(msgspec.Struct, tag=True):
    """Record a torch.profiler trace of the core's work until StopProfile (or `num_steps`
    steps; 0: no limit) into the profiler folder."""

    num_steps: int = 0


class StopProfile(msgspec.Struct, tag=True):
    """End the trace StartProfile began and write it."""


class Shutdown(msgspec.Struct, tag=True):
    """Finish running requests for up to `drain_timeout` seconds, then exit."""

    drain_timeout: float = 0.0


# core -> frontend


class Ready(msgspec.Struct, tag=True):
    """The core is built and serving: what the frontend validates requests against."""

    core: int  # which engine core (data parallel: 0..N-1)
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    kv_address: str = ""  # P/D roles: where this core's KV transfer socket listens
    incarnation: int = 0  # which start of this core (a restart is a new one)
    embedding_size: int = 0  # the model's hidden size: an embedding's dimensions
    matryoshka: bool = False  # an embedding's leading dimensions are one too
    block_bytes: int = 0  # one KV block's bytes, every layer's K and V (rank 0's share)
    scorer: str = ""  # its score head (score_head.py): "classifier", "answer_tokens" or none
    labels: list[str] = []  # a classifier head's labels (more than one: /classify's)


class Outputs(msgspec.Struct, tag=True, gc=False):
    """One step's token outputs, each with its logprobs where its request asked for them."""

    core: int
    outputs: list[RequestOutput]
    incarnation: int = 0  # late outputs of a dead incarnation are dropped


class Rejected(msgspec.Struct, tag=True):
    """An Add the core refused (the frontend validates first; this is the backstop)."""

    request_id: str
    message: str


class Watch(msgspec.Struct, tag=True):
    """How many dashboards watch: while any does, Stats carry a SchedulerView."""

    viewers: int


class Stats(msgspec.Struct, tag=True):
    """The core's load and counters, twice a second (and right after a new request)."""

    core: int
    adds_seen: int  # Add messages the core has taken, so the dispatcher knows what stats cover
    scheduler: SchedulerStats
    prompt_tokens: int  # prompt tokens computed since start (prefix-cache hits excluded)
    generation_tokens: int  # tokens sampled since start
    execute_seconds: float = 0.0  # wall time in the model runner since start
    step_seconds: float = 0.0  # wall time of steps (schedule, execute, update, send) since start
    incarnation: int = 0  # late stats of a dead incarnation are dropped
    view: SchedulerView | None = None  # queues, block map and steps, while dashboards watch
    # The step-time model's predicted / measured seconds over recent steps at each of
    # tidal.core.ERROR_QUANTILES (empty without a model, or before its first step).
    step_time_error: list[float] = msgspec.field(default_factory=list)
    # Its coefficients, seconds per unit of each of tidal.core.STEP_TIME_TERMS (empty: none).
    step_time_coef: list[float] = msgspec.field(default_factory=list)
    max_step_ms: float = 0.0  # the step-time target steps are sized to now (0: none)


class Failed(msgspec.Struct, tag=True):
    """The core could not start (or crashed): why."""

    message: str
    core: int = -1
    incarnation: int = 0


ToCore = (Add | Abort | Finish | Shutdown | Watch | Adapters | ResetPrefixCache | Pause
          | Resume | StartProfile | StopProfile)


class Heartbeat(msgspec.Struct, tag=True):
    """Twice a second from a thread of the core's process, even mid-step: it is not hung."""

    core: int
    incarnation: int = 0


FromCore = Ready | Outputs | Rejected | Stats | Failed | Heartbeat

encoder = msgspec.msgpack.Encoder()
to_core = msgspec.msgpack.Decoder(ToCore)
from_core = msgspec.msgpack.Decoder(FromCore)
