"""Waiting-queue policies: fcfs, priority, longest_prefix_match with aging, prefill_first;
each policy's own options and capabilities; and, under every policy, a request owing prompt
logprobs never reads the prefix cache."""

from dataclasses import fields

import pytest
from hypothesis import given, strategies as st

from tidal.core import Request, SamplingParams, SchedulerConfig
from tidal.core.policies import POLICIES, LongestPrefixMatch, Policy, SloPolicy

from conftest import add, make_scheduler, scheduled, step


def test_fcfs_stops_at_the_first_request_that_does_not_fit():
    """b does not fit (memory); c would, but does not overtake b."""
    s = make_scheduler(num_blocks=6, block_size=4, clip_max_new_tokens=1)
    add(s, "a", 12, max_tokens=4)
    add(s, "b", 12, max_tokens=4)
    add(s, "c", 2, max_tokens=4)
    out, _ = step(s)
    assert set(scheduled(out)) == {"a"} and [r.request_id for r in s.waiting] == ["b", "c"]


def test_priority_admits_the_lowest_value_first():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=1, policy="priority")
    add(s, "low", 3, max_tokens=1, priority=5)
    add(s, "high", 3, max_tokens=1, priority=-1)
    out, _ = step(s)
    assert set(scheduled(out)) == {"high"}


def _shared(s, rid, prefix_len, tail, max_tokens=1):
    r = Request(rid, [1] * prefix_len + tail, SamplingParams(max_tokens=max_tokens),
                arrival_time=len(s.requests))
    s.add_request(r)
    return r


def test_longest_prefix_match_prefers_cached_requests():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=1,
                       policy="longest_prefix_match")
    _shared(s, "warmup", 8, [9])
    step(s)
    add(s, "cold", 9, max_tokens=1)
    _shared(s, "warm", 8, [5])
    out, _ = step(s)
    assert set(scheduled(out)) == {"warm"} and scheduled(out)["warm"] == (1, 8)


def test_longest_prefix_match_ages_cold_requests_so_they_cannot_starve():
    """A stream of warm requests keeps arriving; the cold one still runs once it has waited
    lpm_aging_steps steps."""
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=1,
                       policy="longest_prefix_match", lpm_aging_steps=5)
    _shared(s, "warmup", 8, [9])
    step(s)
    cold = add(s, "cold", 9, max_tokens=1)
    for i in range(20):
        _shared(s, f"warm{i}", 8, [i + 10])
        out, _ = step(s)
        if "cold" in scheduled(out):
            break
    assert "cold" in scheduled(out) and 5 <= s.step - cold.enqueue_step <= 7


def test_longest_prefix_match_keeps_arrival_order_past_lpm_max_queue():
    """The cached case above, with two waiting requests and lpm_max_queue=1: no sorting."""
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=1,
                       policy="longest_prefix_match", lpm_max_queue=1)
    _shared(s, "warmup", 8, [9])
    step(s)
    add(s, "cold", 9, max_tokens=1)
    _shared(s, "warm", 8, [5])
    out, _ = step(s)
    assert set(scheduled(out)) == {"cold"}


def _names(options_cls) -> set[str]:
    return {f.name for f in fields(options_cls)}


def test_policy_knobs_live_in_their_policys_options_only():
    """SchedulerConfig has no field of any policy's; the chosen policy's options are built
    into its Options (defaults when unset), from names or given whole."""
    own = _names(SchedulerConfig)
    assert _names(LongestPrefixMatch.Options) == {"lpm_aging_steps", "lpm_max_queue"}
    assert _names(SloPolicy.Options) == {"ttft_slo_ms", "tpot_slo_ms", "slo_overload",
                                         "slo_max_defer_ms", "slo_step_headroom"}
    for cls in POLICIES.values():
        assert not own & _names(cls.Options), cls.name
    assert not [n for n in own if "lpm" in n or "slo" in n]
    assert SchedulerConfig().policy_options == Policy.Options()
    assert SchedulerConfig(policy="slo").policy_options == SloPolicy.Options()
    config = SchedulerConfig.from_kwargs(policy="longest_prefix_match", lpm_max_queue=3,
                                         max_num_seqs=4)
    assert config.policy_options == LongestPrefixMatch.Options(lpm_max_queue=3)
    assert config.max_num_seqs == 4 and config.as_kwargs()["lpm_max_queue"] == 3
    assert SchedulerConfig.from_kwargs(**config.as_kwargs()) == config
    given = SloPolicy.Options(ttft_slo_ms=500)
    assert SchedulerConfig(policy="slo", policy_options=given).policy_options is given


def test_a_policy_option_is_refused_with_another_policy_or_a_bad_value():
    with pytest.raises(ValueError, match="lpm_max_queue is an option of the "
                                         "longest_prefix_match policy; this scheduler runs "
                                         "'fcfs'"):
        SchedulerConfig.from_kwargs(lpm_max_queue=3)
    with pytest.raises(ValueError, match="ttft_slo_ms is an option of the slo policy; this "
                                         "scheduler runs 'priority'"):
        SchedulerConfig(policy="priority", policy_options={"ttft_slo_ms": 100})
    with pytest.raises(ValueError, match="the slo policy takes SloPolicy.Options"):
        SchedulerConfig(policy="slo", policy_options=LongestPrefixMatch.Options())
    with pytest.raises(TypeError, match="unknown scheduler option 'lpm_max'"):
        SchedulerConfig.from_kwargs(policy="longest_prefix_match", lpm_max=3)
    with pytest.raises(ValueError, match="lpm_aging_steps must be at least 1, got 0"):
        SchedulerConfig.from_kwargs(policy="longest_prefix_match", lpm_aging_steps=0)
    with pytest.raises(ValueError, match="tpot_slo_ms must be > 0, got -5"):
        SloPolicy.Options(tpot_slo_ms=-5)


# policy -> (takes latency targets, may reject with its default options)
CAPABILITIES = {"fcfs": (False, False), "prefill_first": (False, False),
                "priority": (False, False), "longest_prefix_match": (False, False),
                "slo": (True, False)}


def test_capabilities_are_declared_for_every_policy():
    assert set(CAPABILITIES) == set(POLICIES)


@pytest.mark.parametrize("policy", sorted(CAPABILITIES))
def test_each_policy_answers_what_it_can_do(policy):
    config = SchedulerConfig(policy=policy)
    cls = config.policy_class
    assert cls is POLICIES[policy]
    assert (cls.takes_latency_targets, cls.may_reject(config.policy_options)) == \
        CAPABILITIES[policy]
    assert cls.latency_targets(config.policy_options) == (None, None)


def test_the_slo_policy_may_reject_only_under_reject_and_reports_its_targets():
    defer = SloPolicy.Options(ttft_slo_ms=800, tpot_slo_ms=40)
    reject = SloPolicy.Options(ttft_slo_ms=800, slo_overload="reject")
    assert not SloPolicy.may_reject(defer) and SloPolicy.may_reject(reject)
    assert SloPolicy.latency_targets(defer) == (800, 40)
    assert SloPolicy.latency_targets(reject) == (800, None)


def test_prefill_first_holds_decodes_while_a_prefill_is_chunking():
    s = make_scheduler(num_blocks=64, block_size=4, chunked_prefill_size=4,
                       policy="prefill_first", clip_max_new_tokens=1)
    add(s, "a", 3, max_tokens=10)
    step(s)
    add(s, "long", 12, max_tokens=2)
    kinds = [step(s)[0].kind for _ in range(4)]
    assert kinds == ["prefill", "prefill", "mixed", "decode"]  # decodes resume with the last chunk
    s2 = make_scheduler(num_blocks=64, block_size=4, chunked_prefill_size=4,
                        clip_max_new_tokens=1)
    add(s2, "a", 3, max_tokens=10)
    step(s2)
    add(s2, "long", 12, max_tokens=2)
    assert step(s2)[0].kind == "mixed"  # fcfs decodes alongside the chunk


def test_prefill_first_step_without_decodes_is_a_prefill_step():
    """Whole prefills planned before the (empty) decode pass do not count as decodes."""
    s = make_scheduler(num_blocks=64, block_size=4, policy="prefill_first")
    add(s, "a", 3, max_tokens=10)
    out, _ = step(s)
    assert scheduled(out) == {"a": (3, 0)} and out.kind == "prefill"
    out, _ = step(s)
    assert out.kind == "decode"


def test_a_new_policy_decides_what_a_step_holds(monkeypatch):
    """A policy is one class: this one admits the shortest prompt first and runs no decode
    while a request waits or a prompt is chunking. The scheduler follows both decisions."""
    from tidal.core import policies
    from tidal.core.policies import Policy

    class ShortestFirstPrefillsFirst(Policy):
        name = "test_prefills_first"

        def order(self, waiting, step, prefix_tokens):
            return sorted(waiting, key=lambda r: r.num_prompt_tokens)

        def compose(self, sched, plan, decoding):
            sched.schedule_prefills(plan, decoding)
            if not sched.waiting and sched.active_prefill is None:
                sched.schedule_decodes(plan, decoding)

    monkeypatch.setitem(policies.POLICIES, "test_prefills_first", ShortestFirstPrefillsFirst)
    s = make_scheduler(num_blocks=64, block_size=4, max_input_tokens_per_step=8,
                       chunked_prefill_size=8, policy="test_prefills_first")
    add(s, "a", 4, max_tokens=8)
    step(s)
    add(s, "long", 12, max_tokens=2)
    add(s, "short", 3, max_tokens=2)
    out, _ = step(s)  # fcfs would decode "a" first and offer "long" the budget first
    assert scheduled(out) == {"short": (3, 0), "long": (4, 0)} and out.kind == "prefill"
    out, _ = step(s)
    assert scheduled(out) == {"long": (4, 4)}
    out, _ = step(s)  # the prompt is done: decodes join
    assert scheduled(out) == {"long": (4, 8), "a": (1, 4), "short": (1, 3)}
    assert out.kind == "mixed"


@given(requests=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 10), st.booleans(),
                                   st.integers(1, 6), st.integers(1, 2)),
                         min_size=1, max_size=10),
       policy=st.sampled_from(["fcfs", "priority", "longest_prefix_match", "prefill_first"]),
       num_blocks=st.integers(8, 40), chunk=st.sampled_from([4, 8, 64]),
       batch_mode=st.sampled_from(["separate", "mixed"]))
def test_a_request_owing_prompt_logprobs_never_admits_with_cached_tokens(
        requests, policy, num_blocks, chunk, batch_mode):
    """Shared prefixes, arrivals between steps, chunking and retractions: whenever a request
    whose prompt logprobs are still owed (no output yet) is admitted, it starts from token 0.
    Once it has output (a retraction, a forked sibling) it may read the cache again."""
    s = make_scheduler(num_blocks=num_blocks, block_size=4, policy=policy, batch_mode=batch_mode,
                       chunked_prefill_size=chunk, max_input_tokens_per_step=max(chunk, 16))
    pending = list(enumerate(requests))
    for _ in range(400):
        if pending:
            i, (prefix, tail, owes, max_tokens, n) = pending.pop(0)
            prompt = [10 + prefix] * 8 + [1000 * (i + 1) + t for t in range(tail)]
            s.add_request(Request(f"r{i}", prompt, SamplingParams(
                max_tokens=max_tokens, n=n, prompt_logprobs=1 if owes else None),
                arrival_time=float(i)))
        elif not s.has_unfinished_requests():
            break
        out, _ = step(s)
        computed = {x.request_id: x.num_computed_tokens for x in out.scheduled}
        for new in out.new_requests:
            if new.sampling_params.prompt_logprobs is not None and not new.output_token_ids:
                assert computed.get(new.request_id, 0) == 0
    assert not s.has_unfinished_requests()


def test_background_requests_wait_behind_live_ones_in_every_policy():
    for policy in ("fcfs", "priority", "longest_prefix_match"):
        s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=1, policy=policy)
        add(s, "batch", 3, max_tokens=1, background=True)
        add(s, "live", 3, max_tokens=1, priority=5)
        out, _ = step(s)
        assert set(scheduled(out)) == {"live"}, policy


def test_background_decodes_sit_out_the_steps_that_prefill_a_live_prompt():
    s = make_scheduler(num_blocks=64, block_size=4, chunked_prefill_size=4,
                       clip_max_new_tokens=1)
    add(s, "batch", 3, max_tokens=20, background=True)
    step(s)
    add(s, "chat", 3, max_tokens=20)
    assert set(scheduled(step(s)[0])) == {"chat"}  # the batch line sits out already
    add(s, "live", 10, max_tokens=2)  # three chunks of 4 tokens
    steps = [scheduled(step(s)[0]) for _ in range(4)]
    assert [set(x) for x in steps[:3]] == [{"chat", "live"}] * 3  # the batch line waits
    assert set(steps[3]) == {"chat", "live", "batch"}  # the prompt is in: it decodes again
    assert steps[3]["batch"][1] == steps[0]["chat"][1]  # and lost nothing meanwhile


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_background_partial_prefill_gives_way_to_a_live_prompt(prefix_caching):
    """The live prompt needs the one chunked-prefill slot: the background prompt, retracted,
    resumes from its cached blocks once the live prompt is in; without a prefix cache it
    would start over, so it keeps the slot instead."""
    s = make_scheduler(num_blocks=64, block_size=4, chunked_prefill_size=4,
                       max_input_tokens_per_step=4)
    s.kv.pool.enable_prefix_caching = prefix_caching
    add(s, "batch", 14, max_tokens=2, background=True)
    assert scheduled(step(s)[0]) == {"batch": (4, 0)}
    add(s, "live", 10, max_tokens=2)
    ran = [scheduled(step(s)[0]) for _ in range(5)]
    if prefix_caching:
        assert ran[:3] == [{"live": (4, 0)}, {"live": (4, 4)}, {"live": (2, 8)}]
        assert ran[4] == {"batch": (4, 4)}  # its first 4 tokens are cached: resumed
        assert s.num_preemptions == 1
    else:
        assert ran[:3] == [{"batch": (4, 4)}, {"batch": (4, 8)}, {"batch": (2, 12)}]
        assert s.num_preemptions == 0
    s.check_invariants()


def test_background_decodes_go_on_when_the_live_prompt_cannot_be_admitted():
    """A live prompt that does not fit is no reason to stop the decodes that free memory."""
    s = make_scheduler(num_blocks=6, block_size=4, clip_max_new_tokens=1)
    add(s, "batch", 8, max_tokens=4, background=True)
    step(s)
    add(s, "live", 20, max_tokens=2)  # 5 blocks + growth: waits for the batch line's
    ran = [scheduled(step(s)[0]) for _ in range(4)]
    assert ran == [{"batch": (1, 8)}, {"batch": (1, 9)}, {"batch": (1, 10)}, {"live": (20, 0)}]
