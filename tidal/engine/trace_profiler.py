"""torch.profiler traces of an engine core's work, on request (`POST /start_profile`,
`POST /stop_profile`): one Chrome trace file (chrome://tracing, ui.perfetto.dev) per core
and run, in the folder `--profiler-dir` names."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

log = logging.getLogger("tidal.engine")


class TraceProfiler:
    """Records what the core process runs between `start` and `stop` (or its first
    `num_steps` steps): the steps' operators, with their shapes, on CPU (and CUDA)."""

    def __init__(self, folder: str, name: str, gpu: bool) -> None:
        self.folder, self.name, self.gpu = Path(folder), name, gpu
        self._profile: torch.profiler.profile | None = None
        self._steps_left = 0  # 0: until `stop`
        self.runs = 0  # traces written: each file's name has its number

    def start(self, num_steps: int = 0) -> None:
        """Begin a run (one already running goes on)."""
        if self._profile is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profile.start()
        self._steps_left = num_steps
        log.info("profiling %s", f"{num_steps} steps" if num_steps else "until /stop_profile")

    def stepped(self) -> None:
        """One step ran: a run of `num_steps` steps ends after its last."""
        if self._profile is not None and self._steps_left:
            self._steps_left -= 1
            if not self._steps_left:
                self.stop()

    def stop(self) -> None:
        """End the run (if one runs) and write its trace."""
        if self._profile is None:
            return
        profile, self._profile = self._profile, None
        profile.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.runs += 1  # two runs within one second keep two names
        path = self.folder / f"{self.name}-{time.strftime('%Y%m%d-%H%M%S')}-{self.runs}.json"
        part = path.with_suffix(".part")  # a reader of the folder sees whole traces only
        profile.export_chrome_trace(str(part))
        part.replace(path)
        log.info("profile written: %s", path)
