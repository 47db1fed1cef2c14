"""Prompt logprobs (vLLM's `prompt_logprobs`): every prompt position's entry equals HF's
log_softmax over a whole-prompt forward pass, whether the prompt runs in one step or in
chunks, beside requests that ask for none, after its prefix is cached, with n=2, through a
retraction, across P/D disaggregation and through the server's ZMQ client."""

from __future__ import annotations

import asyncio

import pytest
import torch

from model_fixtures import small_folder
from tidal import LLM, SamplingParams
from tidal.core import PromptLogprob, RequestOutput, TokenLogprob
from tidal.engine.config import EngineConfig
from tidal.model.tokenizer import Tokenizer

PROMPT = [(7 * i + 3) % 250 + 3 for i in range(22)]  # 22 tokens: 3 chunks of 8
OTHER = [(5 * i + 11) % 250 + 3 for i in range(13)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return small_folder(tmp_path_factory.mktemp("plp"), "llama", "llama")


@pytest.fixture(scope="module")
def reference(folder):
    """A prompt's next-token logprobs from one HF forward pass: row i predicts token i+1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    return logprobs


def check(entries, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """One entry per prompt token, None first; each equals the reference, its alternatives
    are the top k sorted by logprob, the first being the argmax, and its rank is the
    token's place in the whole distribution."""
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        assert isinstance(entries[i], PromptLogprob)
        alts = entries[i].top
        row = ref[i - 1]
        assert entries[i].logprob == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        assert entries[i].rank == int((row > row[prompt[i]]).sum()) + 1
        assert len(alts) == k
        if k:
            top = row.topk(k)
            assert [t for t, _ in alts] == top.indices.tolist()
            assert [v for _, v in alts] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert [v for _, v in alts] == sorted((v for _, v in alts), reverse=True)
            assert alts[0][0] == int(row.argmax())


def make_llm(folder, **kwargs) -> LLM:
    return LLM(str(folder), dtype="float32", block_size=4, **{"num_kv_blocks": 128, **kwargs})


def params(k: int | None = 3, **kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 3, "temperature": 0.0, "ignore_eos": True,
                             "prompt_logprobs": k, **kwargs})


def spy_steps(llm: LLM) -> list:
    """The plans the runner executes."""
    steps, execute = [], llm.engine.runner.execute
    llm.engine.runner.execute = lambda out: steps.append(out) or execute(out)
    return steps


def test_a_single_request(folder, reference):
    out = make_llm(folder).generate([{"prompt_token_ids": PROMPT}], params(), use_tqdm=False)[0]
    check(out.prompt_logprobs, PROMPT, reference(PROMPT), 3)
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prompt_in_three_chunks(folder, reference, async_scheduling):
    llm = make_llm(folder, chunked_prefill_size=8, max_input_tokens_per_step=8,
                   max_forward_tokens=8, async_scheduling=async_scheduling)
    steps = spy_steps(llm)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params(), use_tqdm=False)[0]
    chunks = [s for o in steps for s in o.scheduled if s.is_prefill]
    assert [s.num_new_tokens for s in chunks] == [8, 8, 6]
    check(out.prompt_logprobs, PROMPT, reference(PROMPT), 3)


def test_a_batch_mixing_requests_with_and_without(folder, reference):
    prompts = [PROMPT, OTHER, PROMPT[:5], [42]]
    asked = [params(3), params(None), params(0), params(2)]
    llm = make_llm(folder, batch_mode="mixed", chunked_prefill_size=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], asked, use_tqdm=False)
    check(outs[0].prompt_logprobs, PROMPT, reference(PROMPT), 3)
    assert outs[1].prompt_logprobs is None
    check(outs[2].prompt_logprobs, PROMPT[:5], reference(PROMPT[:5]), 0)
    assert outs[3].prompt_logprobs == [None]  # one token: nothing before it to predict it
    alone = make_llm(folder).generate([{"prompt_token_ids": p} for p in prompts],
                                      params(None), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]


def test_a_cached_prompt_is_computed_whole_and_others_still_hit(folder, reference):
    llm = make_llm(folder)
    sched = llm.engine.scheduler

    def run(p: SamplingParams):
        return llm.generate([{"prompt_token_ids": PROMPT}], p, use_tqdm=False)[0]
    run(params(None))
    hits = sched.prefix_hit_tokens
    steps = spy_steps(llm)
    out = run(params(4))
    assert sched.prefix_hit_tokens == hits  # it read nothing from the cache
    assert [s.num_computed_tokens for o in steps for s in o.scheduled if s.is_prefill] == [0]
    check(out.prompt_logprobs, PROMPT, reference(PROMPT), 4)
    run(params(None))
    assert sched.prefix_hit_tokens >= hits + 20  # the next one hits again


def test_n_2_reports_them_once_on_index_0(folder, reference):
    llm = make_llm(folder)
    llm.engine.add_request(PROMPT, params(2, n=2, temperature=1.0, seed=3, max_tokens=4))
    updates = []
    while llm.engine.has_unfinished_requests():
        updates += llm.engine.step()
    with_prompt = [u for u in updates if u.prompt_logprobs is not None]
    assert len(with_prompt) == 1 and with_prompt[0].index == 0
    assert with_prompt[0].new_token_ids  # they come with index 0's first token
    check(with_prompt[0].prompt_logprobs, PROMPT, reference(PROMPT), 2)
    assert {u.index for u in updates} == {0, 1}
    out = llm.generate([{"prompt_token_ids": PROMPT}], params(2, n=2, temperature=1.0, seed=3),
                       use_tqdm=False)[0]
    check(out.prompt_logprobs, PROMPT, reference(PROMPT), 2)


def test_a_retracted_request_reports_each_position_once(folder, reference):
    """A pool too small for both outputs: one request is retracted and recomputes its
    prompt (and output); its prompt logprobs still arrive once, whole."""
    llm = make_llm(folder, num_kv_blocks=14, batch_mode="mixed", init_new_token_ratio=0.0)
    prompts = [PROMPT, OTHER]
    long = [params(3, max_tokens=24), params(1, max_tokens=24)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], long, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    check(outs[0].prompt_logprobs, PROMPT, reference(PROMPT), 3)
    check(outs[1].prompt_logprobs, OTHER, reference(OTHER), 1)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)


def test_a_chunked_prefill_retracted_midway_starts_its_entries_over(folder, reference):
    """The runner forgets a request's gathered entries when it comes back after a retraction
    mid-prompt, and computes them all again from position 0."""
    from tidal.core import NewRequest, ScheduledRequest, SchedulerOutput

    runner = make_llm(folder).engine.runner
    p = params(2)
    new = NewRequest("r", PROMPT, [], p, [], 1)
    table = list(range(6))
    first = SchedulerOutput(1, "prefill", [ScheduledRequest("r", 8, 0, table, False, True)],
                            [new])
    assert runner.execute(first).prompt_logprobs == {}  # gathered, not sent: no token yet
    back = SchedulerOutput(2, "prefill", [ScheduledRequest("r", 22, 0, table, True, True)],
                           [new], preempted_ids=[])
    result = runner.execute(back)
    check(result.prompt_logprobs["r"], PROMPT, reference(PROMPT), 2)
    again = NewRequest("r", PROMPT, result.sampled["r"], p, [], 1)  # retracted after a token
    decode = SchedulerOutput(3, "prefill", [ScheduledRequest("r", 23, 0, table, True, True)],
                             [again])
    assert runner.execute(decode).prompt_logprobs == {}


def drive(pair) -> dict[str, list[RequestOutput]]:
    """Step both sides until idle, as the core loop does; the outputs the decode side's
    frontend would get, by request."""
    got: dict[str, list[RequestOutput]] = {}
    while pair.d.has_work() or pair.p.has_work():
        for link, core in ((pair.pl, pair.p), (pair.dl, pair.d)):
            outs = []
            for sock in link.sockets:
                if not sock.closed and sock.poll(5):
                    outs += link.handle(sock)
            if core.can_step():
                outs += core.step()
            for o in link.after_step(outs):
                assert link is pair.dl  # a prefill core's outputs all go to the decode core
                got.setdefault(o.request_id, []).append(o)
    return got


def test_prefill_and_decode_instances_carry_them_across(folder, reference):
    """The first token's logprobs and the prompt logprobs cross in KVBlocks and arrive on
    the landed first token's output; every token's entry equals a mixed engine's."""
    from test_kv_transfer import Pair, make_core

    asked = params(3, logprobs=2)
    pair = Pair(folder)
    try:
        pair.add("plain", PROMPT, params(None))
        assert all(o.logprobs is None and o.prompt_logprobs is None
                   for o in drive(pair)["plain"])
        hits = (pair.p.scheduler.prefix_hit_tokens, pair.d.scheduler.prefix_hit_tokens)
        pair.add("a", PROMPT, asked)
        outs = drive(pair)["a"]
        assert (pair.p.scheduler.prefix_hit_tokens, pair.d.scheduler.prefix_hit_tokens) == hits
        assert [o.prompt_logprobs is not None for o in outs] == [True] + [False] * (
            len(outs) - 1)  # with the first token only
        check(outs[0].prompt_logprobs, PROMPT, reference(PROMPT), 3)
        assert all(len(o.logprobs) == len(o.new_token_ids) for o in outs)
        assert sum(len(o.logprobs) for o in outs) == 3  # the first's came from the prefill side
    finally:
        pair.close()
    mixed = make_core(folder, "mixed")
    mixed.add("a", PROMPT, asked)
    alone: list[RequestOutput] = []
    while mixed.has_work():
        alone += mixed.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == [t for o in alone for t in o.new_token_ids] and len(tokens) == 3
    pd = [e for o in outs for e in o.logprobs]
    one = [e for o in alone for e in o.logprobs]
    assert all(isinstance(e, TokenLogprob) for e in pd)
    assert [e.logprob for e in pd] == pytest.approx([e.logprob for e in one], abs=1e-5)
    assert [[t for t, _ in e.top] for e in pd] == [[t for t, _ in e.top] for e in one]
    plp, own = outs[0].prompt_logprobs[1:], alone[0].prompt_logprobs[1:]
    assert [e.rank for e in plp] == [e.rank for e in own]
    assert [e.logprob for e in plp] == pytest.approx([e.logprob for e in own], abs=1e-5)


def test_through_the_server_core_client(folder, reference):
    """A real engine-core process: its Outputs carry the prompt logprobs over ZMQ into the
    frontend's StepUpdates."""
    from tidal.runtime.client import CoreClient

    config = EngineConfig.from_kwargs(model=str(folder), dtype="float32", block_size=4,
                                      num_kv_blocks=64, chunked_prefill_size=8, num_threads=1)

    async def run() -> list:
        client = CoreClient(config, str(folder), Tokenizer(folder))
        await client.start(timeout=120)
        try:
            queue = await client.add("q", PROMPT, params(3))
            updates = []
            while not (updates and updates[-1].finished):
                updates.append(await asyncio.wait_for(queue.get(), 60))
            return updates
        finally:
            await client.shutdown()
    updates = asyncio.run(run())
    entries = [e for u in updates for e in (u.prompt_logprobs or [])]
    check(entries, PROMPT, reference(PROMPT), 3)
    assert updates[0].prompt_logprobs is not None and updates[0].new_token_ids
