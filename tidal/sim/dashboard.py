"""Dashboard frames of a simulation: every `interval` seconds of simulated time, each
replica's stats and scheduler view, in the live dashboard's event format, so that the same
page replays them (`tidal simulate --dashboard out.html`)."""

from __future__ import annotations

from dataclasses import asdict

from tidal.core.snapshot import StepHistory, dashboard_frame, scheduler_view

MAX_STEPS = 64  # steps kept a frame (evenly picked): an hour's trace runs ~400k steps


class DashboardRecorder:
    """Collects frames while a Simulator runs; attach before `run()`."""

    def __init__(self, interval: float, model: str, slo: dict) -> None:
        self.interval, self.model, self.slo = interval, model, slo
        self.frames: list[dict] = []
        self.latency: list[list] = []  # (finish time, TTFT, TPOT) since the last frame
        self.next_time = 0.0
        self.last_step: dict[int, float] = {}  # replica -> time of its last step shown

    def attach(self, replicas: list) -> None:
        for r in replicas:
            r.history = StepHistory(size=1 << 16)

    def finished(self, now: float, ttft: float, tpot: float | None) -> None:
        self.latency.append([now, ttft, tpot])

    def maybe_record(self, now: float, replicas: list) -> None:
        if now < self.next_time:
            return
        self.next_time = now + self.interval
        for i, r in enumerate(replicas):
            s = r.scheduler
            view = scheduler_view(s, r.history, self.last_step.get(i, -1.0), limit=16,
                                  max_cells=2048)
            if view.steps:
                self.last_step[i] = view.steps[-1].time
                stride = -(-len(view.steps) // MAX_STEPS)
                view.steps = view.steps[::stride]
            stats = {**asdict(s.stats()), "prompt_tokens": r.history.prefill_total,
                     "generation_tokens": r.generated}
            latency, self.latency = (self.latency, []) if i == 0 else ([], self.latency)
            self.frames.append(dashboard_frame(i, len(replicas), self.model, stats, view,
                                               latency, self.slo))
