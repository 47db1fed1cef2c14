"""Freed host memory kept for reuse (tidal.engine.host_memory, the engine's
`reuse_host_memory`): a step's large tensors, freed and made again, reuse pages instead of
faulting in fresh ones. Each case runs in a process of its own, whose malloc it changes."""

from __future__ import annotations

import ctypes.util
import json
import platform
import subprocess
import sys

import pytest

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="glibc's mallopt")

CHILD = """
import json, resource, sys
import psutil, torch
from tidal.engine.host_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def step():  # a prefill step's large tensors (glibc mmaps anything past 32 MiB by default)
    big, mid, small, other = (torch.ones(n) for n in (96 << 18, 33 << 18, 1000, 70 << 18))
    del big, mid, other
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):  # the heap grows to hold a step, in pieces as they come
    step()
before, rss = faults(), psutil.Process().memory_info().rss
for _ in range(20):
    step()
print(json.dumps({"kept": kept, "faults": faults() - before,
                  "grown": psutil.Process().memory_info().rss - rss}))
"""


def run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@glibc
def test_a_steps_tensors_reuse_their_pages():
    """Steps of 199 MiB of tensors: each faults in ~51k fresh pages with glibc's defaults (a
    fresh mmap a tensor); once freed memory is kept, the heap grows over the first steps
    and later ones fault nothing new, the resident memory no longer growing."""
    default, kept = run("default"), run("keep")
    assert kept["kept"] is True
    pages = 20 * (199 << 20) // 4096
    assert default["faults"] > pages // 2, default
    assert kept["faults"] < pages // 100, kept
    assert kept["grown"] < 8 << 20, kept


def test_no_glibc_is_no_error(monkeypatch):
    """Where the C library has no mallopt the call says so and changes nothing."""
    from tidal.engine import host_memory

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libdoes-not-exist.so")
    assert host_memory.keep_freed_memory() is False
