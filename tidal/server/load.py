"""How loaded the server is, in the words routers and RL frameworks poll: vLLM's `GET /load`
(HTTP requests being answered on the model's routes, counted by `ServerLoad` around every
request), SGLang's `GET /v1/loads` (each engine core's queues, KV tokens and throughput,
from its latest stats: at most half a second old) and its older `GET /get_load`."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse

from tidal import __version__
from tidal.server.frontend import Frontend, FrontendDep
from tidal.server.limits import route_path
from tidal.server.openai.protocol import APIError

routes = APIRouter()

# the routes whose requests put work on the engine (vLLM's list, and tidal's native ones);
# /v1/responses/{id} too (retrieving a background response may stream it), not its DELETE
LOAD_PATHS = frozenset((
    "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
    "/v1/messages", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
    "/classify", "/v1/classify", "/generate", "/encode", "/invocations"))
_RESPONSE = "/v1/responses/"
SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


class RequestCount:
    """The requests on `LOAD_PATHS` being answered now."""

    def __init__(self) -> None:
        self.value = 0


class ServerLoad:
    """ASGI middleware: counts the requests on `LOAD_PATHS` from their arrival until their
    answer is sent whole (a stream's last event) or its client left."""

    def __init__(self, app, count: RequestCount) -> None:
        self.app, self.count = app, count

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not _counts(scope):
            return await self.app(scope, receive, send)
        self.count.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count.value -= 1


def _counts(scope) -> bool:
    path = route_path(scope)
    return path in LOAD_PATHS or (path.startswith(_RESPONSE) and scope["method"] != "DELETE")


def install_load(app) -> None:
    """Count the app's requests for /load."""
    app.state.server_load = RequestCount()
    app.add_middleware(ServerLoad, count=app.state.server_load)


@routes.get("/load")
async def load(request: Request):
    """vLLM's: `server_load`, the requests being answered on the model's routes
    (completions, chat, Responses, Messages, embeddings, scoring, SGLang's and SageMaker's
    generation), each counted until its answer is sent."""
    return {"server_load": request.app.state.server_load.value}


def core_loads(f: Frontend, sections: set[str]) -> list[dict]:
    """SGLang's per-rank loads of the cores that reported (a dead core's slot is empty)."""
    client, ready = f.client, f.client.ready
    block, max_seqs = ready.block_size, client.config.scheduler.max_num_seqs
    loads = []
    for core, stats in enumerate(client.board.latest):
        if stats is None:
            continue
        s = stats.scheduler
        running, waiting = s.running_decode + s.running_prefill, s.waiting + s.preempted
        used = s.used_blocks * block
        entry = {"dp_rank": core, "timestamp": client.board.arrived[core],
                 "num_running_reqs": running, "num_waiting_reqs": waiting,
                 "num_total_reqs": running + waiting,
                 "num_waiting_uncached_tokens": s.prefill_tokens,
                 "num_used_tokens": used, "num_total_tokens": used + s.prefill_tokens,
                 "max_total_num_tokens": s.num_blocks * block, "token_usage": s.kv_usage,
                 "gen_throughput": round(client.board.gen_rate[core], 2),
                 "cache_hit_rate": s.prefix_hit_rate, "utilization": s.kv_usage,
                 "max_running_requests": max_seqs}
        if sections & {"memory", "all"}:
            entry["memory"] = {"kv_cache_gb": s.num_blocks * ready.block_bytes / 1e9,
                               "token_capacity": s.num_blocks * block}
        if sections & {"spec", "all"} and s.spec_drafts:
            entry["speculative"] = {
                "accept_length": 1 + s.spec_accepted_tokens / s.spec_drafts,
                "accept_rate": s.spec_accepted_tokens / max(1, s.spec_draft_tokens)}
        if sections & {"lora", "all"} and client.config.lora.enable_lora:
            entry["lora"] = {"slots_used": len(s.running_loras), "slots_total": s.max_loras,
                             "utilization": len(s.running_loras) / s.max_loras}
        if sections & {"disagg", "all"} and client.config.scheduler.role != "mixed":
            entry["disaggregation"] = {"mode": client.config.scheduler.role,
                                       "transferring_reqs": s.transferring}
        if sections & {"queues", "all"}:
            entry["queues"] = {"waiting": s.waiting, "retracted": s.preempted,
                               "transferring": s.transferring}
        loads.append(entry)
    return loads


def _aggregate(loads: list[dict]) -> dict:
    n = max(1, len(loads))
    total = {key: sum(d[field] for d in loads) for key, field in (
        ("total_running_reqs", "num_running_reqs"), ("total_waiting_reqs", "num_waiting_reqs"),
        ("total_reqs", "num_total_reqs"), ("total_used_tokens", "num_used_tokens"),
        ("total_tokens", "num_total_tokens"))}
    return {**total, "avg_token_usage": round(sum(d["token_usage"] for d in loads) / n, 4),
            "avg_throughput": round(sum(d["gen_throughput"] for d in loads) / n, 2),
            "avg_utilization": round(sum(d["utilization"] for d in loads) / n, 4)}


def _prometheus(loads: list[dict]) -> str:
    """Each number a gauge labelled with its rank: `sglang_<field>`, `sglang_<section>_<field>`
    (SGLang's names)."""
    samples: dict[str, list[str]] = {}
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    for d in loads:
        rank = d["dp_rank"]
        for key, value in d.items():
            items = ([(f"{prefixes.get(key, key)}_{k}", v) for k, v in value.items()]
                     if isinstance(value, dict) else [(key, value)])
            for name, v in items:
                if isinstance(v, (int, float)) and name not in ("dp_rank", "timestamp"):
                    samples.setdefault(f"sglang_{name}", []).append(
                        f'sglang_{name}{{dp_rank="{rank}"}} {v}')
    return "".join(f"# TYPE {name} gauge\n" + "\n".join(lines) + "\n"
                   for name, lines in samples.items())


@routes.get("/v1/loads", responses={200: {"content": {"text/plain": {}}}})
async def loads(f: FrontendDep, dp_rank: int | None = Query(None, ge=0),
                include: str | None = None,
                format: Literal["json", "prometheus"] = "json"):  # noqa: A002 (SGLang's name)
    """SGLang's: each engine core's running and waiting requests, KV tokens in use and
    pending, generation throughput and prefix-cache hit rate (`include`: any of
    core, memory, spec, lora, disagg, queues, all; `dp_rank`: one core), and their totals;
    `format=prometheus`: the numbers as gauges."""
    sections = {s.strip() for s in (include or "core").split(",") if s.strip()} or {"core"}
    if sections - set(SECTIONS):
        raise APIError(f"unknown include sections {sorted(sections - set(SECTIONS))}; "
                       f"known: {', '.join(SECTIONS)}", param="include")
    if dp_rank is not None and dp_rank >= f.client.num_cores:
        raise APIError(f"dp_rank {dp_rank} does not exist: this server runs "
                       f"{f.client.num_cores} engine core(s)", param="dp_rank")
    found = [d for d in core_loads(f, sections) if dp_rank in (None, d["dp_rank"])]
    if format == "prometheus":
        return PlainTextResponse(_prometheus(found))
    return {"timestamp": datetime.now(timezone.utc).isoformat(), "version": __version__,
            "dp_rank_count": len(found), "loads": found, "aggregate": _aggregate(found)}


@routes.get("/get_load")
async def get_load(f: FrontendDep):
    """SGLang's older shape of /v1/loads: per core, its requests (running and waiting),
    those waiting, its KV tokens in use and pending prefill."""
    now = time.perf_counter()
    return [{"dp_rank": d["dp_rank"], "num_reqs": d["num_total_reqs"],
             "num_waiting_reqs": d["num_waiting_reqs"], "num_tokens": d["num_total_tokens"],
             "num_pending_tokens": d["num_total_tokens"] - d["num_used_tokens"],
             "ts_tic": now} for d in core_loads(f, {"core"})]
