"""A step's integer inputs in buffers that outlive the step.

Each field (token ids, positions, cache slots, logits rows, decode tables and lengths) has
one host tensor, pinned on CUDA, and a device twin. A step fills the host buffer in place
and copies it without a sync, so a GPU step allocates no input tensors and never waits on
its own inputs; on CPU the host buffer is the device tensor."""

from __future__ import annotations

import torch


class StepInputs:
    """Grow-only buffers by field name; `put` returns the device view of this step's values.
    `begin()` before a step's first `put`: a buffer is refilled only once the copies out of
    it (issued by the previous step) are done."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._host: dict[str, torch.Tensor] = {}
        self._dev: dict[str, torch.Tensor] = {}
        self._copied = torch.cuda.Event() if self.cuda else None
        self._pending = False

    def begin(self) -> None:
        if self._pending and not self._copied.query():  # a pass of the same step, say
            self._copied.synchronize()
        self._pending = False

    def end(self) -> None:
        """After a step's last `put`: mark where its copies end on the stream."""
        if self.cuda:
            self._copied.record()
            self._pending = True

    def put(self, name: str, values: list, width: int = 0) -> torch.Tensor:
        """`values` (ints) on the device: [len] or, with `width`, rows of that width
        [len // width, width] from a flat list."""
        n = len(values)
        host = self._buffer(name, n)
        host.numpy()[:n] = values  # numpy fills from a list without a temporary tensor
        if self.cuda:
            out = self._dev[name][:n]
            out.copy_(host[:n], non_blocking=True)
        else:
            out = host[:n]
        return out.view(-1, width) if width else out

    def _buffer(self, name: str, n: int) -> torch.Tensor:
        host = self._host.get(name)
        if host is None or host.numel() < n:
            size = max(n, 256, 2 * (host.numel() if host is not None else 0))
            # A replaced pinned buffer is freed only after its pending copy: torch's caching
            # host allocator records the stream that used it.
            self._host[name] = host = torch.empty(size, dtype=torch.long,
                                                  pin_memory=self.cuda)
            if self.cuda:
                self._dev[name] = torch.empty(size, dtype=torch.long, device=self.device)
        return host
