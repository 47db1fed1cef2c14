"""Beam search served: tidal (the embedded model in its own format) against vLLM's CPU build
(a bf16 copy, `benchmarks/peers/vllm_cpu.sh`), the same completions with
`use_beam_search`, n = 4 beams, 32 tokens at most, at `length_penalty` 0 and 1, one
request at a time after a warm-up; the median of 3 per prompt, and each engine's best
beam. At `length_penalty` 0 both rank beams by their summed logprob; at 1 vLLM divides by
the prompt's length too, tidal by the output's (docs/serving.md), so their beams may differ.

usage: .venv/bin/python benchmarks/beam_search.py [--engines tidal,vllm] [--repeats 3]
vLLM installs into $PEERS_DIR/vllm-venv on first use (the peer script).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized import start, stop  # noqa: E402  (the same start-and-wait-for-ready)

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colours are"]


def serve(engine: str, logs: Path) -> tuple[subprocess.Popen, int, str]:
    """The engine's server process, its port and the model name it serves."""
    if engine == "tidal":
        port = 8102
        cmd = [sys.executable, "-m", "tidal.cli", "serve", "--port", str(port)]
        return start(cmd, port, logs / "tidal.log")[0], port, "smollm2-135m"
    from tidal.model.registry import dense_weights, resolve_model

    folder = resolve_model("smollm2-135m")[0]
    dense_weights(folder)  # the bf16 copy vLLM reads
    port = 8101
    cmd = [str(ROOT / "benchmarks/peers/vllm_cpu.sh"), str(folder), str(port)]
    return start(cmd, port, logs / "vllm.log")[0], port, Path(folder).name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="tidal,vllm")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp())
    for engine in args.engines.split(","):
        proc, port, model = serve(engine, logs)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                   max_retries=0)
            for penalty in (0.0, 1.0):
                kw = dict(model=model, max_tokens=32, n=4, temperature=0, extra_body={
                    "use_beam_search": True, "length_penalty": penalty})
                client.completions.create(prompt="Hello there,", **kw)  # warm-up
                for prompt in PROMPTS:
                    times = []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        out = client.completions.create(prompt=prompt, **kw)
                        times.append(time.perf_counter() - t0)
                    print(f"{engine:6s} length_penalty {penalty:g}  {prompt[:30]:30s} "
                          f"{median(times):6.3f} s  best: {out.choices[0].text[:60]!r}")
        finally:
            stop(proc)


if __name__ == "__main__":
    main()
