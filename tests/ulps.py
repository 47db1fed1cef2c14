"""Comparing kernels' outputs with the PyTorch ops they stand in for: bf16 in representable
steps, float32 within a tolerance."""

from __future__ import annotations

import torch


def assert_close_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int = 1,
                      tol: float = 1e-6) -> None:
    """bf16: at most `ulps` representable steps apart (bit-for-bit with 0); float32: within
    `tol`, absolute and relative."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype != torch.bfloat16:
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        return

    def ordered(x: torch.Tensor) -> torch.Tensor:  # sign-magnitude bits to a monotonic int
        i = x.view(torch.int16).int()
        return torch.where(i < 0, -32768 - i, i)

    steps = (ordered(got) - ordered(want)).abs()
    worst = steps.max().item() if steps.numel() else 0
    assert worst <= ulps, f"{worst} bf16 steps apart"
