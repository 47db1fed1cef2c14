"""The data-parallel dispatcher: batches, the token budget, the free-blocks check, aborts,
dead cores and shutdown, driven without processes (its `send` records what went where)."""

from __future__ import annotations

import threading
import time
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.cluster.dispatcher import Dispatcher
from tidal.cluster.prefix_index import PrefixIndex, block_hashes
from tidal.cluster.routing import Router
from tidal.core import SamplingParams
from tidal.engine.messages import Abort, Add


def item(rid: str, n: int, max_tokens: int = 16, first: int = 0) -> Add:
    return Add(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens), 0.0)


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []
        self.event = threading.Event()

    def __call__(self, core: int, msg) -> None:
        self.sent.append((core, msg))
        self.event.set()

    def ids(self, core: int | None = None) -> list[str]:
        return [x.request_id for c, x in self.sent if core in (None, c) and isinstance(x, Add)]


def make(policy="least_tokens", cores=2, blocks=64, budget=1000, timeout=0.05):
    rec = Recorder()
    return Dispatcher(Router(policy, cores), rec, blocks, 16, budget, timeout), rec


def route(d: Dispatcher, *items) -> int:
    """Submit `items`, then route one batch as the dispatcher's thread does; how many went."""
    for x in items:
        d.submit(x)
    with d._cond:
        return d._route_batch()


def wait_for(cond, timeout=5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_requests_that_arrive_within_the_timeout_go_in_one_batch_spread_over_cores():
    d, rec = make(timeout=0.3)
    d.start()
    for i in range(4):
        d.submit(item(f"r{i}", 40))
    wait_for(lambda: len(rec.sent) == 4)
    d.close()
    assert d.batches == 1
    # least outstanding tokens alternates between the two idle cores
    assert rec.ids(0) == ["r0", "r2"] and rec.ids(1) == ["r1", "r3"]


def test_the_token_budget_closes_a_batch_without_waiting_for_the_timeout():
    d, rec = make(budget=100, timeout=2.0)
    d.start()
    t0 = time.monotonic()
    d.submit(item("a", 60))
    d.submit(item("b", 60))  # 120 queued tokens >= 100: route now, a alone (a + b > budget)
    wait_for(lambda: len(rec.sent) == 1)
    assert time.monotonic() - t0 < 1.5
    wait_for(lambda: len(rec.sent) == 2)  # b, under budget alone, waits out its timeout
    assert time.monotonic() - t0 >= 2.0
    d.close()
    assert d.batches == 2 and rec.ids() == ["a", "b"]


def test_a_request_the_target_core_has_no_room_for_stays_queued_until_a_report():
    d, rec = make(cores=1, blocks=64)
    d.report(0, free_blocks=4, outstanding_tokens=0, new_token_ratio=1.0, adds_seen=0)
    for rid, n in (("small", 30), ("big", 100), ("after", 10)):  # 3, 8, 2 blocks with output
        d.submit(item(rid, n))
    with d._cond:
        assert d._route_batch() == 1
    assert rec.ids() == ["small"] and d.num_queued == 2  # FIFO: "after" waits behind "big"
    assert d.views[0].free() == 4 - 3 and d.views[0].load() == 46
    # the core took "small" and reports room: the rest go
    d.report(0, free_blocks=20, outstanding_tokens=46, new_token_ratio=1.0, adds_seen=1)
    assert d.views[0].free() == 20
    with d._cond:
        assert d._route_batch() == 2
    assert rec.ids() == ["small", "big", "after"] and d.num_queued == 0


def test_a_request_larger_than_a_whole_core_is_sent_for_the_core_to_refuse():
    d, rec = make(cores=1, blocks=8)
    d.submit(item("huge", 500))
    with d._cond:
        assert d._route_batch() == 1
    assert rec.ids() == ["huge"]


def test_abort_drops_a_queued_request_and_forwards_one_already_routed():
    d, rec = make(cores=2)
    d.submit(item("a", 10))
    d.submit(item("b", 10))
    d.abort("a")  # still queued: dropped, never sent
    with d._cond:
        d._route_batch()
    assert rec.ids() == ["b"]
    core = d.core_of["b"]
    d.abort("b")
    assert rec.sent[-1] == (core, Abort("b")) and "b" not in d.core_of


def test_a_dead_core_gets_nothing_more_and_hands_back_its_requests():
    d, rec = make(policy="round_robin", cores=2)
    route(d, item("r0", 10), item("r1", 10))
    assert d.core_died(0) == ["r0"]
    route(d, *(item(f"r{i}", 10) for i in range(2, 5)))
    assert rec.ids(0) == ["r0"] and rec.ids(1) == ["r1", "r2", "r3", "r4"]
    d.core_died(1)
    assert route(d, item("late", 10)) == 0  # nowhere to go: stays queued for the frontend to fail
    assert [x.request_id for x in d.close()] == ["late"]


def test_a_dead_cores_requests_without_output_go_to_a_live_core():
    """Sent to a core that had died before its death was seen (or queued in it): no output
    reached the client, so the request goes to a live core rather than failing."""
    d, rec = make(policy="round_robin", cores=2)
    route(d, item("r0", 10), item("r1", 10), item("r2", 10), item("r3", 10))
    assert rec.ids(0) == ["r0", "r2"]
    d.submit(item("later", 10))  # arrived before the death was seen
    assert d.core_died(0, begun={"r0"}.__contains__) == ["r0"]  # r0 had streamed: it fails
    assert [x.request_id for _, x in d._queue] == ["r2", "later"]  # r2 first, in order
    route(d)
    assert rec.ids(1) == ["r1", "r3", "r2", "later"] and d.core_of["r2"] == 1
    d.abort("r2")  # a replayed request aborts on the core it went to
    assert rec.sent[-1] == (1, Abort("r2")) and "r2" not in d.sent


def test_a_request_whose_core_is_found_gone_goes_to_another():
    sent = []

    def send(core, msg):  # core 0's process is gone; the watcher has not said so yet
        if core == 0:
            return False
        sent.append(msg.request_id)
    d = Dispatcher(Router("round_robin", 2), send, 64, 16, 1000, 0.05)
    route(d, item("a", 10), item("b", 10), item("c", 10))
    assert sent == ["a", "b", "c"] and not d.views[0].alive and d.routed == [0, 3]


def test_a_restarted_core_rejoins_empty_and_takes_requests_again():
    d, rec = make(policy="round_robin", cores=2)
    route(d, item("r0", 10), item("r1", 10))
    d.report(1, 10, 500, 0.7, 0)  # its load before it died
    assert d.core_died(1) == ["r1"]
    d.core_rejoined(1)
    view = d.views[1]
    assert view.alive and view.free() == 64 and view.load() == 0 and view.adds_sent == 0
    d.report(1, 64, 0, 0.7, 0)  # the new incarnation counts its adds from zero
    route(d, item("r2", 10), item("r3", 10))
    assert rec.ids(1) == ["r1", "r2"] or rec.ids(1) == ["r1", "r3"]
    assert len(d.views[1].unseen) == 1


def test_close_ends_the_gathering_thread_and_returns_what_was_never_sent():
    d, rec = make(timeout=60.0)
    d.start()
    d.submit(item("waiting", 10))
    d.close()
    assert not d._thread.is_alive() and rec.sent == []


def test_prefix_aware_routing_sends_a_shared_prefix_where_it_went_before():
    d, rec = make(policy="prefix_aware", cores=3)
    system = list(range(1000, 1064))  # four full blocks shared by both prompts
    first = Add("x", system + [1, 2], SamplingParams(max_tokens=4), 0.0)
    d.submit(item("other", 10, first=5000))
    d.submit(first)
    with d._cond:
        d._route_batch()
    again = Add("y", system + [7, 8, 9], SamplingParams(max_tokens=4), 0.0)
    d.submit(again)
    with d._cond:
        d._route_batch()
    assert d.core_of["y"] == d.core_of["x"] != d.core_of["other"]


def test_slack_routing_counts_queued_prompts_reported_and_sent_since():
    """Core 0 reports 300 queued prompt tokens, core 1 none: a 200-token prompt goes to core 1,
    which then counts it until a report; the next goes to core 1 again (200 < 300), the one
    after to core 0 (350 > 300); once core 1 reports both prefilled, it is chosen again."""
    d, rec = make(policy="slack")
    d.report(0, 64, 300, 1.0, 0, prefill_tokens=300)
    route(d, item("a", 200))
    route(d, item("b", 150))
    route(d, item("c", 100))
    assert [d.core_of[r] for r in "abc"] == [1, 1, 0]
    d.report(1, 64, 40, 1.0, 2, prefill_tokens=0)
    route(d, item("d", 10))
    assert d.core_of["d"] == 1


def test_prefix_index_matches_whole_leading_blocks_and_forgets_least_recent():
    idx = PrefixIndex(block_size=4, capacity=3)
    idx.insert(block_hashes(list(range(12)), 4))
    assert idx.match(block_hashes(list(range(12)) + [99], 4)) == 12
    assert idx.match(block_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)) == 4
    idx.insert(block_hashes([50, 51, 52, 53], 4))  # over capacity: the oldest block goes
    assert idx.match(block_hashes(list(range(12)), 4)) == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 300), st.integers(1, 64)),
    st.tuples(st.just("report"), st.integers(0, 1), st.integers(0, 64)),
    st.tuples(st.just("abort"), st.integers(0, 40), st.just(0)),
    st.tuples(st.just("route"), st.just(0), st.just(0))), max_size=60),
    st.sampled_from(["round_robin", "least_tokens", "prefix_aware"]))
def test_every_request_is_sent_once_dropped_by_its_abort_or_still_queued(ops, policy):
    d, rec = make(policy=policy, cores=2, blocks=32, budget=400)
    submitted, aborted = [], set()
    for op, a, b in ops:
        if op == "submit":
            submitted.append(f"r{len(submitted)}")
            d.submit(item(submitted[-1], a, b))
        elif op == "report":
            d.report(a, b, 0, 1.0, d.views[a].adds_sent)
        elif op == "abort" and a < len(submitted):
            aborted.add(submitted[a])
            d.abort(submitted[a])
        else:
            with d._cond:
                sent = d._route_batch()
            assert sent > 0 or not d.num_queued or d._queue[0][1].request_id in submitted
    adds = [x.request_id for _, x in rec.sent if isinstance(x, Add)]
    queued = [x.request_id for x in d.close()]
    assert len(adds) == len(set(adds))  # nobody sent twice
    assert not set(adds) & set(queued)
    for rid in submitted:
        assert rid in adds or rid in queued or rid in aborted
    for core, x in rec.sent:  # an abort goes where its request went, after it
        if isinstance(x, Abort):
            before = [c for c, y in rec.sent[:rec.sent.index((core, x))]
                      if isinstance(y, Add) and y.request_id == x.request_id]
            assert before == [core]


def lora_item(rid: str, n: int, lora: str | None) -> Add:
    return Add(rid, list(range(100 * len(rid), 100 * len(rid) + n)),
               SamplingParams(max_tokens=16, lora=lora), 0.0)


def test_requests_of_an_adapter_go_where_it_is_held_until_that_core_is_far_busier():
    d, rec = make(budget=200)
    route(d, lora_item("a1", 40, "a"))
    route(d, lora_item("b1", 40, "b"))  # least tokens: the other core
    (core_a,), (core_b,) = ({c for c, x in rec.sent if x.params.lora == n} for n in "ab")
    assert core_a != core_b
    route(d, lora_item("a2", 40, "a"), lora_item("a3", 40, "a"))
    assert {c for c, x in rec.sent if x.params.lora == "a"} == {core_a}  # not least-loaded
    route(d, lora_item("base", 40, None))
    assert rec.sent[-1][0] == core_b  # base-model requests route by load alone
    for i in range(4, 12):  # once core_a carries a batch of tokens more, "a" spills over
        route(d, lora_item(f"a{i}", 40, "a"))
    assert core_b in {c for c, x in rec.sent if x.params.lora == "a"}
    for rid in ("a1", "a2", "a3"):
        d.done(rid)
    assert d.adapters[core_a]["a"] == sum(1 for c, x in rec.sent if c == core_a
                                          and x.params.lora == "a") - 3
