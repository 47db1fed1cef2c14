"""A new GGUF's first `tidal serve`, on an empty model cache: the engine core is launched
before the file is converted and loads its engine meanwhile; the server answers while the
rest of the step-time profile is timed in its idle time, then saved, and the next start
reads it back. A file that fails to convert ends the command with its message and leaves
no engine process behind."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server_fixtures import Server, openai_client, pid_alive

from tidal.model.registry import embedded_gguf


@pytest.fixture()
def gguf(tmp_path, monkeypatch):
    """The embedded model's file under a name of its own, and an empty model cache."""
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "first.gguf"
    shutil.copyfile(embedded_gguf("smollm2-135m"), path)
    return path


def test_a_new_gguf_serves_while_its_profile_is_timed_then_saved(gguf, tmp_path):
    server = Server("--model", str(gguf))
    try:
        log = server.output()
        # the core waited for the files the frontend wrote, its engine already imported
        assert log.index("waited") < log.index("engine core ready")
        # only the decode shapes before serving: the prompt ones while idle
        assert "2 step times measured" in log and "more while idle" in log
        (folder,) = (tmp_path / "cache").glob("first-*")
        assert (folder / "model.gguf").resolve() == gguf.resolve()
        assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {
            p.name for p in folder.iterdir()}
        answer = openai_client(server).chat.completions.create(
            model="first", messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8, temperature=0)
        assert answer.choices[0].message.content and answer.usage.completion_tokens == 8
        profiles = tmp_path / "cache" / "step-profiles"
        deadline = time.monotonic() + 120
        while not list(profiles.glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(list(profiles.glob("*.json"))) == 1, server.output()
    finally:
        server.stop()
    again = Server("--model", str(gguf))
    try:
        log = again.output()
        assert "waited" not in log and "step times measured" not in log  # all read back
    finally:
        again.stop()


def test_a_gguf_that_fails_to_convert_ends_the_command_and_its_core(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(embedded_gguf("smollm2-135m").read_bytes()[:1 << 20])
    proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", "serve", "--model", str(cut),
                             "--num-threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "truncated" in out, out
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _group_alive(proc.pid):
        time.sleep(0.2)
    assert not _group_alive(proc.pid), "an engine core outlived its frontend"


def _group_alive(pgid: int) -> bool:
    """Whether any live process is in the process group `pgid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and pid_alive(int(stat.parent.name)):
            return True
    return False
