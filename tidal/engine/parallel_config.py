"""How many engine cores serve a model and how each splits it: data parallelism, tensor,
pipeline and expert parallelism, and where their ranks run."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.core.config import knob

# How the data-parallel dispatcher (and the simulator's router) picks an engine core; the
# policies themselves are in tidal/cluster/routing.py.
ROUTING_POLICIES = ("round_robin", "least_tokens", "prefix_aware", "slack")


@dataclass(frozen=True)
class ParallelConfig:
    """How many engine cores serve the model, where they run, how requests reach them."""

    data_parallel_size: int = knob(1, "Engine cores behind one data-parallel dispatcher.")
    dp_batch_timeout: float = knob(0.1, "Seconds the dispatcher gathers requests into a "
                                   "batch before routing them (data parallel only).")
    dp_routing: str = knob("least_tokens", "How the dispatcher picks a core: 'round_robin', "
                           "'least_tokens' (fewest outstanding tokens) or 'prefix_aware' "
                           "(longest prompt prefix sent there before, else least tokens) or "
                           "'slack' (fewest prompt tokens queued: the most slack to a "
                           "request's TTFT deadline; for the slo policy).")
    dp_backend: str = knob("local", "Where the engine cores run: 'local' processes, or 'ray' "
                           "actors (joins RAY_ADDRESS's cluster, or starts a local one).")
    tensor_parallel_size: int = knob(1, "Ranks each engine core splits the model across "
                                     "(tensor parallelism: each holds 1/N of every layer's "
                                     "heads and MLP rows, of the vocabulary, and of every KV "
                                     "block): processes joined by torch.distributed (gloo). "
                                     "CPU ranks; dense weights, GGUF, GPTQ or AWQ; "
                                     "threads per rank default to cores / N (of a stage).")
    pipeline_parallel_size: int = knob(1, "Pipeline stages each engine core splits the "
                                       "model's layers into (contiguous runs, each with its "
                                       "layers' KV cache), each of tensor_parallel_size ranks. "
                                       "On one machine the stages take turns, each with its "
                                       "cores; across machines a step is in flight in each "
                                       "(batches_in_flight).")
    enable_expert_parallel: bool = knob(False, "Split a mixture-of-experts model's routed "
                                        "experts across the tensor-parallel ranks whole (1/N "
                                        "of them each, tokens' outputs summed) instead of "
                                        "splitting every expert's rows.")
    distributed_timeout: float = knob(60.0, "Seconds a tensor-parallel rank waits in a "
                                      "collective for the others before it fails the step "
                                      "(a rank that died or hangs), so the core restarts "
                                      "instead of hanging; also the most a group's start "
                                      "waits for Ray to start a rank's actor.")
    distributed_executor_backend: str = knob(
        "mp", "How an engine core's tensor-parallel ranks start: 'mp' (processes on this "
        "machine, and with --nnodes those `tidal serve --headless` starts on the others) or "
        "'ray' (actors placed by a Ray cluster: RAY_ADDRESS's, or a local one).")
    nnodes: int = knob(1, "Machines an engine core's tensor-parallel ranks span, "
                       "tensor_parallel_size / nnodes on each: node 0 serves the API, the "
                       "others run `tidal serve --headless --node-rank R` with the same flags.")
    node_rank: int = knob(0, "This machine's place among the nnodes (0: the one that serves).")
    master_addr: str = knob("127.0.0.1", "Node 0's address, where the other nodes' ranks "
                            "connect (with nnodes > 1: one of node 0's own addresses, reachable "
                            "from the others; the nodes' network must be trusted, as "
                            "torch.distributed's).")
    master_port: int = knob(29500, "Node 0's port the ranks meet at: this one for their "
                            "connections to rank 0, the next for torch.distributed's store.")
    kv_host: str = knob("127.0.0.1", "Address a prefill or decode core's KV transfer "
                        "socket binds (P/D disaggregation; a port is picked).")
    kv_transfer_timeout: float = knob(300.0, "Seconds a decode core waits for a request's KV "
                                      "from its prefill instance before failing it.")

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError("data_parallel_size must be at least 1")
        if self.dp_batch_timeout < 0:
            raise ValueError("dp_batch_timeout must be >= 0")
        if self.dp_routing not in ROUTING_POLICIES:
            raise ValueError(f"dp_routing must be one of {', '.join(ROUTING_POLICIES)}; "
                             f"got {self.dp_routing!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.pipeline_parallel_size < 1:
            raise ValueError("pipeline_parallel_size must be at least 1")
        if self.distributed_timeout <= 0:
            raise ValueError("distributed_timeout must be > 0")
        if self.dp_backend not in ("local", "ray"):
            raise ValueError(f"dp_backend must be local or ray; got {self.dp_backend!r}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..nnodes-1 and nnodes at least 1; got "
                             f"node_rank {self.node_rank} of {self.nnodes}")
        if self.nnodes > 1 and self.world_size % self.nnodes:
            raise ValueError(f"--nnodes {self.nnodes} must divide the {self.world_size} ranks "
                             f"(--tensor-parallel-size x --pipeline-parallel-size)")
        if self.nnodes > 1 and self.data_parallel_size > 1:
            raise ValueError("--nnodes spans one engine core's tensor-parallel ranks; "
                             "--data-parallel-size must be 1")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be mp or ray; got "
                             f"{self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and self.nnodes > 1:
            raise ValueError("--distributed-executor-backend ray places the ranks on the Ray "
                             "cluster's nodes itself: leave --nnodes at 1")
        if not 0 < self.master_port < 65535:
            raise ValueError(f"master_port must be in 1..65534; got {self.master_port}")

    @property
    def world_size(self) -> int:
        """An engine core's ranks: tensor_parallel_size in each of the pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_ranks(self) -> int:
        """An engine core's ranks on each machine."""
        return self.world_size // self.nnodes

    @property
    def one_machine(self) -> bool:
        """Whether all of an engine core's ranks run on this machine (processes, one node),
        sharing its cores."""
        return self.nnodes == 1 and self.distributed_executor_backend == "mp"


def busy_ranks(local: int, width: int, in_flight: int) -> int:
    """Of the `local` ranks on one machine, those computing at once: the `width` ranks of at
    most `in_flight` pipeline stages (the others wait for their turn); they share its cores."""
    return max(1, min(local, in_flight * width))
