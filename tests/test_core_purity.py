"""tidal.core stays pure Python: importable with torch, asyncio, zmq and sockets blocked."""

import pathlib
import re
import subprocess
import sys

import tidal.core

BLOCKED = ("torch", "asyncio", "zmq", "socket")


def test_core_imports_with_torch_and_io_modules_unimportable():
    code = (
        "import sys\n"
        f"for name in {BLOCKED!r}: sys.modules[name] = None  # any import of them raises\n"
        "import tidal.core as c\n"
        "kv = c.KVCacheManager(c.CacheConfig(num_blocks=8, block_size=4))\n"
        "s = c.Scheduler(c.SchedulerConfig(), kv)\n"
        "s.add_request(c.Request('a', [1, 2, 3], c.SamplingParams(max_tokens=2)))\n"
        "out = s.schedule()\n"
        "s.update(out, c.ModelOutput(sampled={'a': [5]}))\n"
        "assert s.requests['a'].output_token_ids == [5]\n"
        f"assert not any(sys.modules.get(n) for n in {BLOCKED!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_core_reads_no_environment_variables():
    root = pathlib.Path(tidal.core.__file__).parent
    pattern = re.compile(r"os\.environ|getenv\(|^\s*import os\b|^\s*from os\b", re.M)
    offenders = [p.name for p in root.glob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_configuration_doc_matches_the_config_fields():
    from tidal.config_docs import DOC_PATH, render

    assert DOC_PATH.exists() and DOC_PATH.read_text() == render(), (
        "docs/configuration.md is out of date with the config fields: run `make docs`")
