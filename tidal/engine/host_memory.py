"""Freed host memory kept for reuse on CPU (glibc's malloc).

A long prompt's step makes tensors of tens to hundreds of MB (a 1B model's MLP over 2,000
tokens: 65-131 MB each, several a layer). glibc serves every allocation above 32 MB with a
fresh mmap and unmaps it when freed, so each step faults in and zeroes gigabytes of new pages
(a fifth of a 2,000-token prefill's time on a 2-core Xeon). With mmap off and the heap's
freed top kept, those tensors reuse the same pages step after step: the heap grows over the
first steps (to up to about twice a step's tensors, as the freed pieces fit the next ones)
and then stays, as with the allocators (tcmalloc, jemalloc) that CPU serving engines preload
for the same reason (tests/test_host_memory.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
KEEP_BYTES = 1 << 30  # freed memory at the heap's top that stays in the process
TOP_PAD = 64 << 20  # extra bytes each growth of the heap asks for


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to serve large allocations from its heap and keep freed memory
    (up to KEEP_BYTES at the top); False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = all(mallopt(param, value) == 1 for param, value in
               ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, KEEP_BYTES), (_M_TOP_PAD, TOP_PAD)))
    if not done:
        log.warning("mallopt refused keeping freed host memory; large step tensors fault in "
                    "fresh pages")
    return done
