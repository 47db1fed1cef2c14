"""`tidal router`: the HTTP front of prefill/decode disaggregation.

For each generation request (OpenAI's completions, chat and Responses, Anthropic's Messages)
it picks a decode instance (fewest requests in flight) and a prefill instance (round robin),
and forwards the request to the decode instance with
`kv_transfer_params.prefill_address` set to the prefill core's KV socket. The decode instance
allocates the blocks, asks that prefill core for the prompt's KV, decodes, and streams back
through here. Backpressure lives in the decode instance's admission queue: a request with no
room waits there, and its prompt is not computed until it has blocks. A Responses request
that continues a stored one goes to the decode instance that stored it (each keeps its
own). Embeddings and scores end at their prompts: a prefill instance computes them.

The router re-reads every instance's /health each `health_interval` seconds, and at once
after a failed forward: an instance that fails it leaves the rotation until it passes again,
and a prefill instance whose core was restarted is sent to at its new KV address.

Its /dashboard shows every instance's cores: its stream merges the instances' streams. Its
routes and app are in `pd_routes.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import AsyncIterator
from urllib.parse import quote

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tidal.cluster.routing import CoreLoad, Router
from tidal.server.anthropic.protocol import body_for
from tidal.server.openai.protocol import APIError

log = logging.getLogger("tidal.router")
# to_all: the routes that reach the decode instances before the prefill ones
_DECODE_FIRST = ("/pause", "/pause_generation", "/is_paused", "/update_weights_from_disk",
                 "/sleep", "/release_memory_occupation")


class Instance:
    """One `tidal serve --role ...` the router forwards to."""

    def __init__(self, url: str, role: str) -> None:
        self.url, self.role = url.rstrip("/"), role
        self.kv_address = ""
        self.in_flight = 0
        self.healthy = True


class PDRouter:
    """The prefill and decode instances, how to pick a pair, and the forwarding itself."""

    def __init__(self, prefill: list[str], decode: list[str],
                 health_interval: float = 1.0) -> None:
        if not prefill or not decode:
            raise ValueError("the router needs at least one prefill and one decode instance")
        self.prefill = [Instance(u, "prefill") for u in prefill]
        self.decode = [Instance(u, "decode") for u in decode]
        self.health_interval = health_interval
        self._recheck = asyncio.Event()
        self._prefill_router = Router("round_robin", len(self.prefill))
        self._decode_router = Router("least_tokens", len(self.decode))
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    async def wait_ready(self, timeout: float = 600.0) -> None:
        """Wait for every instance's /health; check its role; learn the prefill cores'
        KV addresses."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for role, group in (("prefill", self.prefill), ("decode", self.decode)):
            for inst in group:
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        r = await self.http.get(inst.url + "/health")
                        if r.status_code == 200:
                            break
                    if loop.time() > deadline:
                        raise RuntimeError(f"{inst.url} did not become healthy")
                    await asyncio.sleep(0.3)
                health = r.json()
                if health.get("role") != role:
                    raise RuntimeError(f"{inst.url} serves role {health.get('role')!r}, "
                                       f"not {role!r}")
                inst.kv_address = health.get("kv_address", "")

    async def check(self, inst: Instance) -> None:
        """Re-read `inst`'s /health: in rotation while it answers 200 in its role."""
        try:
            r = await self.http.get(inst.url + "/health", timeout=5.0)
            health = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            health = {}
        healthy = health.get("role") == inst.role
        if healthy:
            inst.kv_address = health.get("kv_address", "")
        if healthy != inst.healthy:
            log.warning("%s instance %s is %s", inst.role, inst.url,
                        "back in rotation" if healthy else "out of rotation")
        inst.healthy = healthy

    async def watch_health(self) -> None:
        """Check every instance each `health_interval` s, or at once when asked to."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._recheck.wait(), self.health_interval)
            self._recheck.clear()
            await asyncio.gather(*(self.check(i) for i in self.prefill + self.decode))

    def pick(self, role: str) -> Instance:
        """A healthy instance of `role`: a decode one with the fewest requests in flight, a
        prefill one round robin."""
        group, router = ((self.decode, self._decode_router) if role == "decode"
                         else (self.prefill, self._prefill_router))
        if not any(i.healthy for i in group):
            raise APIError(f"no {role} instance is healthy; retry later", 503,
                           "service_unavailable", retry_after=1)
        return group[router.choose([CoreLoad(i.in_flight, available=i.healthy)
                                    for i in group])]

    async def forward(self, path: str, stream: bool, request: Request,
                      decode: Instance | None = None) -> Response:
        """Send a request the server's own models accepted to a decode instance (`decode`,
        else the least busy), naming the prefill core; relay its answer (streamed or not)
        as it comes."""
        raw = await request.json()  # as the client sent it (FastAPI parsed and kept it)
        p = self.pick("prefill")
        d = decode or self.pick("decode")
        raw["kv_transfer_params"] = {"prefill_address": p.kv_address}
        headers = auth_header(request)  # httpx writes the JSON content type
        d.in_flight += 1
        try:
            upstream = await self.http.send(
                self.http.build_request("POST", d.url + path, json=raw, headers=headers),
                stream=True)
        except httpx.HTTPError as exc:
            d.in_flight -= 1
            d.healthy = False  # until its /health says otherwise
            self._recheck.set()
            raise APIError(f"decode instance {d.url} unreachable: {exc}", 503,
                           "service_unavailable") from exc
        if upstream.status_code >= 500:  # an instance's core died or restarts: look again
            self._recheck.set()
        if not stream or upstream.status_code != 200:
            try:
                content = await upstream.aread()
            except httpx.HTTPError as exc:
                raise APIError(f"decode instance {d.url} failed mid-request: {exc}", 503,
                               "service_unavailable") from exc
            finally:
                d.in_flight -= 1
                await upstream.aclose()
            retry = upstream.headers.get("retry-after")  # a decode instance's 429
            return Response(content, upstream.status_code,
                            media_type=upstream.headers.get("content-type"),
                            headers={"Retry-After": retry} if retry else None)

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:  # the decode instance died mid-stream
                self._recheck.set()
                err = APIError(f"decode instance {d.url} failed mid-stream: {exc}", 503,
                               "service_unavailable")
                body = json.dumps(body_for(err, path))
                yield (f"event: error\ndata: {body}\n\n" if path == "/v1/messages"
                       else f"data: {body}\n\ndata: [DONE]\n\n").encode()
            finally:
                d.in_flight -= 1
                await upstream.aclose()  # a client that left closes the decode side too

        return StreamingResponse(relay(), media_type="text/event-stream")

    async def relay(self, path: str, request: Request, inst: Instance | None = None,
                    ) -> Response:
        """`inst`'s answer (default: a healthy decode instance's) to a request that needs no
        KV moved (/v1/models, /tokenize, /detokenize: every instance serves the same model
        and tokenizer)."""
        inst = inst or next((d for d in self.decode if d.healthy), self.decode[0])
        headers = {**auth_header(request), "content-type": "application/json"}
        try:
            r = await self.http.request(request.method, inst.url + path, headers=headers,
                                        params=[(k, v) for k, v in request.query_params
                                                .multi_items() if k != "api_key"],
                                        content=await request.body())
        except httpx.HTTPError as exc:
            raise APIError(f"{inst.role} instance unreachable: {exc}", 503,
                           "service_unavailable") from exc
        return Response(r.content, r.status_code, media_type="application/json")

    async def to_all(self, path: str, request: Request) -> Response:
        """Every instance's answer to the same request (/reset_prefix_cache): the first
        failure's, else the last one's. A pause or a weight update reaches the decode
        instances first (where requests enter), a resume the prefill ones (which compute
        what they wait for)."""
        first = path in _DECODE_FIRST
        order = self.decode + self.prefill if first else self.prefill + self.decode
        answers = [await self.relay(path, request, inst) for inst in order]
        return next((a for a in answers if a.status_code != 200), answers[-1])

    async def to_prefill(self, path: str, request: Request) -> Response:
        """A prefill instance's answer (round robin) to a request that ends at its prompt:
        embeddings and scores are computed where prompts are, beside no decode."""
        return await self.relay(path, request, self.pick("prefill"))

    async def holder(self, response_id: str, request: Request) -> Instance | None:
        """The decode instance whose store holds a response (each keeps those it made)."""
        for inst in (d for d in self.decode if d.healthy):
            with contextlib.suppress(httpx.HTTPError):
                r = await self.http.get(f"{inst.url}/v1/responses/{quote(response_id, safe='')}",
                                        headers=auth_header(request))
                if r.status_code == 200:
                    return inst
        return None

    async def dashboard_events(self, auth: dict[str, str]) -> AsyncIterator[str]:
        """The instances' dashboard streams as one: the i-th instance (prefill ones first)
        has its core c shown as core 1000 i + c, labelled with its role and address."""
        events: asyncio.Queue = asyncio.Queue(64)

        async def follow(i: int, inst: Instance) -> None:
            while True:  # an instance that restarts or drops the stream is followed again
                with contextlib.suppress(httpx.HTTPError):
                    async with self.http.stream("GET", inst.url + "/dashboard/stream",
                                                headers=auth) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                event = json.loads(line[len("data: "):])
                                core = event["core"]
                                event.update(core=1000 * i + core,
                                             label=f"{inst.role} {inst.url}, core {core}")
                                if events.full():  # a slow page drops its oldest event
                                    events.get_nowait()
                                events.put_nowait(f"data: {json.dumps(event)}\n\n")
                await asyncio.sleep(1.0)

        tasks = [asyncio.create_task(follow(i, inst))
                 for i, inst in enumerate(self.prefill + self.decode)]
        try:
            yield ": tidal router dashboard\n\n"
            while True:
                yield await events.get()
        finally:
            for t in tasks:
                t.cancel()

    async def probe(self, key: str | None, timeout: float) -> None:
        """SGLang's /health_generate through the pair: one greedy token of a one-token
        prompt, computed by a prefill instance and sampled by a decode one; else an
        APIError (503) saying why. A decode instance paused or asleep is idle on purpose."""
        p, d = self.pick("prefill"), self.pick("decode")
        auth = {"authorization": f"Bearer {key}"} if key else {}
        health = (await self.http.get(d.url + "/health", timeout=5.0)).json()
        if health.get("paused") or health.get("sleeping"):
            return
        body = {"prompt": [0], "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"prefill_address": p.kv_address}}
        try:
            r = await self.http.post(d.url + "/v1/completions", json=body, headers=auth,
                                     timeout=timeout)
        except httpx.HTTPError as exc:
            raise APIError(f"no token through {p.url} and {d.url}: {exc!r}", 503,
                           "service_unavailable") from exc
        if r.status_code != 200:
            raise APIError(f"no token through {p.url} and {d.url}: {r.status_code} "
                           f"{r.text[:300]}", 503, "service_unavailable")

    async def health(self) -> dict:
        """ok when every instance answers its /health with 200 (checked now, which also
        updates the rotation)."""
        await asyncio.gather(*(self.check(i) for i in self.prefill + self.decode))
        down = [i.url for i in self.prefill + self.decode if not i.healthy]
        if down:
            raise APIError(f"instances down: {', '.join(down)}", 503, "service_unavailable")
        return {"status": "ok", "prefill": [i.url for i in self.prefill],
                "decode": [i.url for i in self.decode]}


def auth_header(request: Request) -> dict[str, str]:
    """The client's Authorization header (or Anthropic's x-api-key, or a dashboard's
    ?api_key=), for the instance a request is passed to."""
    key = request.headers.get("authorization")
    if key is None and "x-api-key" in request.headers:
        key = f"Bearer {request.headers['x-api-key']}"
    if key is None and "api_key" in request.query_params:
        key = f"Bearer {request.query_params['api_key']}"
    return {"authorization": key} if key is not None else {}
