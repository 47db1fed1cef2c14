"""The offline API: `LLM(model).generate(prompts, params)`, `LLM.chat(conversations)`,
`LLM.embed(prompts)`, `LLM.score(texts_1, texts_2)`, `LLM.classify(prompts)` and
`LLM.beam_search(prompts, params)`."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any, Sequence

from tqdm import tqdm

from tidal.core import SamplingParams
from tidal.engine.beam_search import (BeamSearch, BeamSearches, BeamSearchParams, step_params,
                                      stop_token_ids)
from tidal.engine.config import EngineConfig, give_omp_spin
from tidal.engine.outputs import (BeamSearchOutput, BeamSequence, CompletionOutput,
                                  GenerationOutput)
from tidal.model.score_prompts import pair_ids, score_pairs, score_params

Prompt = str | dict  # a string, or {"prompt_token_ids": [...]}


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for `LLM.generate` and `LLM.chat`, as vLLM's: its name and PEFT
    folder (loaded on first use; the name alone for one loaded already). The integer id is
    vLLM's and unused: tidal goes by names."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


Adapter = LoRARequest | str | None


class LLM:
    """Generate for a batch of prompts with continuous batching, in this process. Any engine
    option (docs/configuration.md) is a keyword: `LLM("smollm2-135m", dtype="float32",
    num_kv_blocks=64, ...)`; an unknown one raises TypeError. Steps are not sized by time
    unless `max_step_ms` is given: no stream waits here for its next token, and whole steps
    compute a batch fastest."""

    def __init__(self, model: str = "smollm2-135m", **kwargs: Any) -> None:
        if kwargs.get("max_step_ms") is None:  # unset (the CLI's flags come as None)
            kwargs["max_step_ms"] = 0.0
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        if "torch" not in sys.modules:  # libgomp reads its spin as torch loads, and rank 0
            give_omp_spin(config.model)  # of pipeline stages computes in this process
        from tidal.engine.engine import Engine  # (loads torch)

        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the processes beside this one (a tensor-parallel group's other ranks); they
        also end with this process."""
        self.engine.close()

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every prefix the KV pool has cached, so a prompt seen before is
        computed anew (a cold measurement); True once done."""
        self.engine.core.reset_prefix_cache()
        return True

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use when given no parameters (vLLM's): SamplingParams'
        defaults with the model's generation config over them (generation_config)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: Adapter | Sequence[Adapter] = None) -> list[GenerationOutput]:
        """Each prompt's outputs; `lora_request`: the adapter serving them (or one per
        prompt), with LoRA enabled (`enable_lora=True` or `lora_modules`)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return self._run(self._encode(prompts), params, use_tqdm, lora_request)

    def _encode(self, prompts: Sequence[Prompt]) -> list[tuple[str | None, list[int]]]:
        encoded = []
        for p in prompts:
            if isinstance(p, str):
                encoded.append((p, self.engine.tokenize(p)))
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                encoded.append((p.get("prompt"), list(p["prompt_token_ids"])))
            else:
                raise TypeError("a prompt is a string or {'prompt_token_ids': [...]}")
        return encoded

    def beam_search(self, prompts: Prompt | Sequence[Prompt],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Each prompt's `beam_width` best answers by beam search (tidal/engine/
        beam_search.py), best first: each step runs every live beam as a one-token request
        of the batch."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        encoded = self._encode(prompts)
        if not encoded:
            return []
        stops = stop_token_ids(params.stop_token_ids, self.engine.core.eos_token_ids,
                               params.ignore_eos)
        group = BeamSearches([ids for _, ids in encoded], [
            BeamSearch(params.beam_width, params.max_tokens, stops, params.length_penalty)
            for _ in encoded])
        step = step_params(SamplingParams(), group.searches[0])
        while group.live:
            outs = self.generate([{"prompt_token_ids": ids} for ids in group.asks()], step,
                                 use_tqdm=False)
            group.extend([o.outputs[0].logprobs[0].top for o in outs])
        keep, searches = params.include_stop_str_in_output, group.searches
        return [BeamSearchOutput(text, ids, [
            BeamSequence(self.tokenizer.decode(b.text_ids(keep)), b.token_ids, b.cum_logprob,
                         b.finish_reason) for b in s.best()])
            for (text, ids), s in zip(encoded, searches)]

    def embed(self, prompts: Prompt | Sequence[Prompt], dimensions: int = 0,
              use_tqdm: bool = False) -> list[list[float]]:
        """Each prompt's embedding: the model's pooling of its final hidden states
        (tidal/model/pooling.py), its first `dimensions` (0: all), batched as prompts are."""
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                embed=dimensions)
        return [r.embedding for r in self.generate(prompts, params, use_tqdm)]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              instruction: str | None = None, use_tqdm: bool = False) -> list[float]:
        """Each (text_1, text_2) pair's relevance in (0, 1), as /v1/score answers (vLLM's
        LLM.score): one text_1 against each text_2, or pair by pair. The model needs a score
        head: a *ForSequenceClassification checkpoint, or an LLM reranker's answer tokens
        (`score_tokens="no,yes"`; `instruction`: its <Instruct> line)."""
        info = self.engine.core.executor.info
        if not info.scorer:
            raise ValueError("this model has no score head: a *ForSequenceClassification "
                             "checkpoint, or an LLM reranker with score_tokens (e.g. no,yes)")
        if len(info.labels) > 1:
            raise ValueError(f"this model classifies into {len(info.labels)} labels and "
                             "scores no pairs: LLM.classify")
        prompts = [{"prompt_token_ids": pair_ids(self.tokenizer, info.scorer, q, d,
                                                  instruction)}
                   for q, d in score_pairs(text_1, text_2)]
        return [r.embedding[0] for r in self.generate(prompts, score_params(), use_tqdm)]

    def classify(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = False
                 ) -> list[list[float]]:
        """Each prompt's probability per label of the model's classifier head (vLLM's
        LLM.classify; a *ForSequenceClassification checkpoint; `classifier_labels` names
        them, config.json's id2label): the softmax of its logits, one label's sigmoid."""
        if self.engine.core.executor.info.scorer != "classifier":
            raise ValueError("LLM.classify reads a *ForSequenceClassification checkpoint's "
                             "classifier head; this model has none")
        return [r.embedding for r in self.generate(prompts, score_params(), use_tqdm)]

    @property
    def classifier_labels(self) -> tuple[str, ...]:
        """The classifier head's labels, in the order LLM.classify's probabilities come."""
        return self.engine.core.executor.info.labels

    def chat(self, conversations: list[dict] | Sequence[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True,
             lora_request: Adapter | Sequence[Adapter] = None,
             chat_template: str | None = None,
             chat_template_content_format: str = "auto") -> list[GenerationOutput]:
        """One or more message lists, each rendered with the model's chat template (or
        `chat_template`: a file's path or the template itself, as vLLM's LLM.chat takes).
        A message's content is text or OpenAI's text parts; `chat_template_content_format`
        (vLLM's) says which the template reads: 'string', 'openai' or 'auto' (lists of parts
        where the template loops over a message's content)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        encoded = [(None, self.engine.apply_chat_template(list(c), chat_template,
                                                          chat_template_content_format))
                   for c in conversations]
        return self._run(encoded, params, use_tqdm, lora_request)

    def _adapter(self, request: Adapter) -> str | None:
        """The adapter's name, loading it from its folder if it is new."""
        if request is None or isinstance(request, str):
            return request
        executor = self.engine.core.executor
        adapters = executor.adapters()
        if adapters is not None and request.lora_path and request.lora_name not in adapters:
            executor.register_adapter(request.lora_name, request.lora_path)
        return request.lora_name

    def _run(self, encoded: list[tuple[str | None, list[int]]],
             params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool, lora_request: Adapter | Sequence[Adapter] = None,
             ) -> list[GenerationOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or self.get_default_sampling_params()] * len(encoded)
        if len(params) != len(encoded):
            raise ValueError(f"{len(params)} SamplingParams for {len(encoded)} prompts")
        if lora_request is not None:
            adapters = ([lora_request] * len(encoded)
                        if isinstance(lora_request, (str, LoRARequest)) else list(lora_request))
            if len(adapters) != len(encoded):
                raise ValueError(f"{len(adapters)} LoRA requests for {len(encoded)} prompts")
            params = [p if a is None else replace(p, lora=self._adapter(a))
                      for p, a in zip(params, adapters)]
        results: dict[str, GenerationOutput] = {}
        order = []
        try:
            for (text, ids), p in zip(encoded, params):
                rid = self.engine.add_request(ids, p)
                order.append(rid)
                results[rid] = GenerationOutput(rid, text, ids,
                                                [CompletionOutput(i) for i in range(p.n)])
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            raise
        bar = tqdm(total=len(order), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for u in self.engine.step():
                    result = results[u.root_id]
                    seq = result.outputs[u.index]
                    seq.token_ids.extend(u.new_token_ids)
                    seq.text += u.new_text
                    if u.logprobs is not None:
                        seq.logprobs = (seq.logprobs or []) + u.logprobs
                    if u.prompt_logprobs is not None:
                        result.prompt_logprobs = (result.prompt_logprobs or []) + u.prompt_logprobs
                    if u.embedding is not None:
                        result.embedding = u.embedding
                    if u.index == 0:
                        result.num_cached_tokens = u.cached_tokens
                    if u.finished:
                        seq.finish_reason = u.finish_reason
                        if result.finished:
                            bar.update(1)
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in order]
