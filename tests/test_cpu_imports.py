"""A CPU engine never imports triton: only CUDA runs tidal's Triton kernels, and a triton
imported for nothing prints nanobind's "leaked instances" warnings at every exit. The HTTP
frontend imports no torch at all."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

# tidal generate on the CPU and the server's modules; torch._dynamo would import triton.
CODE = """
import sys
from tidal.cli import run
run(["generate", "--device", "cpu", "--max-tokens", "3", "--temperature", "0", "hi"])
import tidal.server.api, tidal.engine.model_runner, tidal.model.llama
print("IMPORTED", sorted(m for m in sys.modules if m.split(".")[0] == "triton"
                         or m.startswith("torch._dynamo")))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed: nothing could import it")
def test_cpu_generate_imports_no_triton_and_warns_of_no_leaks():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[3 tokens, length]" in proc.stdout  # it did generate
    assert "IMPORTED []" in proc.stdout, proc.stdout[-2000:]
    assert "leaked" not in proc.stderr, proc.stderr[-2000:]


def test_the_http_frontend_loads_no_torch():
    """`tidal serve`'s frontend process (the CLI, the app, the core client, the tokenizer,
    the constraint compiler) imports no torch: the engine core's process loads it, and a
    frontend without it starts ~1.5 s sooner and holds ~200 MB less."""
    code = """
import sys
import tidal.cli, tidal.server.api, tidal.runtime.client, tidal.model.tokenizer
from tidal.engine.structured import Grammars
print("TORCH", "torch" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TORCH False" in proc.stdout, proc.stdout


def test_a_new_ggufs_conversion_loads_no_torch(tmp_path):
    """The frontend converts a GGUF met for the first time while the engine core imports
    torch: the conversion (config.json and the tokenizer) imports none itself, which cost
    a first start 2.4 s (transformers' config classes and its GGUF reader import it)."""
    code = f"""
import sys
from tidal.model.gguf_convert import convert_gguf
from tidal.model.registry import embedded_gguf
convert_gguf(embedded_gguf("smollm2-135m"), {str(tmp_path / "out")!r}, weights=False)
print("TORCH", "torch" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TORCH False" in proc.stdout, proc.stdout
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"config.json", "tokenizer.json"}
