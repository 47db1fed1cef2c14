"""Steps of background work cut short for a live request (tidal/core/step_cut.py): which
plans may be cut, the scheduler's undo, and the engine core with a tiny model stopping
such a step between layers and answering with the tokens of a run that was never cut.
The Hypothesis state machine (test_scheduler_stateful.py) cuts steps at random too."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tidal.core import ModelOutput, SamplingParams
from tidal.core.invariants import check_invariants
from tidal.engine.config import EngineConfig
from tidal.engine.core import EngineCore

from conftest import add, scheduled, step
from model_fixtures import small_folder
from test_step_sizing import sized


def cut(s, out):
    """The executor stopped `out` between layers: nothing sampled."""
    outputs = s.update(out, ModelOutput(cut=True))
    s.check_invariants()
    return outputs


def test_a_cut_step_runs_again_as_it_was_planned():
    """A background prompt's chunk is cuttable; cut, the request is where the plan found
    it, and the next plan holds the same chunk. A chunk that ends the prompt, cut, is
    planned again too, then samples."""
    s = sized("fcfs", background_step_share=0.25)
    add(s, "batch", 20, background=True)
    first = s.schedule()
    assert first.cuttable and scheduled(first) == {"batch": (16, 0)}
    assert cut(s, first) == [] and s.requests["batch"].num_computed_tokens == 0
    assert s.active_prefill is s.requests["batch"]
    again, _ = step(s)
    assert scheduled(again) == {"batch": (16, 0)}
    last = s.schedule()
    assert last.cuttable and scheduled(last) == {"batch": (4, 16)}
    cut(s, last)
    r = s.requests["batch"]
    assert r.num_computed_tokens == 16 and r.num_in_flight == 0 and r.is_prefilling
    out, outputs = step(s)
    assert scheduled(out) == {"batch": (4, 16)} and outputs[0].new_token_ids == [7]


def test_a_cut_step_of_decodes_and_a_chunk_leaves_its_decodes_unsampled():
    s = sized("fcfs", background_step_share=0.25)
    add(s, "b1", 10, background=True)
    step(s)  # b1 decodes from now on
    add(s, "b2", 40, background=True)
    out = s.schedule()
    assert out.cuttable and scheduled(out) == {"b1": (1, 10), "b2": (16, 0)}
    cut(s, out)
    assert s.requests["b1"].output_token_ids == [7]  # its first token only, still
    assert scheduled(step(s)[0]) == {"b1": (1, 10), "b2": (16, 0)}


def test_only_steps_of_a_background_prompt_chunk_may_be_cut():
    """Decodes alone (a short step) or a live prompt's chunk are not cuttable; a background
    chunk beside a live decode is, and cut, the live decode's token comes a step later."""
    s = sized("fcfs", background_step_share=0.25)
    add(s, "b", 10, background=True)
    step(s)
    out, _ = step(s)
    assert not out.cuttable  # background decodes alone
    add(s, "live", 40)
    out, _ = step(s)
    assert scheduled(out) == {"live": (40, 0)} and not out.cuttable
    add(s, "b2", 40, background=True)
    out = s.schedule()
    assert out.cuttable and scheduled(out) == {"b": (1, 11), "live": (1, 40), "b2": (16, 0)}
    cut(s, out)
    assert len(s.requests["live"].output_token_ids) == 1
    assert scheduled(step(s)[0]) == scheduled(out)
    assert len(s.requests["live"].output_token_ids) == 2


def test_a_live_request_arriving_during_the_cut_step_takes_the_next():
    s = sized("fcfs", background_step_share=0.25)
    add(s, "batch", 200, background=True)
    step(s)
    out = s.schedule()
    assert out.cuttable
    cut(s, out)
    add(s, "live", 40)
    nxt, _ = step(s)
    assert nxt.preempted_ids == ["batch"] and scheduled(nxt) == {"live": (40, 0)}


@pytest.fixture()
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    return small_folder(tmp_path, "tiny", "llama", max_position_embeddings=300)


def answers(folder, cut_at: set[int]) -> tuple[dict[str, list[int]], int, int]:
    """Two background requests and, once the first has a token, a live one, greedy, on an
    engine core whose `live_waiting` says yes at its calls numbered in `cut_at` (each
    asked before a layer of a cuttable step): the tokens, the calls and the steps run."""
    core = EngineCore(EngineConfig.from_kwargs(
        model=str(folder), num_kv_blocks=200, num_threads=1, chunked_prefill_size=16,
        max_input_tokens_per_step=32), folder)
    calls = []

    def live_waiting() -> bool:
        calls.append(1)
        return len(calls) in cut_at

    assert core.cut_steps_when(live_waiting)
    for i, n in enumerate((40, 25)):
        core.add(f"b{i}", list(range(3 + i, 3 + i + n)),
                 SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, background=True))
    tokens: dict[str, list[int]] = {}
    steps = 0
    while core.has_work():
        if "b0" in tokens and "live" not in core.scheduler.requests and "live" not in tokens:
            core.add("live", list(range(50, 80)),
                     SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        check_invariants(core.scheduler)
    assert core.scheduler.stats().num_steps_cut == len(cut_at)
    core.close()
    return tokens, len(calls), steps


def test_the_engine_core_cuts_a_background_step_and_answers_as_uncut(folder):
    """Cut before the first layer of the first step and before the second of the next
    (the tiny model has two), the engine core takes two more steps and answers with the
    same tokens."""
    whole, asked, steps = answers(folder, set())
    assert all(len(t) == 8 for t in whole.values()) and asked >= 4
    cut_short, _, more = answers(folder, {1, 5})
    assert cut_short == whole and more == steps + 2


class _Core:
    """What the engine-core loop asks of its core while it takes messages."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.scheduler = type("S", (), {"role": type("R", (), {
            "refusal": staticmethod(lambda address, prompt_only: None)})()})()
        self.config = SimpleNamespace(model=SimpleNamespace(profiler_dir=None))

    def cut_steps_when(self, check) -> bool:
        self.check = check
        return True

    def add(self, rid, prompt, params, arrival) -> None:
        self.added.append(rid)

    def abort(self, rid) -> None:
        self.aborted.append(rid)


def test_the_core_loop_says_a_live_request_waits_and_keeps_the_messages_in_order():
    """Asked between layers, the loop takes the inbox's messages: background lines and an
    abort do not cut the step, a live request does; after the step every message held is
    handled in arrival order, before those that came later."""
    import zmq

    from tidal.engine import messages as m
    from tidal.runtime.core_process import _CoreLoop

    ctx = zmq.Context.instance()
    inbox, sender = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind("inproc://step-cut-test")
    sender.connect("inproc://step-cut-test")
    core = _Core()
    loop = _CoreLoop(core, inbox, None, None, 0)

    def send(msg) -> None:
        sender.send(m.encoder.encode(msg))

    def add(rid: str, background: bool) -> m.Add:
        return m.Add(rid, [1, 2, 3], SamplingParams(max_tokens=4, background=background), 0.0)

    try:
        send(add("b1", True))
        send(m.Abort("gone"))
        assert _eventually(lambda: len(loop.held) == 2, core.check) is False
        send(add("live", False))
        assert _eventually(lambda: len(loop.held) == 3, core.check) is True
        assert core.added == [] and core.aborted == []  # nothing reaches the core mid-step
        send(add("b2", True))
        time.sleep(0.05)
        loop._take_messages()
        assert core.added == ["b1", "live", "b2"] and core.aborted == ["gone"]
        assert loop.held == []
    finally:
        loop.compiler.shutdown()
        inbox.close(0)
        sender.close(0)


def _eventually(done, check) -> bool:
    """`check()` until `done()` (inproc delivery is quick, not instant); its last answer."""
    deadline = time.monotonic() + 5
    answer = check()
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
        answer = check()
    return answer
