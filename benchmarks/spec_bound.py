"""How close adaptive speculation comes to the best that any choice of guesses could do, one
request at a time on the embedded model (offline, `LLM.chat`, greedy).

The bound is measured, not modelled: the same proposer runs with its guesses cut at the
first one the model will not accept (the model's tokens are known from the run without
speculation), and every guess left is verified. No planner can beat that: it pays for no
rejected row and misses no accepted one, at this machine's real step times and first
tokens. Each round runs: no speculation, then per method the adaptive planner and the bound;
the table gives medians of per-round ratios to no speculation.

Workloads are `benchmarks/spec_decode.py`'s (`copy`: "repeat this function" over Python
standard-library functions; `chat`: ShareGPT first turns), each request's output capped at
its reference reply's tokens as `tidal bench serve` caps it.

usage: .venv/bin/python benchmarks/spec_bound.py [--workload copy] [--prompts 8] [--rounds 2]
       [--methods ngram,suffix,ngram:3,suffix:3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_decode import GUESSES, copy_dataset  # noqa: E402  (the same workload and cap)


class AcceptedOnly:
    """A proposer whose guesses are cut to the path the model will accept (a tree's
    longest, a chain's run up to the first miss): `reference` maps a prompt's tokens to the
    model's output for it."""

    def __init__(self, inner, reference: dict[tuple[int, ...], list[int]]) -> None:
        self.inner, self.reference = inner, reference
        self.cut = 0  # guesses cut off, over the run

    def propose(self, seq_id: str, prompt: list[int], output: list[int], k: int):
        from tidal.spec import GuessTree

        tree = self.inner.propose(seq_id, prompt, output, k)
        ref, n = self.reference[tuple(prompt)], len(output)
        path, node = [], -1
        while n + len(path) < len(ref):
            want = ref[n + len(path)]
            node = next((i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens))
                         if p == node and t == want), None)
            if node is None:
                break
            path.append(want)
        self.cut += len(tree) - len(path)
        return GuessTree.chain(path)

    def forget(self, seq_id: str, output: list[int], finished: bool) -> None:
        self.inner.forget(seq_id, output, finished)


def requests(workload: str, prompts: int, tokenizer) -> list[tuple[str, int]]:
    """(prompt text, output cap) pairs, as `tidal bench serve` draws them."""
    from tidal.bench.dataset import DatasetSpec, load_dataset

    path = None
    if workload == "copy":
        path = Path(tempfile.mkdtemp(prefix="tidal-bound-")) / "copy.json"
        copy_dataset(path, prompts)
    spec = DatasetSpec(name="sharegpt", path=str(path) if path else None, num_prompts=prompts,
                       output_len=0)  # 0: the reply's length
    return [(r.text, r.output_len) for r in load_dataset(spec, tokenizer)]


def run(llm, work: list[tuple[str, int]]) -> tuple[float, list[list[int]], list[list[int]]]:
    """Output tokens/s over the requests sent one at a time; prompts' and outputs' tokens."""
    from tidal import SamplingParams

    prompts, outputs, seconds = [], [], 0.0
    for text, cap in work:
        params = SamplingParams(max_tokens=cap, temperature=0.0)
        start = time.perf_counter()
        out = llm.chat([{"role": "user", "content": text}], params, use_tqdm=False)[0]
        seconds += time.perf_counter() - start
        prompts.append(list(out.prompt_token_ids))
        outputs.append(list(out.outputs[0].token_ids))
    return sum(map(len, outputs)) / seconds, prompts, outputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("copy", "chat"), default="copy")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--methods", default="ngram,suffix",
                   help="proposers; NAME:B grows trees of B branches (ngram:3)")
    args = p.parse_args()
    from tidal import LLM

    methods = args.methods.split(",")
    rates: dict[str, list[float]] = {}
    differ: dict[str, int] = {}  # outputs unlike no speculation's, by engine
    cut = 0
    work: list[tuple[str, int]] = []
    # warm-up: the kernels' first calls, on a prompt of none of the workloads (a suffix
    # proposer keeps finished outputs, and would then know the first request's)
    warm = [("Name three colours.", 16)]
    for _ in range(args.rounds):
        llm = LLM("smollm2-135m")
        work = work or requests(args.workload, args.prompts, llm.tokenizer)
        run(llm, warm)
        base, prompts, outputs = run(llm, work)
        rates.setdefault("none", []).append(base)
        reference = {tuple(p): o for p, o in zip(prompts, outputs)}
        del llm
        for method in methods:
            name, _, branches = method.partition(":")
            for bound in (False, True):
                llm = LLM("smollm2-135m", speculative_method=name,
                          speculative_branches=int(branches or 1),
                          num_speculative_tokens=GUESSES, speculative_adaptive=not bound)
                run(llm, warm)
                spec = llm.engine.runner.guesser
                if bound:
                    spec.proposer = AcceptedOnly(spec.proposer, reference)
                rate, _, got = run(llm, work)
                key = f"{method} {'bound' if bound else 'adaptive'}"
                differ[key] = differ.get(key, 0) + sum(a != b for a, b in zip(got, outputs))
                cut += spec.proposer.cut if bound else 0
                rates.setdefault(key, []).append(rate)
                del llm
    print(f"\n{args.workload}, {args.prompts} requests one at a time, {args.rounds} rounds "
          f"(guesses the bound cut: {cut})\n")
    print("| engine | output tok/s | vs none | of the bound | outputs unlike none's |\n"
          "|---|---|---|---|---|")
    for name, rate in rates.items():
        method = name.split()[0]  # with its branches: a tree's bound is its own
        bound = rates.get(f"{method} bound")
        vs_bound = (f"{median(a / b for a, b in zip(rate, bound)):.0%}"
                    if bound and name.endswith("adaptive") else "-")
        vs_none = median(a / b for a, b in zip(rate, rates["none"]))
        print(f"| {name} | {median(rate):.1f} | {vs_none:.2f}x | {vs_bound} | "
              f"{differ.get(name, 0)} |")


if __name__ == "__main__":
    main()
