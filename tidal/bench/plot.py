"""PNG plots of a benchmark: TTFT and TPOT CDFs, output throughput over time, and (from the
simulator) KV usage, batch size and preemptions over time. Every plot has a title naming
its source, axis labels with units and a legend; `figures` builds them (tested for that),
`plot_results` writes them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tidal.bench.metrics import RequestResult, token_times

# The simulator's timeline series: y-axis label with its unit.
SERIES_LABELS = {"kv_usage": "KV cache in use (share of blocks)", "running": "running (requests)",
                 "waiting": "waiting (requests)", "preemptions": "retractions (cumulative)"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:  # an optional extra: say which
        raise SystemExit("plots need matplotlib: pip install 'tidal[plots]'") from None

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    return plt


def _cdf(plt, values_ms: list[float], what: str, source: str):
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = np.sort(np.asarray(values_ms))
    ax.plot(xs, np.arange(1, len(xs) + 1) / max(len(xs), 1), label=f"{len(xs)} requests")
    for q, style in ((50, "--"), (99, ":")):
        if len(xs):
            value = float(np.percentile(xs, q))
            ax.axvline(value, color="gray", linestyle=style, label=f"p{q} {value:.1f} ms")
    ax.set_title(f"{source}: {what}, cumulative distribution")
    ax.set_xlabel(f"{what} (ms)")
    ax.set_ylabel("share of requests (0-1)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def figures(results: list[RequestResult], source: str,
            series: dict[str, tuple[list[float], list[float]]] | None = None) -> dict:
    """name -> matplotlib Figure: ttft_cdf, tpot_cdf, throughput and (with `series`, the
    simulator's timeline) timeline. `source` titles them ("tidal bench", "tidal simulate")."""
    plt = _pyplot()
    ok = [r for r in results if r.success]
    figs = {"ttft_cdf": _cdf(plt, [r.ttft * 1000 for r in ok], "time to first token", source),
            "tpot_cdf": _cdf(plt, [r.tpot * 1000 for r in ok if r.tpot is not None],
                             "time per output token", source)}
    times = token_times(ok)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if len(times):
        counts = np.bincount(times.astype(int))
        ax.plot(np.arange(len(counts)), counts, label="per second", alpha=0.6)
        window = min(10, len(counts))
        ax.plot(np.arange(len(counts)), np.convolve(counts, np.ones(window) / window, "same"),
                label=f"{window} s average")
    ax.set_title(f"{source}: output throughput")
    ax.set_xlabel("time since the first request (s)")
    ax.set_ylabel("output tokens/s")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    figs["throughput"] = fig
    if series:
        fig, axes = plt.subplots(len(series), 1, figsize=(7, 2.3 * len(series) + 0.6),
                                 sharex=True)
        for ax, (name, (ts, vs)) in zip(np.atleast_1d(axes), series.items()):
            ax.plot(ts, vs, label=name)
            ax.set_ylabel(SERIES_LABELS.get(name, name), fontsize=8)
            ax.legend(loc="upper right", fontsize=8)
            ax.grid(alpha=0.3)
        np.atleast_1d(axes)[-1].set_xlabel("simulated time (s)")
        fig.suptitle(f"{source}: scheduler state over time")
        fig.tight_layout()
        figs["timeline"] = fig
    return figs


def plot_results(results: list[RequestResult], folder: str | Path, prefix: str = "bench",
                 series: dict[str, tuple[list[float], list[float]]] | None = None,
                 ) -> list[Path]:
    """Write the plots into `folder` as {prefix}_{name}.png; `series` maps a name to
    (times, values) to plot over time (the simulator's KV usage, batch size, preemptions).
    Returns the files written."""
    plt = _pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    source = {"bench": "tidal bench serve", "sim": "tidal simulate"}.get(prefix, prefix)
    paths = []
    for name, fig in figures(results, source, series).items():
        paths.append(folder / f"{prefix}_{name}.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
