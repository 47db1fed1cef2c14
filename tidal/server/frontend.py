"""The server's one `Frontend`: the engine client, the tokenizer, the metrics and the
server's settings, and a request's way from submit to its last update (`generate`, `embed`).
The routes reach it as `FrontendDep` (at `app.state.frontend`)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace
from functools import partial
from typing import Annotated, AsyncGenerator, Callable, Mapping

from fastapi import Depends, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from tidal.core import SamplingParams
from tidal.engine.outputs import StepUpdate
from tidal.engine.structured import Grammars
from tidal.model.generation_config import end_token_ids, sampling_defaults
from tidal.model.logits_processors import check_extra_args, load_processors
from tidal.runtime.client import CoreClient, EngineDeadError, Failure
from tidal.server.batches.runner import BACKGROUND_HEADER, BatchRunner
from tidal.server.beam_search import beam_search_updates
from tidal.server.config import ServerConfig
from tidal.server.dashboard import DashboardHub
from tidal.server.disconnects import after_first, unless_client_leaves
from tidal.server.in_flight import InFlight
from tidal.server.lora_routes import Adapters
from tidal.server.metrics import RequestTally, ServerMetrics
from tidal.server.openai.chat import ChatRequest
from tidal.server.openai.chat_output import (ChatOutputOptions, mistral_call_id,
                                             openai_call_id)
from tidal.server.openai.embeddings import EmbeddingRequest
from tidal.server.openai.generation_bodies import GenerationResponse, Updates
from tidal.server.openai.protocol import APIError, GenerationRequest, check_token_ids, truncated
from tidal.server.openai.reasoning import MARKERS, prompt_opens_thinking
from tidal.server.openai.tool_parsers import (AUTO_PARSERS, NamedCallParser, RequiredCallsParser,
                                              parser_for_template)
from tidal.server.request_log import RequestLog
from tidal.server.responses.store import ResponseStore
from tidal.server.stream_interval import every_n_tokens
from tidal.server.tracing import RequestSpan, Tracing, operation_of

log = logging.getLogger("tidal.server")


class Frontend:
    """What the routes serve from: the engine cores' client, the tokenizer, the metrics and
    the server's settings. `generate` takes a checked, tokenized request to its response."""

    def __init__(self, client: CoreClient, config: ServerConfig) -> None:
        self.client, self.config = client, config
        self.tokenizer = client.tokenizer
        self.metrics = ServerMetrics(client, config.model_name)
        self.dashboard = DashboardHub(client, self.metrics, config.model_name)
        self.grammars: Grammars | None = None  # structured outputs' compiler, on first use
        self.reserved = 0  # sequences of requests being checked and sent (see submit)
        self.background = 0  # sequences of Batch API lines among them and those in flight
        self.batches: BatchRunner | None = None  # the online Batch API's worker
        self.health_probe: asyncio.Future | None = None  # /health_generate's, in flight
        self.request_log = (RequestLog(self.tokenizer, config.enable_log_outputs,
                                       config.max_log_len)
                            if config.enable_log_requests else None)
        self.in_flight = InFlight(client)
        self.responses = ResponseStore(config.response_store_bytes, config.response_ttl)
        self.tracing = (Tracing(config.otlp_traces_endpoint)
                        if config.otlp_traces_endpoint else None)
        self.adapters = Adapters(client, config.served_model_name,
                                 config.enable_lora_runtime_updates)
        parser = config.tool_call_parser
        if parser == "auto":  # the format the model's chat template speaks
            template = getattr(self.tokenizer, "chat_template", None)
            parser = parser_for_template(getattr(template, "source", None))
        self.tool_parser = AUTO_PARSERS[parser]
        self.call_id = mistral_call_id if parser == "mistral" else openai_call_id
        self.reasoning = MARKERS.get(config.reasoning_parser)  # None: no split
        # custom logits processors, for their check of a request's vllm_xargs
        self.processor_classes = load_processors(client.config.model.logits_processors)
        model = client.config.model
        # the model's end tokens (beam search's); the cores read the same
        self.end_tokens = end_token_ids(client.folder, self.tokenizer.eos_token_id)
        # what a generation request leaves unset takes the model's recommendation
        self.sampling_defaults = sampling_defaults(client.folder, model.generation_config,
                                                   model.override_generation_config)
        if self.sampling_defaults:
            log.info("sampling defaults from the model's generation config (a request's own "
                     "values win; --generation-config vllm: none): %s", self.sampling_defaults)

    def live_sequences(self) -> int:
        """Sequences in flight or being sent that are not Batch API lines."""
        return self.client.num_outstanding + self.reserved - self.background

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter `name` is (None: the base model); a 400 if it is neither."""
        return self.adapters.resolve(name)

    def check_task(self, task: str) -> None:
        """A 400 for an endpoint of the task this server was not started for (--task)."""
        if self.config.task not in ("auto", task):
            serves = {"embed": "embeddings", "score": "scores and reranking"}.get(
                self.config.task, "generation")
            raise APIError(f"this server serves {serves} only (--task {self.config.task})",
                           code="unsupported_task")

    def check_chat_template(self, template: str | None) -> None:
        """A 400 for a request's own chat template on a server that does not run them."""
        if template is not None and not self.config.trust_request_chat_template:
            raise APIError("this server renders its own chat template only: a request's "
                           "chat_template needs --trust-request-chat-template",
                           param="chat_template")

    def chat_options(self, body: ChatRequest) -> ChatOutputOptions:
        """How a chat request's replies are read: its tool choice and the reasoning split."""
        mode = body.tool_mode()
        names = [t.function.name for t in body.tools or ()]
        parser = {"none": None, "auto": self.tool_parser,
                  "required": partial(RequiredCallsParser, names)}.get(mode)
        if parser is None and mode != "none":  # a forced function
            parser = partial(NamedCallParser, mode)
        return ChatOutputOptions(
            tool_parser=parser, named=mode not in ("none", "auto", "required"),
            call_id=self.call_id,
            parallel=body.parallel_tool_calls, reasoning=self.reasoning,
            prompt_opens_thinking=self.reasoning is not None and prompt_opens_thinking(
                body.prompt_text(), self.reasoning),
            include_reasoning=body.include_reasoning,
            role=self.config.response_role if body.add_generation_prompt
            else body.messages[-1].role)  # vLLM's: a message continued keeps its role

    async def start(self, response_cls: type[GenerationResponse], body: GenerationRequest,
                    prompts: list[list[int]], headers: Mapping[str, str],
                    **options) -> tuple[GenerationResponse, Updates, Submission | None]:
        """Submit the prompts and make their response (`options` go to it: a chat's
        ChatOutputOptions): the response, its updates, and the submission (None for a beam
        search), which whoever answers ends (`finish`)."""
        cut = truncated(prompts, body.truncate_prompt_tokens, self.client.ready.max_model_len)
        if cut != prompts and options.get("sent"):  # an echo shows the prompt computed
            options["sent"] = None
        prompts = cut
        if body.use_beam_search:  # its steps' requests are its own (beam_search.py)
            sub, updates = None, beam_search_updates(self, prompts, body, headers)
        else:
            sub = await self.submit(prompts, body, headers)
            updates = self.updates(sub)
        try:
            # vLLM's request_id names the answer; the engine's ids stay the server's own
            rid = body.request_id or (sub.rids[0] if sub is not None else uuid.uuid4().hex[:16])
            response = response_cls(self.tokenizer, self.config.model_name, rid,
                                    prompts, len(prompts) * body.n,
                                    body.num_logprobs() is not None,
                                    self.grammars.token_bytes if self.grammars else None,
                                    prompt_logprobs=body.prompt_logprobs is not None,
                                    token_ids=body.return_token_ids,
                                    tokens_as_ids=body.return_tokens_as_token_ids
                                    or self.config.return_tokens_as_token_ids, **options)
        except BaseException:
            await finish(sub, updates)
            raise
        if sub is not None:  # abortable by its names (SGLang's /abort_request)
            self.in_flight.add(sub, [rid, response.id], options.get("rids") or [])
        return response, updates, sub

    async def generate(self, response_cls: type[GenerationResponse],
                       body: GenerationRequest, prompts: list[list[int]], request: Request,
                       **options):
        """Submit the prompts, then answer with the whole body or an SSE stream; `options`
        go to the response (a chat's ChatOutputOptions)."""
        response, updates, sub = await self.start(response_cls, body, prompts,
                                                  request.headers, **options)
        stream = None  # once made, its background task ends the submission
        try:
            if not body.stream:
                return await unless_client_leaves(request, response.body(updates))
            asked = body.stream_options  # --enable-force-include-usage: as if it asked
            include_usage = self.config.enable_force_include_usage or bool(
                asked and asked.include_usage)
            response.continuous_usage = include_usage and bool(
                asked and asked.continuous_usage_stats)
            sched = self.client.config.scheduler
            if sched.policy_class.may_reject(sched.policy_options):
                # A rejection comes before the first token: hold the headers until then, so
                # that it is a plain 503 rather than an error event inside a 200 stream.
                updates = await unless_client_leaves(request, after_first(updates))
                if isinstance(updates, Response):
                    return updates  # the client left
            interval = self.config.stream_interval
            events = response.events(every_n_tokens(updates, interval) if interval > 1
                                     else updates, include_usage)
            stream = StreamingResponse(events, media_type="text/event-stream",
                                       background=BackgroundTask(_closed, events, sub))
            return stream
        finally:  # the answer is whole, the client left or an error came
            if stream is None:
                await finish(sub, updates)

    async def embed(self, body: EmbeddingRequest, prompts: list[list[int]],
                    request: Request) -> Response | dict:
        """Submit each input for its embedding; the body once all are back."""
        prompts = truncated(prompts, body.truncate_prompt_tokens,
                            self.client.ready.max_model_len)
        sub = await self.submit(prompts, body, request.headers)
        vectors: list = [None] * len(prompts)

        async def collect() -> None:
            async for i, u in self.updates(sub):
                if u.embedding is not None:
                    vectors[i] = u.embedding

        try:
            gone = await unless_client_leaves(request, collect())
        finally:
            await sub.end()
        if isinstance(gone, Response):
            return gone
        if any(v is None for v in vectors):  # a finished request always carries it
            raise APIError("an input's embedding did not come back", 500, "internal_error")
        return body.body(vectors, prompts, self.config.model_name)

    async def submit(self, prompts: list[list[int]], body: GenerationRequest,
                     headers: Mapping[str, str],
                     params: list[SamplingParams] | None = None) -> Submission:
        """Check every prompt and its sampling parameters (`params`: made already, by
        `sampling_params`), then send them all to the cores on one queue. Its sequences
        (prompts times n) count against --max-pending from the first check on."""
        client, config = self.client, self.config
        if not client.alive:
            raise unavailable(client.unavailable())
        n = body.n if params is None else params[0].n
        most = min(config.max_sequences_per_request, config.max_pending)
        sequences = len(prompts) * n
        if sequences > most:  # a 429 would say retry, which cannot help
            raise APIError(f"the request asks for {sequences} sequences ({len(prompts)} "
                           f"prompts, n={n}); this server takes at most {most} from one "
                           f"request", param="n" if n > 1 else "prompt")
        # checked and reserved with no await between: concurrent requests cannot overshoot
        if client.num_outstanding + self.reserved + sequences > config.max_pending:
            raise APIError("too many requests in flight; retry later", 429, "rate_limit_error")
        background = self.batches is not None and \
            headers.get(BACKGROUND_HEADER) == self.batches.token
        counted = sequences if background else 0  # as background, until the answer ends
        self.reserved += sequences
        self.background += counted
        try:
            sub = await self._checked_submit(prompts, body, headers, background, params)
        except BaseException:
            self.background -= counted
            raise
        finally:  # sent, the requests count themselves (client.num_outstanding)
            self.reserved -= sequences
        if counted:
            sub.on_end.append(partial(self._background_ended, counted))
        return sub

    def _background_ended(self, sequences: int) -> None:
        self.background -= sequences

    def sampling_params(self, prompts: list[list[int]],
                        body: GenerationRequest) -> list[SamplingParams]:
        """Each prompt's sampling parameters, checked against the model and the server's
        limits (an APIError names the field at fault), with the request's adapter."""
        client = self.client
        adapter = self.adapters.resolve(body.model)
        try:  # the server's processors check their arguments (the cores do again)
            check_extra_args(self.processor_classes, getattr(body, "vllm_xargs", None))
        except ValueError as exc:
            raise APIError(str(exc), param="vllm_xargs") from exc
        if isinstance(body, GenerationRequest):
            body.with_defaults(self.sampling_defaults)
        # the tool parser, or the reasoning split, reads its marker's text, a special token's
        keep_special = isinstance(body, ChatRequest) and (
            (self.tool_parser.KEEPS_SPECIAL_TOKENS and body.tool_mode() == "auto")
            or (self.reasoning is not None and self.reasoning.special))
        params = []
        for ids in prompts:
            if not ids:
                raise APIError("the prompt is empty", param=body.prompt_field)
            check_token_ids(ids, client.ready.vocab_size, body.prompt_field)
            params.append(body.to_sampling_params(self.config, len(ids),
                                                  client.ready.max_model_len,
                                                  client.ready.vocab_size))
            params[-1].lora = adapter
            if keep_special:
                params[-1].skip_special_tokens = False
            if params[-1].bad_words:  # as token sequences: the engine core has no tokenizer
                params[-1].bad_words_token_ids = self.tokenizer.bad_word_ids(
                    params[-1].bad_words)
        return params

    async def _checked_submit(self, prompts: list[list[int]], body: GenerationRequest,
                              headers: Mapping[str, str], background: bool,
                              params: list[SamplingParams] | None) -> Submission:
        client, config = self.client, self.config
        if params is None:
            params = self.sampling_params(prompts, body)
        adapter = params[0].lora
        for p in params:
            p.trace = self.tracing is not None  # its scheduler events, for the span
            p.background = background  # a Batch API line yields to the rest
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            if getattr(body, name) is not None and \
                    not client.config.scheduler.policy_class.takes_latency_targets:
                raise APIError(f"{name} needs a server started with --policy slo (this one "
                               f"schedules by {client.config.scheduler.policy!r})", param=name)
        constraint = body.output_constraint()
        if constraint is not None:  # compiled against the tokenizer: a 400 if it cannot be
            await self._check_constraint(*constraint)
        if body.num_logprobs() is not None:  # their `bytes` come from the grammar tokenizer
            await self._load_grammars()
        prefill = (body.kv_transfer_params or {}).get("prefill_address")
        if prefill is not None:
            body.check_disaggregated()
        span = None  # opened before the cores take the requests: their arrival is in it
        if self.tracing is not None:
            p = params[0]
            span = self.tracing.start(
                headers, operation_of(body), config.model_name,
                {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
                 "choice.count": p.n}, sum(map(len, prompts)))
        if prefill is not None and params[0].n > 1:  # a decode instance forks nothing
            prompts, params = _one_per_sequence(prompts, params)
        queue: asyncio.Queue = asyncio.Queue()
        base = uuid.uuid4().hex[:16]
        rids = [f"{base}-{i}" for i in range(len(prompts))]
        sent = 0
        try:
            for rid, ids, p in zip(rids, prompts, params):
                await client.add(rid, ids, p, queue, prefill)
                sent += 1
                if self.request_log is not None:
                    self.request_log.received(rid, ids, p)
        except EngineDeadError as exc:  # those already sent are aborted
            if span is not None:
                span.end()
            await Submission(client, self.metrics, rids[:sent], params[0].n).end()
            raise unavailable(exc) from exc
        sub = Submission(client, self.metrics, rids, params[0].n, queue, RequestTally(
            self.metrics, rids, list(map(len, prompts)), params[0].n, params[0].max_tokens))
        sub.span = span
        if self.request_log is not None:  # an aborted sequence's output is not kept
            sub.on_end.append(lambda: [self.request_log.forget(r) for r in rids])
        if adapter is not None:  # in use until the answer ends
            self.metrics.lora_request(adapter)
            in_flight = self.adapters.in_flight
            in_flight[adapter] += 1
            sub.on_end.append(lambda: in_flight.subtract([adapter]))
        return sub

    async def _load_grammars(self) -> Grammars:
        """The tokenizer as llguidance sees it, built once (in a thread: ~0.3 s)."""
        if self.grammars is None:
            tok, vocab = self.tokenizer, self.client.ready.vocab_size
            self.grammars = await asyncio.to_thread(Grammars, tok.to_json(), vocab,
                                                    tok.eos_token_id)
        return self.grammars

    async def _check_constraint(self, field: str, constraint: tuple[str, str]) -> None:
        """Compile an output constraint: a 400 naming `field` if it is over
        --max-constraint-bytes or does not compile (in a worker thread: the event loop goes
        on; the size bounds the work here and again in the engine core)."""
        size, most = len(constraint[1].encode()), self.config.max_constraint_bytes
        if size > most:
            raise APIError(f"the output constraint is {size} bytes; this server takes at most "
                           f"{most}", param=field)
        await self._load_grammars()
        try:
            await asyncio.to_thread(self.grammars.compile, *constraint)
        except ValueError as exc:
            raise APIError(str(exc), param=field) from exc

    async def updates(self, sub: Submission) -> Updates:
        """(choice index, update) until every choice finished, observing the latency
        metrics. Whoever answers ends the submission (`Submission.end`), so that it ends even
        when this generator is never opened or never closed."""
        n, tally = sub.n, sub.tally
        index_of = {rid: i for i, rid in enumerate(sub.rids)}
        while sub.left:
            item = await sub.queue.get()
            if isinstance(item, Failure):
                raise APIError(item.message, 503 if item.dead else 400,
                               "service_unavailable" if item.dead else "invalid_request_error")
            u: StepUpdate = item
            if self.request_log is not None:
                self.request_log.update(u)
            if sub.span is not None:
                sub.span.update(u.events, len(u.new_token_ids),
                                u.finish_reason if u.finished else None)
            tally.update(u, time.perf_counter())
            if u.finished:
                sub.left -= 1
                if u.finish_reason == "rejected":  # the slo policy's overload decision
                    raise APIError(u.finish_message or "overloaded", 503,
                                   "service_unavailable", retry_after=1)
            yield index_of[u.root_id] * n + u.index, u
        tally.close()


def _one_per_sequence(prompts: list[list[int]], params: list[SamplingParams]):
    """Each prompt n times, each its sequence as a fork makes it (`sibling`), the prompt's
    logprobs asked of the first alone: the n sequences of a decode instance, whose prompts
    another instance computes (each after the first a prefix-cache hit)."""
    copies = [(ids, replace(p.sibling(i), prompt_logprobs=p.prompt_logprobs if i == 0
                            else None))
              for ids, p in zip(prompts, params) for i in range(p.n)]
    return [ids for ids, _ in copies], [p for _, p in copies]


class Submission:
    """One request's sequences (prompts x n) from their submission to their end, however
    the answer goes: `end()`, called once by whoever answered, frees them, aborting those
    unfinished (the client left, an error), whether or not any update was ever read."""

    def __init__(self, client: CoreClient, metrics: ServerMetrics, rids: list[str], n: int,
                 queue: asyncio.Queue | None = None, tally: RequestTally | None = None) -> None:
        self.client, self.metrics, self.rids, self.n, self.queue = client, metrics, rids, n, queue
        self.tally = tally  # its metrics, as its updates are read
        self.left = len(rids) * n  # sequences not finished
        self.on_end: list[Callable[[], None]] = []  # each called once, at the end
        self.span: RequestSpan | None = None  # --otlp-traces-endpoint: this request's

    async def end(self) -> None:
        if self.span is not None:
            self.span.end()
        while self.on_end:
            self.on_end.pop()()
        if self.left:  # their unfinished sequences end as aborted
            self.metrics.finished("abort").inc(self.left)
        for rid in self.rids:
            if self.left:
                await self.client.abort(rid)  # free the blocks now
            else:
                self.client.release(rid)


async def finish(sub: Submission | None, updates: Updates) -> None:
    """End a request's sequences once its answer is whole or abandoned (a beam search's
    steps end with its updates)."""
    if sub is not None:
        await sub.end()
    else:
        await updates.aclose()


async def _closed(events: AsyncGenerator[str, None], sub: Submission | None) -> None:
    """After a stream: a hang-up cancels it wherever it waits, perhaps on sending a chunk
    with `events` paused at a yield (left to the garbage collector, its requests would
    decode on) or before its first step (`events` never opened): close both now (a beam
    search's steps end with its updates, which `events` closes)."""
    await events.aclose()
    if sub is not None:
        await sub.end()


def unavailable(exc: EngineDeadError) -> APIError:
    """A 503 for a dead or restarting engine (with Retry-After while restarting)."""
    return APIError(str(exc), 503, "service_unavailable", retry_after=exc.retry_after)


def get_frontend(request: Request) -> Frontend:
    return request.app.state.frontend


FrontendDep = Annotated[Frontend, Depends(get_frontend)]
