"""new_token_ratio: the share of running requests' remaining output that admission reserves."""

from __future__ import annotations

from typing import Iterable

from tidal.core.config import SchedulerConfig
from tidal.core.request import Request


class NewTokenRatio:
    """Starts high (cautious), decays linearly over decode-only steps as requests show they
    finish, jumps back up after a retraction, and resets when the engine is idle."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.init = config.init_new_token_ratio
        self.min = config.init_new_token_ratio * config.min_new_token_ratio_factor
        self.step = (self.init - self.min) / config.new_token_ratio_decay_steps
        self.retract_decode_steps = config.retract_decode_steps
        self.clip = config.clip_max_new_tokens
        self.value = self.init

    def decay(self) -> None:
        self.value = max(self.min, self.value - self.step)

    def reset(self) -> None:
        self.value = self.init

    def reserved_tokens(self, requests: Iterable[Request]) -> float:
        """Tokens admission keeps aside for these requests' future output: each one's
        remaining max_tokens, clipped to clip_max_new_tokens, times the ratio."""
        clip, total = self.clip, 0
        for r in requests:
            left = r.max_tokens - len(r.output_token_ids)
            total += left if left < clip else clip
        return total * self.value

    def after_retract(self, running: Iterable[Request]) -> None:
        """Recompute from the requests still decoding: how far they are towards max_tokens,
        with `retract_decode_steps` more tokens assumed for each."""
        if self.init == 0:
            return  # reservation is off (the vLLM-style baseline) and stays off
        running = list(running)
        generated = sum(len(r.output_token_ids) for r in running)
        budget = sum(r.max_tokens for r in running)
        self.value = min(1.0, (generated + self.retract_decode_steps * len(running)) / (budget + 1))
