"""`benchmarks/gpu_wheels.py`: the wheels carried to a GPU machine without a package index are
every distribution tidal needs there and lacks, at the versions installed here, never the
machine's own torch or triton."""

from __future__ import annotations

import os
import sys
from importlib.metadata import version

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

from gpu_wheels import closure, read_have, tidal_roots  # noqa: E402


def test_the_targets_list_is_read_from_freeze_list_or_bare_names(tmp_path):
    have = tmp_path / "have.txt"
    have.write_text("Package    Version\n---------- -------\nTyping_Extensions 4.12.0\n"
                    "numpy==2.5.2\npydantic-core @ file:///x.whl\n\nanyio\n# comment\n")
    assert read_have(have) == {"typing-extensions", "numpy", "pydantic-core", "anyio"}


def test_only_what_the_target_lacks_is_carried_with_its_own_needs():
    have = {"numpy", "transformers", "tokenizers", "safetensors", "jinja2", "tqdm", "httpx",
            "matplotlib", "prometheus-client", "pyyaml", "requests", "anyio", "click", "h11",
            "typing-extensions", "annotated-doc"}
    needed = closure(tidal_roots(), have)
    # tidal's own needs, and what they need in turn (fastapi -> pydantic -> pydantic-core)
    for name in ("msgspec", "pyzmq", "gguf", "llguidance", "fastapi", "uvicorn", "starlette",
                 "pydantic", "pydantic-core"):
        assert needed[name] == version(name), name
    assert not have & needed.keys()
    # the GPU machine's own builds are never shadowed, though tidal requires torch
    assert "torch" in tidal_roots() and "torch" not in needed and "triton" not in needed
    assert not any(name.startswith("nvidia-") for name in needed)


def test_a_target_that_has_everything_gets_nothing():
    everything = closure(tidal_roots() + ["openai"], set())
    assert closure(tidal_roots() + ["openai"], set(everything)) == {}
