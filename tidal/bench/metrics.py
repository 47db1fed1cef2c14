"""What a benchmark measured, per request, and its summary under the same JSON keys as
`vllm bench serve` (so its tooling reads tidal's results), plus the vLLM-style text report.

Shared by `tidal bench serve` (real clocks) and `tidal simulate` (the virtual clock)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
METRICS = ("ttft", "tpot", "itl", "e2el")  # what --percentile-metrics may name
PERCENTILES = (50, 90, 99)  # the default --metric-percentiles


@dataclass
class RequestResult:
    """One request's timings, in seconds from the benchmark's start."""

    prompt_len: int
    output_len: int = 0  # tokens generated (the server's usage where it reports it)
    start: float = 0.0  # when it was sent
    ttft: float = 0.0  # time to the first token, from `start`
    itl: list[float] = field(default_factory=list)  # gaps between later token chunks
    latency: float = 0.0  # start to last token
    success: bool = False
    error: str = ""
    text: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for one-token outputs."""
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in "
                             f"{', '.join(GOODPUT_METRICS)}; got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be positive")
    return slos


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(values[k] * 1000 <= v for k, v in slos.items())


def percentile_name(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9": the name in a key (p99.9_ttft_ms) and the report."""
    return f"{p:g}"


def _stats(prefix: str, values_s: list[float], out: dict,
           percentiles: tuple[float, ...]) -> None:
    ms = np.asarray(values_s, dtype=float) * 1000 if values_s else np.zeros(1)
    out[f"mean_{prefix}_ms"] = float(ms.mean())
    out[f"median_{prefix}_ms"] = float(np.median(ms))
    out[f"std_{prefix}_ms"] = float(ms.std())
    for p in percentiles:
        out[f"p{percentile_name(p)}_{prefix}_ms"] = float(np.percentile(ms, p))


def token_times(results: list[RequestResult]) -> np.ndarray:
    """Every output chunk's time (s from the start), for throughput over time."""
    times = []
    for r in results:
        if r.success and r.output_len:
            times.append(r.start + r.ttft + np.concatenate(([0.0], np.cumsum(r.itl))))
    return np.sort(np.concatenate(times)) if times else np.zeros(0)


def summarize(results: list[RequestResult], duration: float,
              slos: dict[str, float] | None = None,
              percentiles: tuple[float, ...] = PERCENTILES) -> dict:
    """The vLLM keys: counts, throughputs, each metric's mean, median, std and
    `percentiles` in ms."""
    ok = [r for r in results if r.success]
    duration = max(duration, 1e-9)
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    out: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": (sum(_meets(r, slos) for r in ok) / duration) if slos else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    _stats("ttft", [r.ttft for r in ok], out, percentiles)
    _stats("tpot", [r.tpot for r in ok if r.tpot is not None], out, percentiles)
    _stats("itl", [x for r in ok for x in r.itl], out, percentiles)
    _stats("e2el", [r.latency for r in ok], out, percentiles)
    times = token_times(ok)
    if len(times):  # vLLM's peak: the most output tokens in any one-second bin
        out["max_output_tokens_per_s"] = float(np.bincount(times.astype(int)).max())
    out.update({
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
    })
    return out


_LABELS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def format_report(result: dict, title: str = "Serving Benchmark Result",
                  metrics: tuple[str, ...] = METRICS,
                  percentiles: tuple[float, ...] = PERCENTILES) -> str:
    """The summary as `vllm bench serve` prints it: of each of `metrics`, its mean, median
    and `percentiles` (the median's row stands for the 50th)."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<42}{text:>18}")

    generates = result["total_output_tokens"] or set(metrics) - {"e2el"}  # not embeddings
    row("Successful requests:", result["completed"])
    if result.get("failed"):
        row("Failed requests:", result["failed"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    if generates:
        row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    if generates:
        row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    spec = result.get("spec_decode")
    if spec:
        lines.append(f"{'Speculative Decoding':-^60}")
        row("Verifications:", int(spec["drafts"]))
        row("Acceptance rate (%):", 100 * spec["acceptance_rate"])
        row("Mean accepted length (tokens):", spec["mean_accepted_length"])
    for m in metrics:
        lines.append(f"{_LABELS[m]:-^60}")
        name = m.upper()
        row(f"Mean {name} (ms):", result[f"mean_{m}_ms"])
        row(f"Median {name} (ms):", result[f"median_{m}_ms"])
        for p in (percentile_name(p) for p in percentiles if p != 50):
            row(f"P{p} {name} (ms):", result[f"p{p}_{m}_ms"])
    lines.append("=" * 60)
    return "\n".join(lines)
