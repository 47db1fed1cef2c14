"""Turn a step's logits into tokens: penalties, logit bias, temperature, top-k/top-p/min-p,
per-request seeds, and log-probabilities with top alternatives.

Everything runs on the logits' device; the step's results (tokens, their logprobs, the top
alternatives) come back to the host in one copy, and host lists go to the device without a
sync (pinned staging on CUDA), so a GPU step waits on the device once."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tidal.core import MASKED_LOGPROB, PromptLogprob, SamplingParams, TokenLogprob
from tidal.model.logits_processors import LogitsRow


@dataclass
class SampleRow:
    """One row of logits to sample from."""

    params: SamplingParams
    num_samples: int  # n on the step an n>1 request finishes its prompt, else 1
    prompt_ids: list[int]
    output_ids: list[int]
    # seeded: one per sample (sample i of an n>1 fork is its sibling i's, seeded seed + i);
    # None draws from the shared one
    generators: list[torch.Generator] | None
    banned: list[int] | None = None  # stop tokens masked out before min_tokens is reached


def on_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`: staged in pinned memory and copied without a
    sync on CUDA (a pageable copy waits for the stream)."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, device="cpu").pin_memory().to(device,
                                                                          non_blocking=True)


def to_host(t: torch.Tensor) -> list:
    """The step's one device-to-host copy. On CUDA into pinned memory, then a wait on an
    event after it: the host waits for the step's work, never for a stream sync."""
    if t.device.type != "cuda":
        return t.tolist()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host.tolist()


def needs_penalty(p: SamplingParams) -> bool:
    """Whether sampling with p reads the tokens generated so far."""
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place. Repetition (HF/vLLM style) looks at prompt and output; presence and
    frequency (OpenAI style) at the output only."""
    for i, row in enumerate(rows):
        p = row.params
        if not needs_penalty(p):
            continue
        if p.repetition_penalty != 1.0:
            seen = on_device(sorted(set(row.prompt_ids) | set(row.output_ids)), torch.long,
                             logits.device)
            vals = logits[i, seen]
            big = torch.finfo(logits.dtype).max  # a tiny penalty must not make a logit inf,
            scaled = torch.where(vals > 0, vals / p.repetition_penalty,  # nor a masked one
                                 vals * p.repetition_penalty).clamp(-big, big)  # finite
            logits[i, seen] = torch.where(vals == float("-inf"), vals, scaled)
        if row.output_ids and (p.presence_penalty or p.frequency_penalty):
            ids = on_device(row.output_ids, torch.long, logits.device)
            # scatter_add, not bincount: CUDA's bincount reads the largest id on the host
            counts = torch.zeros_like(logits[i]).scatter_add_(
                0, ids, torch.ones(len(row.output_ids), dtype=logits.dtype, device=ids.device))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def bad_word_ends(words: list[list[int]], output: list[int]) -> list[int]:
    """The last token of each bad word whose tokens before it end the output."""
    n = len(output)
    return [w[-1] for w in words if len(w) <= n + 1 and output[n + 1 - len(w):] == w[:-1]]


def apply_logit_bias(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place: each row's logit_bias added to its tokens' logits (before temperature, so
    greedy rows see it too)."""
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            ids = on_device(list(bias), torch.long, logits.device)
            logits[i, ids] += on_device(list(bias.values()), logits.dtype, logits.device)


def _filter(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (to -inf), row by row settings."""
    dev = logits.device  # every tensor made here lives beside the logits (CPU or GPU)
    temps = on_device([max(r.params.temperature, 1e-5) for r in rows], logits.dtype, dev)
    logits = logits / temps[:, None]
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    vocab = logits.shape[1]
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ks = on_device([k if 0 < k < vocab else vocab for k in top_k], torch.long, dev)
        ranks = torch.arange(vocab, device=dev)[None, :]
        drop = ranks >= ks[:, None]
        probs = sorted_logits.softmax(-1)
        # Keep the smallest set whose mass reaches top_p; the first token always stays,
        # even for a top_p that rounds to 0 in float32 (5e-324 once dropped every token).
        before = probs.cumsum(-1) - probs
        drop |= (before >= on_device(top_p, probs.dtype, dev)[:, None]) & (ranks > 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(p > 0 for p in min_p):
        probs = logits.softmax(-1)
        floor = (on_device(min_p, probs.dtype, dev)[:, None]
                 * probs.max(-1, keepdim=True).values)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def sample(logits: torch.Tensor, rows: list[SampleRow], generator: torch.Generator,
           processors: list | None = None, logprobs_mode: str = "adjusted_logprobs",
           ) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
    """Tokens per row (num_samples each) and, for rows asking for logprobs, one entry per
    token: its logprob and the top alternatives as (token, logprob). Every tensor it makes is
    on the logits' device; the generators must be too. What logprobs report is the row's
    `logprobs_mode`, else `logprobs_mode` (LOGPROBS_MODES): by default the distribution
    after penalties, logit bias, bans (min_tokens, bad words), allowed_token_ids and the
    custom `processors` (logits_processors.py), before temperature."""
    if not rows:  # a step of prefill chunks that sample nothing
        return [], []
    raw = logits = logits.float()  # every change below is made on a copy
    dev = logits.device
    if processors or any(needs_penalty(r.params) or r.banned or r.params.logit_bias
                         or r.params.allowed_token_ids or r.params.bad_words_token_ids
                         for r in rows):
        logits = logits.clone()
        apply_penalties(logits, rows)
        apply_logit_bias(logits, rows)
        for i, row in enumerate(rows):
            banned = (row.banned or []) + bad_word_ends(row.params.bad_words_token_ids,
                                                        row.output_ids)
            if banned:
                logits[i, on_device(banned, torch.long, dev)] = float("-inf")
            if row.params.allowed_token_ids:  # every other token out
                ids = on_device(row.params.allowed_token_ids, torch.long, dev)
                kept = logits[i, ids]
                logits[i] = float("-inf")
                logits[i, ids] = kept
    if processors:
        seen = [LogitsRow(r.params.extra_args or {}, r.prompt_ids, r.output_ids) for r in rows]
        for processor in processors:
            processor.apply(logits, seen)
    width = max(r.num_samples for r in rows)
    # max(-1).indices: the same first maximal index as argmax, 2-3x faster on CPU.
    tokens = logits.max(-1).indices[:, None].expand(-1, width)  # greedy rows: [R, width]
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    modes = [rows[i].params.logprobs_mode or logprobs_mode for i in wanted]
    stages = {"raw": raw, "adjusted": logits, "processed": logits}  # greedy rows' processed
    random_rows = [i for i, r in enumerate(rows) if r.params.temperature != 0]
    if random_rows:
        sub = [rows[i] for i in random_rows]
        idx = on_device(random_rows, torch.long, dev)
        filtered = _filter(logits[idx], sub)
        probs = filtered.softmax(-1)
        if any(m.startswith("processed") for m in modes):
            stages["processed"] = logits.index_copy(0, idx, filtered)
        drawn = []
        for j, row in enumerate(sub):
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, and a request's
            # own generator makes its draws independent of the rest of the batch.
            noise = torch.empty((row.num_samples, probs.shape[1]), device=dev)
            if row.generators is None:
                noise.exponential_(generator=generator)
            for sample_noise, gen in zip(noise, row.generators or ()):
                sample_noise.exponential_(generator=gen)
            drawn.append(F.pad((probs[j][None, :] / noise).argmax(-1),
                               (0, width - row.num_samples)))
        tokens = tokens.clone().index_copy_(0, idx, torch.stack(drawn))
    parts = [tokens.flatten().double()]
    top_k = max((rows[i].params.logprobs for i in wanted), default=0)
    if wanted:
        widx = on_device(wanted, torch.long, dev)  # a masked token reports the floor
        lp = _reported(stages, wanted, modes, widx).clamp(min=MASKED_LOGPROB)
        parts.append(lp.gather(1, tokens[widx]).flatten().double())
        if top_k:
            top = lp.topk(min(top_k, lp.shape[1]), dim=-1)
            parts += [top.indices.flatten().double(), top.values.flatten().double()]
    # One copy: tokens [R, width], their logprobs [W, width], top ids and top logprobs
    # [W, k] each, flattened in that order; float64 holds every token id exactly.
    host = to_host(torch.cat(parts))
    n_rows, n_wanted = len(rows), len(wanted)
    out = [[int(t) for t in host[i * width:i * width + r.num_samples]]
           for i, r in enumerate(rows)]
    logprobs: list = [None] * n_rows
    at = n_rows * width
    chosen, at = host[at:at + n_wanted * width], at + n_wanted * width
    k_eff = min(top_k, logits.shape[1])
    top_ids, top_vals = host[at:at + n_wanted * k_eff], host[at + n_wanted * k_eff:]
    for j, i in enumerate(wanted):
        k = rows[i].params.logprobs
        alts = [(int(t), v) for t, v in zip(top_ids[j * k_eff:j * k_eff + k],
                                            top_vals[j * k_eff:j * k_eff + k])]
        logprobs[i] = [TokenLogprob(chosen[j * width + s], alts)
                       for s in range(rows[i].num_samples)]
    return out, logprobs


def _reported(stages: dict[str, torch.Tensor], wanted: list[int], modes: list[str],
              widx: torch.Tensor) -> torch.Tensor:
    """The rows `wanted`, each as its mode reports them: [len(wanted), vocab]."""
    def report(mode: str, rows) -> torch.Tensor:
        stage, kind = mode.split("_")
        chosen = stages[stage][rows]
        return chosen.log_softmax(-1) if kind == "logprobs" else chosen

    if len(set(modes)) == 1:  # the usual step: one mode, one gather
        return report(modes[0], widx)
    return torch.stack([report(mode, i) for i, mode in zip(wanted, modes)])


def target_logprobs(logits_of, hidden: torch.Tensor, targets: list[int], k: int,
                    rows: int = 256) -> list[PromptLogprob]:
    """Per row of `hidden`: the raw logprob of its target token, the top `k` alternatives
    and the target's rank (1: the likeliest) under log_softmax(logits_of(row)), float32
    logits. Runs `rows` rows at a time and turns each slice into Python lists at once, so
    a long prompt's logits never exist all together."""
    entries: list[PromptLogprob] = []
    for lo in range(0, len(targets), rows):
        lp = logits_of(hidden[lo:lo + rows]).log_softmax(-1).clamp(min=-9999.0)
        idx = torch.tensor(targets[lo:lo + rows], device=lp.device)
        own_t = lp.gather(1, idx[:, None])
        own = own_t[:, 0].tolist()
        ranks = ((lp > own_t).sum(-1) + 1).tolist()  # vLLM reports it with the logprob
        if k:
            top = lp.topk(min(k, lp.shape[-1]), dim=-1)
            alts = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
        else:
            alts = [[] for _ in own]
        entries += map(PromptLogprob, own, alts, ranks)
        del lp
    return entries
