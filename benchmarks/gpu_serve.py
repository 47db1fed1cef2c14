"""Served output tokens/s of tidal beside HF transformers' continuous batching, in one run:
each server in turn (`tidal serve`, then `transformers serve --continuous-batching`) on the
same random-weight model, driven by `tidal bench serve` with random 1024-in / 256-out
requests at each concurrency.

usage: python benchmarks/gpu_serve.py [--model smollm2-135m] [--concurrency 1 16 64 256]
           [--waves 2] [--input-len 1024] [--output-len 256] [--device cuda] [--no-hf]

The model is a built-in profile's shape (tidal.sim.profiles) with random bf16 weights saved
once into a temporary folder with a word-level tokenizer (prompts of `w<id>` words re-encode
to the same ids in both servers). Prints one row per concurrency: tidal, HF and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from tidal.bench.word_tokenizer import save_word_tokenizer
from tidal.sim.profiles import MODEL_CONFIGS


def save_model(folder: Path, name: str, device: str) -> Path:
    """Random weights of the profile's shape and a tokenizer both servers load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**MODEL_CONFIGS[name])
    with torch.device(device):  # initialising 8B parameters on a CPU takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(folder))
    del model
    save_word_tokenizer(folder, config.vocab_size, config.eos_token_id)
    return folder


def serve(command: list[str], port: int, log: Path) -> subprocess.Popen:
    """Start a server and wait until it answers /v1/models (30 minutes at most)."""
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + 1800
    while time.time() < deadline:
        if proc.poll() is not None:
            tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
            raise RuntimeError(f"{command[0]} exited ({proc.returncode}); the end of {log}:\n"
                               f"{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    stop(proc)
    raise TimeoutError(f"{command[0]} did not start; see {log}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def bench(port: int, folder: Path, model: str, concurrency: int, args, out: Path,
          ignore_eos: bool) -> float:
    """Output tokens/s of `tidal bench serve` at this concurrency (a warm-up wave first).
    transformers refuses vLLM's `ignore_eos`; random weights reach EOS about once in the
    vocabulary's size of tokens, so its lengths hold all the same."""
    result = out / f"c{concurrency}.json"
    for prompts, save in ((concurrency, []), (concurrency * args.waves,
                                               ["--save-result", str(result)])):
        subprocess.run([sys.executable, "-m", "tidal.cli", "bench", "serve",
                        "--base-url", f"http://127.0.0.1:{port}", "--model", model,
                        "--tokenizer", str(folder), "--dataset", "random",
                        "--random-input-len", str(args.input_len),
                        "--random-output-len", str(args.output_len),
                        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
                        "--disable-tqdm", *(["--ignore-eos"] if ignore_eos else []), *save],
                       check=True,
                       stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())["output_throughput"]


def run_server(kind: str, folder: Path, args, root: Path) -> dict[int, float]:
    port = 8100 if kind == "tidal" else 8200
    if kind == "tidal":
        command = [sys.executable, "-m", "tidal.cli", "serve", "--model", str(folder),
                   "--port", str(port), "--device", args.device, "--dtype", "bfloat16",
                   "--max-num-seqs", str(max(args.concurrency))]
    else:
        command = [sys.executable, "-c", "from transformers.cli.transformers import main; main()",
                   "serve", str(folder), "--continuous-batching",
                   "--port", str(port), "--device", args.device, "--dtype", "bfloat16"]
    out = root / kind
    out.mkdir()
    proc = serve(command, port, root / f"{kind}.log")
    try:
        name = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        return {c: bench(port, folder, name, c, args, out, kind == "tidal")
                for c in args.concurrency}
    finally:
        stop(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=sorted(MODEL_CONFIGS))
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64, 256])
    p.add_argument("--waves", type=int, default=2, help="requests = waves x concurrency")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-hf", action="store_true", help="tidal alone")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = save_model(root / args.model, args.model, args.device)
        ours = run_server("tidal", folder, args, root)
        print(f"tidal: {ours}", flush=True)  # kept if the peer then fails
        theirs = {}
        if not args.no_hf:
            try:
                theirs = run_server("hf", folder, args, root)
            except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as e:
                print(f"transformers serve failed: {e}")
    print(f"served output tokens/s, {args.model}, {args.input_len} in / {args.output_len} "
          f"out, {args.waves} waves: tidal / HF continuous batching / ratio")
    for c in args.concurrency:
        row = f"{ours[c]:,.0f}"
        if c in theirs:
            ratio = f"{ours[c] / theirs[c]:.2f}x" if theirs[c] else "- (its requests failed)"
            row += f" / {theirs[c]:,.0f} / {ratio}"
        print(f"  concurrency {c:>4}  {row}")


if __name__ == "__main__":
    main()
