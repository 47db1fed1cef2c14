"""The live scheduler dashboard: `GET /dashboard` (one self-contained page) and
`GET /dashboard/stream` (Server-Sent Events, one event per engine-core report).

While at least one page is open, the frontend asks the cores (a `Watch` message) to add a
`SchedulerView` to the stats they send twice a second; every report becomes one event for
every open page. The cores build one view per report whatever the number of pages, and
none while nobody watches. The same page replays a simulation's recorded frames
(`replay_html`, written by `tidal simulate --dashboard out.html`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from pathlib import Path
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from tidal.core.snapshot import dashboard_frame
from tidal.engine import messages as m

_STATIC = Path(__file__).parent / "static"
_QUEUE = 64  # events a slow page may fall behind before it misses some


def page_html(frames: list[dict] | None = None, title: str = "tidal") -> str:
    """The dashboard page with its script, styles and charting library inlined: live (it
    connects to /dashboard/stream) or, given `frames`, a replay of them."""
    html = (_STATIC / "dashboard.html").read_text()
    data = "null" if frames is None else json.dumps(frames, separators=(",", ":"))
    parts = {"TITLE": title, "UPLOT_CSS": (_STATIC / "uPlot.min.css").read_text(),
             "UPLOT_JS": (_STATIC / "uPlot.iife.min.js").read_text(),
             "DASHBOARD_JS": (_STATIC / "dashboard.js").read_text(),
             "FRAMES": data.replace("</", "<\\/")}  # no "</script>" inside the data
    for key, value in parts.items():
        html = html.replace("{{" + key + "}}", value)
    return html


def frame(stats: m.Stats, cores: int, model: str, latency: list, slo: dict) -> dict:
    """One event from a core's report: its counters (what /metrics reports) and view."""
    counters = {"prompt_tokens": stats.prompt_tokens,
                "generation_tokens": stats.generation_tokens,
                "execute_seconds": stats.execute_seconds, "step_seconds": stats.step_seconds}
    return dashboard_frame(stats.core, cores, model, {**asdict(stats.scheduler), **counters},
                           stats.view, latency, slo)


class DashboardHub:
    """The open pages: each gets the cores' reports as events; the cores are told how many
    pages watch when that changes between none and some."""

    def __init__(self, client, metrics, model: str) -> None:
        self.client, self.metrics, self.model = client, metrics, model
        self.pages: set[asyncio.Queue] = set()
        self.latency_sent = 0.0  # finish time of the last latency sample sent
        sched = client.config.scheduler
        ttft, tpot = sched.policy_class.latency_targets(sched.policy_options)
        self.slo = {"ttft_ms": ttft, "tpot_ms": tpot}
        client.on_stats = self.on_stats

    def _tell_cores(self) -> None:
        self.client.broadcast(m.Watch(len(self.pages)))

    def on_stats(self, stats: m.Stats) -> None:
        if not self.pages or stats.view is None:
            return
        new = [list(r) for r in self.metrics.recent if r[0] > self.latency_sent]
        if new:
            self.latency_sent = new[-1][0]
        event = frame(stats, self.client.num_cores, self.model, new, self.slo)
        data = f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
        for page in self.pages:
            if page.full():  # a page that cannot keep up drops its oldest event
                page.get_nowait()
            page.put_nowait(data)

    async def events(self) -> AsyncIterator[str]:
        page: asyncio.Queue = asyncio.Queue(_QUEUE)
        self.pages.add(page)
        if len(self.pages) == 1:
            self._tell_cores()
        try:
            yield ": tidal dashboard\n\n"  # the stream is open
            while True:
                yield await page.get()
        finally:
            self.pages.discard(page)
            if not self.pages:
                self._tell_cores()


routes = APIRouter()


@routes.get("/dashboard", response_class=HTMLResponse)
async def dashboard(request: Request):
    f = request.app.state.frontend
    return HTMLResponse(page_html(title=f"tidal: {f.config.model_name}"))


@routes.get("/favicon.ico", include_in_schema=False)
async def favicon() -> Response:
    """The page has no icon: a 204, not a 404 in the browser's console."""
    return Response(status_code=204)


@routes.get("/dashboard/stream")
async def dashboard_stream(request: Request):
    hub: DashboardHub = request.app.state.frontend.dashboard
    return StreamingResponse(hub.events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
