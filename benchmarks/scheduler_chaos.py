"""A million random scheduler operations on tiny pools: add (n up to 3), step (sometimes
emitting EOS), abort, KV hand-off, in every role, batch mode, policy and executor mode, with
retraction forced by pools of 4-64 blocks. Every operation checks the scheduler's invariants
and the executor's view (`tests/scheduler_driver.py`); every few thousand operations the
scheduler drains and must end with every block free. Prints the figures; exits 1 on the
first violation, with the seed and the operation that broke it.

    python benchmarks/scheduler_chaos.py [--ops 1000000] [--seed 0] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from scheduler_driver import POLICIES, SLO_TARGETS, SchedulerDriver  # noqa: E402

ROLES = ["mixed", "mixed", "prefill", "decode"]


def random_driver(rng: random.Random) -> SchedulerDriver:
    """A scheduler drawn as the Hypothesis state machine draws one."""
    return SchedulerDriver(
        num_blocks=rng.randint(4, 64), block_size=rng.choice([2, 3, 4, 8, 16]),
        role=rng.choice(ROLES), batch_mode=rng.choice(["separate", "mixed"]),
        policy=rng.choice(POLICIES), async_scheduling=rng.random() < 0.5,
        chunk=rng.randint(1, 64), max_input=rng.randint(1, 96), max_num_seqs=rng.randint(1, 8),
        clip=rng.choice([1, 8, 4096]), margin=rng.choice([0.0, 0.0, 0.25]),
        ttft=rng.choice(SLO_TARGETS), tpot=rng.choice(SLO_TARGETS),
        overload=rng.choice(["defer", "reject"]), guesses=rng.choice([0, 0, 1, 3]),
        adaptive=rng.random() < 0.5, seed=rng.randint(0, 2**31),
        max_step_ms=rng.choice([None, None, 3.0, 6.0]), batches=rng.choice([1, 1, 2, 3]),
        tier=rng.choice([0, 0, 4, 64]))


def one_op(d: SchedulerDriver, rng: random.Random) -> str:
    """Draw and apply one operation; returns its name."""
    s, x = d.s, rng.random()
    if x < 0.15:
        # few distinct tokens, so prompts share prefixes and the prefix cache works
        prompt = [rng.randint(3, 5) for _ in range(rng.randint(1, d.max_prompt))]
        d.add(prompt, n=rng.randint(1, 3), max_tokens=rng.randint(1, 12),
              ignore_eos=rng.random() < 0.5, priority=rng.randint(-2, 2),
              background=rng.random() < 0.3)
        return "add"
    if x < 0.20 and s.requests:
        d.abort(rng.choice(sorted(s.requests)))
        return "abort"
    if x < 0.28 and d.transfers():
        d.deliver(rng.choice(d.transfers()))
        return "kv_handoff"
    d.step(emit_eos=rng.random() < 0.1)
    return "step"


def run(seed: int, ops: int, drain_every: int) -> dict:
    """`ops` operations from `seed`, a new random scheduler after each drain."""
    rng = random.Random(seed)
    counts: Counter = Counter()
    retractions = steps = tokens = schedulers = 0
    done = 0
    while done < ops:
        d = random_driver(rng)
        schedulers += 1
        for _ in range(min(drain_every, ops - done)):
            op = one_op(d, rng)
            counts[op] += 1
            d.check_outputs()
            done += 1
        d.drain()
        counts["drain"] += 1
        retractions += d.s.stats().num_preemptions
        if d.s.kv.tiers is not None:
            counts["tier_loaded_blocks"] += d.s.kv.tiers.hit_blocks
            counts["tier_failed_loads"] += d.s.kv.tiers.failed_blocks
        steps, tokens = steps + d.steps_taken, tokens + d.tokens
    return {"ops": done, "counts": counts, "retractions": retractions, "steps": steps,
            "tokens": tokens, "schedulers": schedulers}


def _worker(args: tuple[int, int, int]) -> dict:
    seed, ops, drain_every = args
    try:
        return run(seed, ops, drain_every)
    except AssertionError:
        return {"error": f"seed {seed}: {traceback.format_exc()}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--drain-every", type=int, default=1000,
                   help="operations on one scheduler before it drains and a new one is drawn")
    args = p.parse_args()
    share = -(-args.ops // args.workers)
    jobs = [(args.seed + i, min(share, args.ops - i * share), args.drain_every)
            for i in range(args.workers) if args.ops - i * share > 0]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(_worker, jobs))
    elapsed = time.perf_counter() - t0
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        print("\n".join(errors))
        raise SystemExit(1)
    counts = sum((r["counts"] for r in results), Counter())
    total = {k: sum(r[k] for r in results) for k in
             ("ops", "retractions", "steps", "tokens", "schedulers")}
    print(f"{total['ops']:,} operations on {total['schedulers']:,} random schedulers "
          f"in {elapsed:.0f} s ({total['ops'] / elapsed:,.0f} ops/s, {len(jobs)} workers)")
    print("  " + ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())))
    print(f"  {total['steps']:,} plans, {total['tokens']:,} tokens computed, "
          f"{total['retractions']:,} retractions")
    print("  invariant violations: 0; blocks left after every drain: 0")


if __name__ == "__main__":
    main()
