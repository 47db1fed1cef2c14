"""The live dashboard: a scheduler's view agrees with its stats; over a real data-parallel
server behind an API key, the stream's events carry the engine's counters (the tokens the
answers got, the figures of /metrics), the page and its stream refuse requests without the
key, and a real browser (Debian's chromium, driven by Playwright) renders one panel per core
with the queues and block counts of the stream; a simulation's dashboard replays in the
browser from one self-contained file."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import add, make_scheduler, step
from server_fixtures import Server
from tidal.core.snapshot import CACHED, FREE, SHARED, USED, StepHistory, scheduler_view

KEY = "dash-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


# ---------------------------------------------------------------------- the view


@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.booleans()),
                min_size=1, max_size=12), st.integers(0, 30), st.integers(1, 7))
def test_view_agrees_with_the_scheduler_stats(requests, steps, max_cells):
    """Queues and exact block counts equal stats() after any run; a cell shows the busiest
    state of its blocks; the history hands each step to one view only."""
    s = make_scheduler(num_blocks=24, block_size=4)
    history = StepHistory()
    shared = list(range(900, 908))  # two blocks every request flagged True starts with
    for i, (length, max_tokens, share) in enumerate(requests):
        add(s, f"r{i}", shared + list(range(1000 * i, 1000 * i + length)) if share else length,
            max_tokens)
    last = -1.0
    for t in range(steps):
        out, _ = step(s)
        history.record(out, 0.01, float(t))
        if t % 4 == 3:  # a view every few steps: each takes the steps since the last one
            seen = scheduler_view(s, history, last).steps
            assert [x.time for x in seen] == [float(x) for x in range(int(last) + 1, t + 1)]
            last = float(t)
    stats = s.stats()
    view = scheduler_view(s, history, last, max_cells=max_cells)
    assert view.queues == {"waiting": stats.waiting, "preempted": stats.preempted,
                           "transferring": stats.transferring,
                           "prefill": stats.running_prefill, "decode": stats.running_decode}
    counts = view.block_counts
    assert counts[USED] + counts[SHARED] == stats.used_blocks
    assert counts[FREE] + counts[CACHED] == stats.free_blocks
    blocks = s.kv.pool.blocks
    per = view.blocks_per_cell
    assert len(view.blocks) == -(-len(blocks) // per) <= max_cells
    for i, cell in enumerate(view.blocks):
        group = blocks[i * per:(i + 1) * per]
        assert (cell == SHARED) == any(b.ref_cnt > 1 for b in group)
        assert (cell == FREE) == all(b.ref_cnt == 0 and b.block_hash is None for b in group)
    listed = {r.id: r for r in view.requests}
    for r in s.requests.values():
        assert listed[r.request_id].output_tokens == len(r.output_token_ids)


# ---------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server("--data-parallel-size", "2", "--api-key", KEY,
               "--kv-cache-dir", str(tmp_path_factory.mktemp("kv")))  # the tier's chart too
    yield s
    s.stop()


class Load:
    """Requests in background threads until stopped; `answers` holds each one's (HTTP status,
    completion tokens)."""

    def __init__(self, url: str, threads: int = 3) -> None:
        self.url, self.running = url, True
        self.answers: list[tuple[int, int]] = []
        self.threads = [threading.Thread(target=self._run) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        with httpx.Client(timeout=120, headers=AUTH) as c:
            while self.running:
                r = c.post(self.url + "/v1/completions",
                           json={"prompt": "the tide comes in " * 8, "max_tokens": 24})
                tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
                self.answers.append((r.status_code, tokens))

    def stop(self) -> None:
        self.running = False
        for t in self.threads:
            t.join()


def events(url: str, count: int):
    """The first `count` events of the dashboard stream."""
    with httpx.stream("GET", url + "/dashboard/stream", headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield json.loads(line[len("data: "):])
                count -= 1
                if not count:
                    return


def test_the_page_and_its_stream_need_the_api_key(server):
    for path in ("/dashboard", "/dashboard/stream"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(server.url + path + "?api_key=wrong").status_code == 401
    page = httpx.get(server.url + f"/dashboard?api_key={KEY}")
    assert page.status_code == 200 and "uPlot" in page.text and "EventSource" in page.text
    assert httpx.get(server.url + "/dashboard", headers=AUTH).status_code == 200


def test_docs_and_internals_need_the_key_and_the_log_keeps_it_secret(server):
    """A keyed server's schema and doc pages need the key (the pages also as ?api_key=, their
    schema URL carrying it on); /health tells the core's pid only to a caller with the key;
    the access log prints ?api_key= as [redacted]."""
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(server.url + path).status_code == 401, path
        assert httpx.get(server.url + path, headers=AUTH).status_code == 200, path
    assert "/v1/chat/completions" in httpx.get(server.url + f"/openapi.json?api_key={KEY}").text
    page = httpx.get(server.url + f"/docs?api_key={KEY}")
    assert page.status_code == 200 and f"/openapi.json?api_key={KEY}" in page.text
    open_health = httpx.get(server.url + "/health").json()
    assert open_health["status"] == "ok" and "engine_core_pid" not in open_health
    assert httpx.get(server.url + "/health", headers=AUTH).json()["engine_core_pid"] > 0
    httpx.get(server.url + f"/dashboard?api_key={KEY}")
    log = server.output()
    assert "/dashboard?api_key=[redacted]" in log and f"api_key={KEY}" not in log


def test_the_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from tidal.server.config import HttpConfig

    monkeypatch.delenv("TIDAL_API_KEY", raising=False)
    assert HttpConfig().key is None
    monkeypatch.setenv("TIDAL_API_KEY", "from-env")
    assert HttpConfig().key == "from-env"
    assert HttpConfig(api_key="flag").key == "flag"  # the flag wins
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nignored\n")
    assert HttpConfig(api_key_file=str(key_file)).key == "from-file"
    with pytest.raises(ValueError, match="not both"):
        HttpConfig(api_key="flag", api_key_file=str(key_file))
    with pytest.raises(ValueError, match="missing.*No such file"):
        HttpConfig(api_key_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="holds no key"):
        HttpConfig(api_key_file=str(tmp_path / "empty"))


METRICS = {  # /metrics name -> (stats field, how /metrics merges the cores)
    "tidal:generation_tokens_total": ("generation_tokens", sum),
    "tidal:num_steps_total": ("num_steps", max),
    "tidal:kv_cache_used_blocks": ("used_blocks", sum),
    "tidal:num_requests_waiting": ("waiting", sum),
}


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {name: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            for name in METRICS if line.startswith(name + "{")}


class Reports:
    """The dashboard stream, read one event at a time; `latest`: each core's last counters."""

    def __init__(self, stream) -> None:
        self.stream, self.latest = stream, {}

    def next(self) -> dict:
        event = next(self.stream)
        assert event["cores"] == 2 and event["view"] is not None
        self.latest[event["core"]] = event["stats"]
        return event

    def merged(self) -> dict[str, float]:
        """The /metrics figures the cores' latest reports make."""
        return {name: merge(self.latest[c][field] for c in (0, 1))
                for name, (field, merge) in METRICS.items()}

    def settled(self) -> dict[str, float]:
        """The merged figures once each core has sent two more reports that leave them be."""
        for _ in range(100):
            while len(self.latest) < 2:
                self.next()
            figures, repeats = self.merged(), {0: 0, 1: 0}
            while min(repeats.values()) < 2:
                repeats[self.next()["core"]] += 1
                if self.merged() != figures:
                    break
            else:
                return figures
        raise AssertionError(f"the cores' counters never came to rest: {self.latest}")


def test_stream_reports_are_the_engines_counters(server):
    """Over a load, every event's view agrees with its own counters and no core's counters
    go back. With the cores at rest before and after the load (nothing left to change a
    counter, so no reading races another), the stream's tokens generated in between are the
    tokens the answers got, and its latest report of each core, merged, is /metrics."""
    with contextlib.closing(events(server.url, 10**6)) as stream:
        reports = Reports(stream)
        reports.settled()
        before = {c: stats["generation_tokens"] for c, stats in reports.latest.items()}
        load = Load(server.url)
        try:
            for _ in range(40):
                last = dict(reports.latest)
                event = reports.next()
                stats, view = event["stats"], event["view"]
                assert view["queues"]["waiting"] == stats["waiting"]
                assert view["queues"]["decode"] == stats["running_decode"]
                assert view["block_counts"]["u"] + view["block_counts"]["s"] == \
                    stats["used_blocks"]
                for field in ("generation_tokens", "prompt_tokens", "num_steps"):
                    assert stats[field] >= last[event["core"]][field], field
                # steps are sized by time here (a CPU): each that computes carries its
                # predicted seconds (an idle step of disk-tier stores computes nothing)
                assert all(s["predicted"] > 0 for s in view["steps"]
                           if s["prefill_tokens"] + s["decode_tokens"])
        finally:
            load.stop()
        assert load.answers and all(status == 200 for status, _ in load.answers)
        answered = sum(tokens for _, tokens in load.answers)
        figures = reports.settled()
        generated = sum(reports.latest[c]["generation_tokens"] - before[c] for c in (0, 1))
        assert generated == answered > 0
        metrics = scrape(server.url)
        assert reports.settled() == figures  # still at rest after the scrape: it raced nothing
        assert metrics == figures
        assert figures["tidal:kv_cache_used_blocks"] == figures["tidal:num_requests_waiting"] == 0


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (make test installs Debian's "
                                               "package where apt-get and root allow)")
def test_a_browser_renders_a_panel_per_core_from_the_stream(server):
    """The page, loaded in chromium while requests run, shows a panel per core whose queue
    and block counters are those of that core's last event; a screenshot is saved."""
    playwright = pytest.importorskip("playwright.sync_api")
    load = Load(server.url)
    try:
        with playwright.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            page.goto(server.url + f"/dashboard?api_key={KEY}")
            for core in (0, 1):
                page.wait_for_selector(f"#core-{core} tr.req", timeout=30000)
            assert page.inner_text("#status") == "live"
            # One script turn reads the DOM and the frames it was drawn from (the page keeps
            # each core's last one): nothing renders in between.
            shown, frames = page.evaluate("""() => [[...document.querySelectorAll('.core')].map(
                p => ({
                index: Number(p.dataset.index),
                queues: Object.fromEntries(['waiting', 'prefill', 'decode', 'preempted',
                    'transferring'].map(q => [q, Number(p.querySelector('.queue-' + q).textContent)])),
                blocks: Object.fromEntries(['.', 'c', 'u', 's'].map((code, i) => [code,
                    Number(p.querySelector('.blocks-' + ['free', 'cached', 'used', 'shared'][i])
                           .textContent)])),
                rows: [...p.querySelectorAll('tr.req')].map(r => r.firstChild.textContent),
            })), window.tidalLast]""")
            # the charts' legends show the latest values (uPlot's own show "--" off the cursor)
            legend = page.evaluate("() => [...document.querySelectorAll('.core .u-legend "
                                   ".u-value')].map(e => e.textContent)")
            titles = page.evaluate("() => [...document.querySelectorAll('.core')].map(p => "
                                   "[...p.querySelectorAll('.u-title')].map(e => e.textContent))")
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard-live.png"), full_page=True)
            browser.close()
    finally:
        load.stop()
    assert legend and "--" not in legend
    assert all("KV tier" in core for core in titles)  # --kv-cache-dir: each core's tier
    assert sum(v not in ("-", "0") for v in legend) >= 4  # ratios, usage, rates: numbers
    assert [p["index"] for p in shown] == [0, 1]  # one panel per core, in order
    for p in shown:
        view = frames[str(p["index"])]["view"]
        assert p["queues"] == view["queues"]
        assert p["blocks"] == view["block_counts"]
        assert sum(p["blocks"].values()) == 256  # --num-kv-blocks: every block accounted
        assert p["rows"] == [r["id"] for r in view["requests"]]
    assert (ARTIFACTS / "dashboard-live.png").stat().st_size > 10_000


# ---------------------------------------------------------------------- replay


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    """A small simulation's dashboard page and saved result."""
    from tidal.cli import run

    out = tmp_path_factory.mktemp("replay")
    page, saved = out / "sim.html", out / "sim.json"
    result = run(["simulate", "--dataset", "random", "--num-prompts", "60",
                  "--request-rate", "20", "--random-input-len", "256",
                  "--random-output-len", "64", "--num-kv-blocks", "600",
                  "--data-parallel-size", "2", "--policy", "slo", "--ttft-slo-ms", "200",
                  "--lora-modules", "a", "b", "c", "--max-loras", "2",
                  "--dashboard", str(page), "--dashboard-interval", "0.25",
                  "--save-result", str(saved)])
    return page, saved, result


def test_a_simulation_writes_a_self_contained_replay(replay):
    page, saved, result = replay
    html = page.read_text()
    assert "<script src" not in html and "<link" not in html  # nothing fetched
    frames = json.loads(saved.read_text())["dashboard_frames"]
    assert frames == result["dashboard_frames"] and len(frames) >= 8
    assert {f["core"] for f in frames} == {0, 1} and all(f["cores"] == 2 for f in frames)
    times = [f["view"]["time"] for f in frames if f["core"] == 0]
    assert times == sorted(times) and times[-1] - times[0] >= 0.25 * (len(times) - 2)
    finished = sum(len(f["latency"]) for f in frames)
    assert 0 < finished <= 60
    assert frames[-1]["slo"] == {"ttft_ms": 200.0, "tpot_ms": None}
    last = {f["core"]: f for f in frames}
    generated = sum(f["stats"]["generation_tokens"] for f in last.values())
    assert generated <= 60 * 64 and generated >= 64 * finished // 2
    for f in frames:  # exact block counts add up to each replica's pool
        assert sum(f["view"]["block_counts"].values()) == 600


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here")
def test_the_replay_plays_in_a_browser(replay):
    page_path, _, result = replay
    frames = result["dashboard_frames"]
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1400})
        page.goto(page_path.as_uri())
        page.wait_for_selector("#core-1")
        assert page.get_attribute("#scrub", "max") == str(len(frames) - 1)
        # a frame where core 0 runs requests of adapters: its LoRA slots line shows them
        at = next(i for i in range(len(frames) // 2, len(frames))
                  if frames[i]["core"] == 0 and frames[i]["stats"]["running_loras"])
        page.fill("#scrub", str(at))
        page.dispatch_event("#scrub", "input")
        lora = page.evaluate("() => [...document.querySelectorAll('#core-0 .lora b')]"
                             ".map(e => e.textContent)")
        page.fill("#scrub", str(len(frames) - 1))  # to the end
        page.dispatch_event("#scrub", "input")
        decode = page.evaluate("() => [0, 1].map(c => Number(document.querySelector("
                               "`#core-${c} .queue-decode`).textContent))")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-replay.png"), full_page=True)
        browser.close()
    last = {f["core"]: f for f in frames}
    assert decode == [last[c]["view"]["queues"]["decode"] for c in (0, 1)]
    stats = frames[at]["stats"]
    running = stats["running_loras"]
    assert 1 <= len(running) <= 2 and stats["max_loras"] == 2
    assert lora == [f"{', '.join(running)} ({len(running)} of 2)",
                    ", ".join(stats["waiting_loras"]) or "none"]


# ---------------------------------------------------------------------- plots


def test_benchmark_and_simulator_plots_are_labelled():
    """Every plot of `tidal bench serve --plot` and `tidal simulate --plot` has a title
    naming its source, axis labels with units, and a legend on every axes with data."""
    import matplotlib.pyplot as plt

    from tidal.bench.metrics import RequestResult
    from tidal.bench.plot import figures

    results = [RequestResult(100, 20, start=i * 0.5, ttft=0.1 + 0.01 * i, itl=[0.02] * 19,
                             latency=0.5, success=True) for i in range(40)]
    series = {"kv_usage": ([0, 1, 2], [0.1, 0.5, 0.2]), "running": ([0, 1, 2], [1, 4, 2])}
    figs = figures(results, "tidal simulate", series)
    assert set(figs) == {"ttft_cdf", "tpot_cdf", "throughput", "timeline"}
    for name, fig in figs.items():
        title = fig._suptitle.get_text() if fig._suptitle else fig.axes[0].get_title()
        assert title.startswith("tidal simulate: "), name
        for ax in fig.axes:
            assert ax.get_ylabel(), name
            assert ax.get_legend() is not None and ax.get_legend().get_texts(), name
        xlabel = fig.axes[-1].get_xlabel()
        assert "(" in xlabel and xlabel.endswith(")"), (name, xlabel)  # a unit
        plt.close(fig)
    p50 = [t.get_text() for t in figs["ttft_cdf"].axes[0].get_legend().get_texts()]
    assert "p50 295.0 ms" in p50  # the median TTFT of 0.1 + 0.01 i, i < 40
