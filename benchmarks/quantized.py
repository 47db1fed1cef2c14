"""tidal against llama.cpp's llama-server on one quantized GGUF, side by side in one run.

A Llama-3.2-1B-shaped model with random weights (transformers, seeded; the embedded
model's tokenizer) goes through llama.cpp's `convert_hf_to_gguf.py` and `llama-quantize`
(Q4_K_M by default). llama-server (2 threads, a slot for each of the most concurrent
requests, one KV cache for all of them) and `tidal serve` (a KV cache of the same bytes)
then serve the same file one after the other; each is started twice (tidal's first start
with an empty cache) and timed from start to ready, the second start serves the run, its RSS
read while serving, and driven by `tidal bench serve`: random 128-token prompts, 64 output
tokens, ignore_eos, at each `--concurrency` (1, 8 and 64 by default), then one
`--prefill-len`-token prompt at a time (its median TTFT: the prefill). Agreement: the
perplexity of a fixed text, scored as `llama-perplexity` scores one chunk (the second half
of its tokens, given the first), from llama.cpp's tool and from tidal's prompt logprobs
(`echo`).

usage: .venv/bin/python benchmarks/quantized.py [--llama-cpp DIR] [--work DIR] [--type Q4_K_M]
    [--concurrency 1 8 64] [--prefill-len 2000] [--engines llama tidal]
The llama.cpp tree is the one benchmarks/peers/llama_server.sh builds ($PEERS_DIR/llama.cpp);
convert_hf_to_gguf.py needs `sentencepiece` in this Python.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from perplexity import llama_perplexity  # this folder's

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                     low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192))


def make_gguf(work: Path, llama_cpp: Path, qtype: str) -> Path:
    """The quantized file (built once into `work`)."""
    out = work / f"llama-1b-shaped.{qtype}.gguf"
    if out.exists():
        return out
    hf, f16 = work / "hf", work / "llama-1b-shaped.f16.gguf"
    if not (hf / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from tidal.model.registry import resolve_model

        tokenizer = resolve_model("smollm2-135m")[0]
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2, **LLAMA_1B)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(str(hf))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer / name).exists():
                shutil.copy(tokenizer / name, hf / name)
    if not f16.exists():
        subprocess.run([PY, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outfile",
                        str(f16), "--outtype", "f16"], check=True)
    subprocess.run([str(llama_cpp / "build/bin/llama-quantize"), str(f16), str(out), qtype],
                   check=True, stdout=subprocess.DEVNULL)
    return out


def rss(pid: int) -> int:
    """Bytes resident in the process and its children."""
    p = psutil.Process(pid)
    return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])


def start(cmd: list[str], port: int, log: Path, env: dict | None = None,
          ) -> tuple[subprocess.Popen, float]:
    import urllib.request

    try:  # a server already there would answer for the one started here
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
            raise RuntimeError(f"port {port} is already serving; stop that server first")
    except OSError:
        pass
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, **(env or {})})
    while time.perf_counter() - t0 < 900:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{cmd[0]} not ready after 900 s")


def stop(proc: subprocess.Popen) -> None:
    """End a server `start` began, with every process of its group."""
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait()


def bench(port: int, backend: str, concurrency: int, prompts: int, out: Path, seed: int,
          input_len: int = 128, output_len: int = 64) -> dict:
    """`tidal bench serve` against the server at `port`; each run's prompts of its own
    `seed`, so that none is served from the prefix cache an earlier run filled (one seed
    gives runs of one prompt count the same prompts)."""
    subprocess.run([PY, "-m", "tidal.cli", "bench", "serve", "--base-url",
                    f"http://127.0.0.1:{port}", "--backend", backend, "--endpoint",
                    "/v1/completions", "--dataset", "random", "--random-input-len",
                    str(input_len), "--random-output-len", str(output_len),
                    "--max-model-len", str(input_len + output_len),  # no clipping
                    "--random-range-ratio", "0", "--num-prompts", str(prompts),
                    "--max-concurrency", str(concurrency), "--seed", str(seed),
                    "--ignore-eos", "--temperature", "0",
                    "--disable-tqdm", "--save-result", "--result-file", str(out)],
                   check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return json.loads(out.read_text())


TEXT = ("The history of the lighthouse begins with fires lit on hills to guide ships home. "
        "Later, towers of stone carried lamps of oil, and lenses gathered their light into "
        "beams that reached far over the water. Keepers trimmed the wicks every night and "
        "wrote the weather into their logbooks, one line for every watch. ") * 12


def tidal_perplexity(port: int, ctx: int) -> float:
    """tidal's perplexity of TEXT scored as llama-perplexity scores one chunk of `ctx`
    tokens: the second half of the chunk, given what precedes it."""
    import httpx

    url = f"http://127.0.0.1:{port}/v1"
    model = httpx.get(f"{url}/models").json()["data"][0]["id"]
    r = httpx.post(f"{url}/completions", timeout=600, json=dict(
        model=model, prompt=TEXT, echo=True, logprobs=0, max_tokens=0))
    r.raise_for_status()
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"][:ctx]
    scored = lps[ctx // 2 + 1:]  # llama-perplexity scores positions ctx/2 + 1 .. ctx - 1
    return math.exp(-sum(scored) / len(scored))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path,
                    default=Path(os.environ.get("PEERS_DIR", "/tmp/peers")) / "llama.cpp")
    ap.add_argument("--work", type=Path, default=Path("/tmp/tidal-quantized"))
    ap.add_argument("--type", default="Q4_K_M", help="llama-quantize's type name")
    ap.add_argument("--prompts", type=int, default=16, help="requests at each concurrency")
    ap.add_argument("--ppl-ctx", type=int, default=256)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prefill-len", type=int, default=2000,
                    help="tokens of the prompts whose prefill is timed (0: none)")
    ap.add_argument("--engines", nargs="+", default=["llama", "tidal"],
                    choices=["llama", "tidal"])
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    gguf = make_gguf(args.work, args.llama_cpp, args.type)
    size = gguf.stat().st_size
    print(f"{gguf.name}: {size / 2**20:.0f} MiB")
    # one KV cache for all slots: the most concurrent requests' tokens, or the longest prompt
    slots = max(args.concurrency)
    tokens = max(slots * 256, 2 * (args.prefill_len + 64), 8192)
    c = LLAMA_1B  # tidal's KV cache gets the bytes of llama-server's f16 K and V
    kv_bytes = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2 * tokens
    engines = {
        "llama": ([str(args.llama_cpp / "build/bin/llama-server"), "-m", str(gguf), "-t", "2",
                   "-np", str(slots), "-cb", "-c", str(tokens), "--kv-unified",
                   "--host", "127.0.0.1", "--port", "8102"], 8102),
        "tidal": ([str(ROOT / ".venv/bin/tidal"), "serve", "--model", str(gguf), "--port",
                   "8100", "--max-num-seqs", str(slots), "--kv-cache-memory", str(kv_bytes)],
                  8100),
    }
    engines = {name: engines[name] for name in args.engines}
    rows: dict[str, dict] = {}
    cache = args.work / "tidal-cache"  # tidal's first start converts and profiles anew
    shutil.rmtree(cache, ignore_errors=True)
    for name, (cmd, port) in engines.items():
        env = {"TIDAL_CACHE": str(cache)}
        proc, first = start(cmd, port, args.work / f"{name}-first.log", env)
        stop(proc)
        proc, ready = start(cmd, port, args.work / f"{name}.log", env)
        try:
            row = {"first_ready_s": first, "ready_s": ready}
            bench(port, name, 8, 8, args.work / f"{name}-warm.json", 1000)  # warmed up alike
            for c in args.concurrency:
                r = bench(port, name, c, max(args.prompts, c) if c > 1 else
                          max(4, args.prompts // 4), args.work / f"{name}-c{c}.json", c)
                row[f"tok_s_c{c}"] = r["output_throughput"]
                row[f"tpot_ms_c{c}"] = r["median_tpot_ms"]
            if args.prefill_len:
                r = bench(port, name, 1, 3, args.work / f"{name}-prefill.json", 2000,
                          args.prefill_len, 1)
                row["prefill_s"] = r["median_ttft_ms"] / 1e3
            row["rss_mib"] = rss(proc.pid) / 2**20
            row["ppl"] = (tidal_perplexity(port, args.ppl_ctx) if name == "tidal" else
                          llama_perplexity(args.llama_cpp, gguf, TEXT, args.ppl_ctx, 1))
            rows[name] = row
        finally:
            stop(proc)
    labels = [("first_ready_s", "first start: ready after (s)"),
              ("ready_s", "second start: ready after (s)"), ("rss_mib", "RSS serving (MiB)")]
    for c in args.concurrency:
        what = "one request" if c == 1 else f"{c} concurrent"
        labels += [(f"tok_s_c{c}", f"{what}: output tok/s"),
                   (f"tpot_ms_c{c}", f"{what}: median TPOT (ms)")]
    if args.prefill_len:
        labels.append(("prefill_s", f"a {args.prefill_len}-token prompt: TTFT (s)"))
    labels.append(("ppl", f"perplexity, {args.ppl_ctx}-token chunk"))
    names = list(rows)
    ratio = len(names) == 2
    print(f"\n| {args.type}, {size / 2**20:.0f} MiB file | "
          + " | ".join({"llama": "llama-server"}.get(n, n) for n in names)
          + (" | tidal / llama |" if ratio else " |"))
    print("|---" * (len(names) + 1 + ratio) + "|")
    for key, label in labels:
        cells = [f"{rows[n][key]:.4g}" for n in names]
        if ratio:
            cells.append(f"{rows['tidal'][key] / rows['llama'][key]:.3f}x")
        print(f"| {label} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
