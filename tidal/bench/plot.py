"""PNG plots of a benchmark: TTFT and TPOT CDFs, output throughput over time, and (from the
simulator) KV usage, batch size and preemptions over time."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tidal.bench.metrics import RequestResult, token_times


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    return plt


def _cdf(plt, values_ms: list[float], label: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = np.sort(np.asarray(values_ms))
    ax.plot(xs, np.arange(1, len(xs) + 1) / max(len(xs), 1))
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("share of requests")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_results(results: list[RequestResult], folder: str | Path, prefix: str = "bench",
                 series: dict[str, tuple[list[float], list[float]]] | None = None,
                 ) -> list[Path]:
    """Write the plots into `folder`; `series` maps a name to (times, values) to plot over
    time (the simulator's KV usage, batch size, preemptions). Returns the files written."""
    plt = _figure()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ok = [r for r in results if r.success]
    paths = [folder / f"{prefix}_ttft_cdf.png", folder / f"{prefix}_tpot_cdf.png",
             folder / f"{prefix}_throughput.png"]
    _cdf(plt, [r.ttft * 1000 for r in ok], "TTFT", paths[0])
    _cdf(plt, [r.tpot * 1000 for r in ok if r.tpot is not None], "TPOT", paths[1])
    times = token_times(ok)
    fig, ax = plt.subplots(figsize=(6, 4))
    if len(times):
        counts = np.bincount(times.astype(int))
        ax.plot(np.arange(len(counts)), counts)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[2])
    plt.close(fig)
    if series:
        fig, axes = plt.subplots(len(series), 1, figsize=(7, 2.2 * len(series)), sharex=True)
        for ax, (name, (ts, vs)) in zip(np.atleast_1d(axes), series.items()):
            ax.plot(ts, vs)
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
        np.atleast_1d(axes)[-1].set_xlabel("time (s)")
        fig.tight_layout()
        paths.append(folder / f"{prefix}_timeline.png")
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths
