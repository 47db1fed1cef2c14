"""A batched LoRA kernel's test case and its float64 reference (the C++ and the Triton
kernels' tests share them)."""

from __future__ import annotations

import torch

from tidal.model.lora_slots import LoRABatch


def case(seed: int, outs: list[int], k: int, rank: int, slots: int, rows: int,
         dtype: torch.dtype, wdtype: torch.dtype | None = None):
    """x, y, A [S, P rank, k], B^T [S, P rank, n] (random everywhere: part p's columns must
    read its ranks alone), and a batch of two rows in three with random slots."""
    g = torch.Generator().manual_seed(seed)
    n, parts = sum(outs), len(outs)
    x = torch.randn(rows, k, generator=g).to(dtype)
    y = torch.randn(rows, n, generator=g).to(dtype)
    wdtype = wdtype or dtype
    a = (torch.randn(slots, parts * rank, k, generator=g) / k ** 0.5).to(wdtype)
    b = torch.randn(slots, parts * rank, n, generator=g)  # the kernels read the blocks alone
    row_slots = [int(torch.randint(-1, slots, (1,), generator=g)) if i % 3 else -1
                 for i in range(rows)]
    batch = LoRABatch()
    batch.set(row_slots, slots, "cpu")
    return x, y, a, b.to(wdtype), batch, torch.tensor(outs).cumsum(0)


def reference(x, y, a, b, batch, outs) -> torch.Tensor:
    out = y.double().clone()
    if batch.rows is None:
        return out
    rank = b.shape[1] // len(outs)
    own = torch.zeros(b.shape[1:], dtype=torch.bool)  # part p's ranks x part p's columns
    for p, (c0, c1) in enumerate(zip([0, *torch.tensor(outs).cumsum(0).tolist()],
                                     torch.tensor(outs).cumsum(0).tolist())):
        own[p * rank:(p + 1) * rank, c0:c1] = True
    b = b.double() * own
    starts = [0, *batch.ends.tolist()]
    for s, (lo, hi) in enumerate(zip(starts, starts[1:])):
        for row in batch.rows[lo:hi].tolist():
            out[row] += (x[row].double() @ a[s].double().t()) @ b[s].double()
    return out


# (outs, k, rank): the fused projections' parts, input width and rank of each case
SHAPES = [([64, 32, 32], 64, 8), ([96], 160, 16), ([80, 80], 48, 4), ([70, 30], 100, 6)]
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float32, torch.bfloat16)]


def check_kernel(kernel, device: str, dtype, wdtype, outs, k, rank) -> None:
    """`kernel` (x, y, A, B^T, rows, ends, bounds) adds every row's adapter product to y, as
    the reference does, and leaves the base model's rows alone."""
    for seed in range(3):
        x, y, a, b, batch, bounds = case(seed, outs, k, rank, slots=3, rows=25, dtype=dtype,
                                         wdtype=wdtype)
        want = reference(x, y, a, b, batch, outs)
        if batch.rows is None:
            continue
        got = y.clone().to(device)
        kernel(x.to(device), got, a.to(device), b.to(device), batch.rows.to(device),
               batch.ends.to(device), bounds.to(device))
        tol = 1e-4 if dtype == torch.float32 else 2e-2  # the reference takes the weights' bits
        torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=tol)
        untouched = [i for i in range(25) if i not in batch.rows.tolist()]
        assert torch.equal(got.cpu()[untouched], y[untouched])  # base-model rows stay
