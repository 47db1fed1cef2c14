"""Quantized KV on the served path: `tidal serve --kv-cache-dtype auto|int8|fp8_e4m3` with
the same KV memory (the pool holds as many blocks as those bytes allow in each format),
then `tidal bench serve` (random prompts, fixed output lengths) against each, warmed up
alike. A small budget shows what the extra tokens buy (more requests decode at once, fewer
wait; "holds" is how many requests of input + output tokens the pool fits whole, "largest
batch" the most /metrics counted decoding at once, polled through the measured run); a
large one what reading codes costs or saves per token.

usage: .venv/bin/python benchmarks/kv_quant.py [--model smollm2-135m] [--kv-mib 96]
  [--input-len 1000] [--output-len 128] [--num-prompts 32] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from server_fixtures import Server, metric  # noqa: E402

FORMATS = ("auto", "int8", "fp8_e4m3")
BLOCK = 16


def blocks_for(model: str, kv: str, mib: float) -> tuple[int, int]:
    """(blocks, bytes a token) of `mib` MiB of KV in format `kv` for the model's default
    dtype on this CPU, `auto` as the server resolves it (bf16 rows for a float32 model of
    its own formats on AMX and AVX512-BF16 CPUs)."""
    from tidal.engine.config import ModelConfig
    from tidal.engine.device import pick_kv_cache_dtype
    from tidal.engine.model_loading import pick_model_dtype
    from tidal.model.config import ModelArch
    from tidal.model.kv_quant import KVFormat
    from tidal.model.registry import resolve_model

    folder = resolve_model(model)[0]
    arch = ModelArch.from_folder(folder)
    quantization, dtype = pick_model_dtype(folder, arch, ModelConfig(model=model), "cpu")
    per_token = KVFormat(pick_kv_cache_dtype(kv, "cpu", quantization, dtype)).bytes_per_token(
        arch, dtype)
    return int(mib * 2**20) // (per_token * BLOCK), per_token


def bench(url: str, args, out: str, num_prompts: int, seed: int) -> dict:
    subprocess.run([sys.executable, "-m", "tidal.cli", "bench", "serve", "--base-url", url,
                    "--dataset", "random", "--random-input-len", str(args.input_len),
                    "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
                    "--max-model-len", str(args.input_len + args.output_len),  # no clipping
                    "--num-prompts", str(num_prompts), "--max-concurrency",
                    str(args.concurrency), "--ignore-eos", "--seed", str(seed),
                    "--disable-tqdm", "--save-result", "--result-file", out],
                   check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


class PeakDecoding:
    """The most requests the server at `url` reports decoding, polled on a thread while the
    `with` block runs."""

    def __init__(self, url: str, every: float = 0.2) -> None:
        self.url, self.every, self.peak = url, every, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._done.wait(self.every):
            with contextlib.suppress(httpx.HTTPError):  # a missed poll is not a failed run
                self.peak = max(self.peak, int(metric(self.url, "tidal:num_requests_decoding")))

    def __enter__(self) -> "PeakDecoding":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-mib", type=float, default=96)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--formats", nargs="+", default=list(FORMATS))
    args = p.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kv in args.formats:
            blocks, per_token = blocks_for(args.model, kv, args.kv_mib)
            server = Server("--model", args.model, "--kv-cache-dtype", kv, "--num-kv-blocks",
                            str(blocks), "--num-threads", str(os.cpu_count() or 1))
            try:
                bench(server.url, args, f"{tmp}/warm.json", 4, seed=1)  # other prompts
                with PeakDecoding(server.url) as decoding:
                    r = bench(server.url, args, f"{tmp}/{kv}.json", args.num_prompts, seed=0)
            finally:
                server.stop()
            rows[kv] = (blocks * BLOCK, per_token, r, decoding.peak)
            print(f"{kv}: {blocks * BLOCK} tokens, {r['output_throughput']:.1f} tok/s",
                  flush=True)
    base_kv = "auto" if "auto" in rows else next(iter(rows))
    base = rows[base_kv][2]["output_throughput"]
    print(f"\n{args.model}, {args.kv_mib:g} MiB of KV; {args.num_prompts} requests of "
          f"{args.input_len} + {args.output_len} tokens, {args.concurrency} at a time\n")
    blocks_each = -(-(args.input_len + args.output_len) // BLOCK)
    print("| --kv-cache-dtype | bytes a token | pool tokens | holds | largest batch | "
          f"output tok/s | TTFT p50 | TPOT p50 | / {base_kv} |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for kv, (tokens, per_token, r, peak) in rows.items():
        print(f"| {kv} | {per_token:,} | {tokens:,} | {tokens // BLOCK // blocks_each} | "
              f"{peak} | {r['output_throughput']:.1f} | "
              f"{r['median_ttft_ms']:.0f} ms | {r['median_tpot_ms']:.1f} ms | "
              f"{r['output_throughput'] / base:.2f}x |")


if __name__ == "__main__":
    main()
