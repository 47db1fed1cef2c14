"""Triton kernels for the GPU path (optional: `pip install tidal[gpu]`). Each takes the same
arguments and layouts as the PyTorch or C++ code it stands in for, and equals it: the tests
run the kernels under `TRITON_INTERPRET=1` on CPU tensors."""


def paged_decode_kernel():
    """Triton's paged decode attention, or None where triton is not installed."""
    try:
        from tidal.model.kernels.paged_attention import paged_decode_attention
    except ImportError:
        return None
    return paged_decode_attention
