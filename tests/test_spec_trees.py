"""Speculation trees: the tree's layout, masks and walk; the proposers' trees; the tree mask in
the paged attention kernels (C++, the PyTorch fallback) against attention over each row's
visible context; and end to end, tokens, logprobs and seeded samples equal those without
speculation when accepted paths leave the main branch (their KV moved into place)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from model_fixtures import PROMPTS, small_folder
from tidal import LLM, SamplingParams
from tidal.model.attention import AttentionMetadata, TorchAttention
from tidal.model.sampler import SampleRow, sample
from tidal.spec import GuessTree, NgramProposer, SuffixProposer
from tidal.spec.ngram import merge


def test_take_lays_the_best_nodes_out_depth_first_with_the_main_path_first():
    # best first: a root child, its child, a second root child, then deeper nodes
    tree = GuessTree([10, 11, 20, 12, 21, 13], [-1, 0, -1, 1, 2, 3])
    laid = tree.take(5)  # node 5 (13) is cut; its parent 12 stays
    assert laid.tokens == [10, 11, 12, 20, 21] and laid.parents == [-1, 0, 1, -1, 3]
    assert laid.main_path() == [10, 11, 12]
    assert laid.depths() == [1, 2, 3, 1, 2]
    # each row sees the root (bit 0), its ancestors and itself (bit 1 + node)
    assert laid.visible() == [0b11, 0b111, 0b1111, 0b10001, 0b110001]
    assert laid.path_tokens(4) == [20, 21] and laid.path_tokens(-1) == []


def test_the_walk_follows_the_sampled_child_and_ends_at_the_first_miss():
    tree = GuessTree([10, 11, 12, 20, 21], [-1, 0, 1, -1, 3])
    # rows: root, then nodes 0..4; the root's sample 20 moves to node 3, whose row samples 21
    samples = [20, 99, 99, 99, 21, 7]
    assert tree.accept(samples) == ([20, 21, 7], [3, 4])  # 7: node 4's row, a leaf: bonus
    assert tree.accept([10, 11, 55, 0, 0, 0]) == ([10, 11, 55], [0, 1])
    assert tree.accept([5, 0, 0, 0, 0, 0]) == ([5], [])
    assert GuessTree.chain([5, 6, 7]).accept([5, 6, 7, 8]) == ([5, 6, 7, 8], [0, 1, 2])


def test_ngram_merges_the_latest_occurrences_into_a_tree():
    ngram = NgramProposer(2, 2, branches=3)
    # "1 2" occurred three times, followed by 3 4, 5 6 and (latest) 3 7
    prompt = [1, 2, 3, 4, 0, 1, 2, 5, 6, 0, 1, 2, 3, 7, 0, 1, 2]
    tree = ngram.propose("a", prompt, [], 8)
    # 3 leads (two runs, the latest among them) and the latest run's 7 0 1 follow; the
    # older run's 5 ranks between that run's fourth and fifth tokens: the older the run and
    # the deeper the node, the lower it ranks
    assert tree.tokens[:7] == [3, 7, 0, 1, 5, 2, 6]
    assert tree.parents[:7] == [-1, 0, 1, 2, -1, 3, 4]
    laid = tree.take(5)
    assert laid.tokens == [3, 7, 0, 1, 5] and laid.parents == [-1, 0, 1, 2, -1]
    one = NgramProposer(2, 2).propose("b", prompt, [], 3)
    assert one == GuessTree.chain([3, 7, 0])  # one branch: the latest occurrence alone
    # a run shared by every occurrence outranks any branch
    assert merge([[1, 2, 3], [1, 2, 4]], 4).tokens == [1, 2, 3, 4]


def test_suffix_trees_branch_on_the_next_most_frequent_tokens():
    prompt = [8, 1, 5, 8, 1, 5, 8, 2, 6, 8, 1, 5, 8, 2, 6, 8]
    # contexts of one token: after "8", 1 three times and 2 twice; then 5 and 6 always;
    # a match of one token guesses at most two deep (spec_factor 2)
    tree = SuffixProposer(max_depth=1, min_prob=0.1, branches=2).propose("c", prompt, [], 6)
    assert tree.tokens == [1, 5, 2, 6] and tree.parents == [-1, 0, -1, 2]
    chain = SuffixProposer(max_depth=1, min_prob=0.1).propose("c", prompt, [], 6)
    assert chain == GuessTree.chain([1, 5])
    # min_prob prunes the unlikely branch
    tree = SuffixProposer(max_depth=1, min_prob=0.5, branches=2).propose("c", prompt, [], 6)
    assert tree == GuessTree.chain([1, 5])


def tree_attention(q, k_cache, v_cache, tables, lens, tree, scale):
    """Each row's context gathered out of its blocks, the positions its tree mask hides
    dropped, then plain float32 attention."""
    out = []
    for b, n in enumerate(lens.tolist()):
        start, bits = tree[b].tolist()
        keep = [t for t in range(n) if t < start or (bits >> (t - start)) & 1]
        k = k_cache[tables[b]].flatten(0, 1)[keep].float().transpose(0, 1)
        v = v_cache[tables[b]].flatten(0, 1)[keep].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v, scale=scale,
                                           enable_gqa=True)
        out.append(o.squeeze(1))
    return torch.stack(out)


def random_tree_rows(data, batch, block_size, hkv, head_dim, dtype, gen,
                     starts=st.integers(0, 40)):
    lens, tree = [], []
    for _ in range(batch):
        start = data.draw(starts)
        nodes = data.draw(st.integers(0, 63))
        bits = data.draw(st.integers(1, 2**(nodes + 1) - 1)) | 1  # the root always seen
        lens.append(start + nodes + 1)
        tree.append((start, bits - (1 << 64) if bits >= 1 << 63 else bits))
    width = max(-(-n // block_size) for n in lens)
    blocks = width + 3
    k_cache = torch.randn(blocks, block_size, hkv, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, block_size, hkv, head_dim, generator=gen).to(dtype)
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:width] for _ in lens])
    return (k_cache, v_cache, tables, torch.tensor(lens), torch.tensor(tree, dtype=torch.long))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), batch=st.integers(1, 4), heads=st.sampled_from([(4, 2), (8, 1), (3, 3)]),
       head_dim=st.sampled_from([16, 64]), block_size=st.sampled_from([1, 4, 16]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_tree_masks_in_the_cpp_kernel_and_the_pytorch_fallback(data, batch, heads, head_dim,
                                                               block_size, dtype):
    from tidal.model.cpu_decode import extension

    h, hkv = heads
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    k_cache, v_cache, tables, lens, tree = random_tree_rows(data, batch, block_size, hkv,
                                                            head_dim, dtype, gen)
    q = torch.randn(batch, h, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    want = tree_attention(q, k_cache, v_cache, tables, lens, tree, scale)
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    ext = extension()
    if ext is not None:
        got = ext.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, 0, tree)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    if batch > 1:  # one row attends over its exact context: trees always have two or more
        backend = TorchAttention(h, hkv, head_dim, scale=scale)
        bias = backend.decode_bias(lens.tolist(), tables.shape[1] * block_size, "cpu",
                                   tree.tolist())
        meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), [], 0, tables, bias,
                                 int(lens.max()), lens, tree)
        got = backend._decode(q, k_cache, v_cache, meta)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_siblings_keep_the_target_distribution():
    """Root row samples from p0; guesses 1 and 3 are siblings (nodes 0, 1), whose rows
    sample from p1 and p2. The first emitted token follows p0; after 1 the second follows
    p1, after 3 it follows p2: chi-square tests."""
    p0 = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.3])
    p2 = torch.tensor([0.1, 0.1, 0.5, 0.2, 0.1])
    tree, trials = GuessTree([1, 3], [-1, -1]), 6000
    logits = torch.stack([p0.log(), p1.log(), p2.log()] * trials)
    rows = [SampleRow(SamplingParams(temperature=1.0), 1, [0], [], None)
            for _ in range(3 * trials)]
    tokens, _ = sample(logits, rows, torch.Generator().manual_seed(2))
    counts = torch.zeros(3, 5)
    for t in range(trials):
        emitted, _ = tree.accept([tokens[3 * t + r][0] for r in range(3)])
        counts[0, emitted[0]] += 1
        if emitted[0] in (1, 3):
            counts[1 if emitted[0] == 1 else 2, emitted[1]] += 1
        else:
            assert len(emitted) == 1
    for row, p in zip(counts, (p0, p1, p2)):
        expected = p * row.sum()
        assert float(((row - expected) ** 2 / expected).sum()) < 18.47  # 4 dof, p = 0.001


class OffMainTree:
    """Knows the greedy continuations: its main path starts with a wrong token and its
    second branch is the right continuation (with a wrong sibling deeper down), so every
    accepted guess lies off the main path and its KV moves."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]]) -> None:
        self.refs = refs

    def propose(self, seq_id, prompt, output, k):
        ref = self.refs[tuple(prompt)][len(output):]
        if len(ref) < 3:
            return GuessTree()
        tree = GuessTree()
        wrong = tree.add(-1, (ref[0] + 1) % 256)
        tree.add(wrong, ref[1])
        right = tree.add(-1, ref[0])
        tree.add(right, (ref[1] + 7) % 256)
        node = right
        for token in ref[1:k - 2]:
            node = tree.add(node, token)
        return tree

    def forget(self, seq_id, output, finished):
        pass


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    folder = small_folder(tmp_path_factory.mktemp("trees"), "m", "llama", seed=3)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 9, 17, 30)]
    return folder, prompts


def run(llm, prompts, **params):
    p = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0, **params)
    outs = llm.generate([{"prompt_token_ids": x} for x in prompts], p, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs])


@pytest.mark.parametrize("cpu_decoder", [True, False])
def test_paths_off_the_main_branch_give_the_same_tokens_and_logprobs(small, cpu_decoder):
    folder, prompts = small
    kw = dict(dtype="float32", num_kv_blocks=64, block_size=4, cpu_decoder=cpu_decoder)
    ref, ref_lp = run(LLM(str(folder), **kw), prompts, temperature=0)
    llm = LLM(str(folder), speculative_method="ngram", speculative_branches=2,
              num_speculative_tokens=8, speculative_adaptive=False, **kw)
    llm.engine.runner.guesser.proposer = OffMainTree(
        {tuple(p): r for p, r in zip(prompts, ref)})
    got, got_lp = run(llm, prompts, temperature=0)
    assert got == ref
    for a, b in zip(got_lp, ref_lp):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    spec = llm.engine.core.scheduler.spec
    assert spec.accepted_tokens > 40  # most tokens came from the second branch
    assert llm.engine.core.scheduler.kv.num_free == llm.engine.core.scheduler.kv.num_blocks


def test_seeded_samples_are_the_same_with_trees(small):
    """A seeded request's token at each output position comes from the same generator
    state whichever row of a tree samples it."""
    folder, prompts = small
    kw = dict(dtype="float32", num_kv_blocks=64, block_size=4)
    params = dict(temperature=0.8, seed=11)
    ref, _ = run(LLM(str(folder), **kw), prompts, **params)
    llm = LLM(str(folder), speculative_method="ngram", speculative_branches=2,
              num_speculative_tokens=8, speculative_adaptive=False, **kw)
    llm.engine.runner.guesser.proposer = OffMainTree(
        {tuple(p): r for p, r in zip(prompts, ref)})
    assert run(llm, prompts, **params)[0] == ref
    assert llm.engine.core.scheduler.spec.accepted_tokens > 40


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_proposers_trees_give_the_tokens_of_no_speculation(method):
    """The embedded model on copy-heavy prompts, one at a time and batched."""
    from test_spec_decode import COPY, engine, greedy

    prompts = COPY + PROMPTS[:2]
    ref = greedy(engine(), prompts)
    llm = engine(speculative_method=method, num_speculative_tokens=10,
                 speculative_branches=3)
    assert [greedy(llm, [p])[0] for p in prompts] == ref
    assert greedy(llm, prompts) == ref
    assert llm.engine.core.scheduler.spec.accepted_tokens > 100


def test_branches_are_refused_for_a_draft_model():
    with pytest.raises(ValueError, match="speculative_branches must be >= 1"):
        LLM("smollm2-135m", speculative_method="ngram", speculative_branches=0)
    with pytest.raises(ValueError, match="a draft model guesses one path"):
        LLM("smollm2-135m", speculative_method="draft", speculative_model="smollm2-135m",
            speculative_branches=2)


def tree_and_twin(k_cache, v_cache, tables, lens, tree, q):
    """The C++ kernel's output for one tree row, and for a plain row over the positions it
    sees packed into fresh blocks of the same size (its one-path twin)."""
    from tidal.model.cpu_decode import extension

    ext = extension()
    if ext is None:
        pytest.skip("no C++ compiler")
    start, bits = tree[0].tolist()
    keep = [t for t in range(int(lens[0])) if t < start or (bits >> (t - start)) & 1]
    size, hkv, head_dim = k_cache.shape[1:]
    width = -(-len(keep) // size)
    pad = torch.zeros(width * size - len(keep), hkv, head_dim, dtype=k_cache.dtype)
    packed_k, packed_v = (torch.cat([c[tables[0]].flatten(0, 1)[keep], pad])
                          .view(width, size, hkv, head_dim).contiguous()
                          for c in (k_cache, v_cache))
    got = ext.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 0, tree)
    twin = ext.paged_decode_attention(q, packed_k, packed_v, torch.arange(width)[None],
                                      torch.tensor([len(keep)]), 0.25)
    return got, twin


@settings(max_examples=20, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       head_dim=st.sampled_from([16, 64]))
def test_a_tree_row_equals_its_one_path_twin_bit_for_bit(data, dtype, head_dim):
    """The C++ kernel's tree row against its one-path twin: the same bits, so a token never
    depends on whether its guesses came as a tree."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    rows = random_tree_rows(data, 1, 4, 2, head_dim, dtype, gen,
                            st.integers(0, 40) | st.integers(400, 1100))
    q = torch.randn(1, 4, head_dim, generator=gen).to(dtype)
    got, twin = tree_and_twin(*rows, q)
    assert torch.equal(got, twin)


@pytest.mark.parametrize("start", [490, 500, 1000, 1010])
def test_a_tree_across_a_span_end_splits_as_its_twin(start):
    """Past 512 positions the C++ kernel attends in spans ending at multiples of 512: a tree
    whose guesses straddle one (every other one hidden) splits where its twin does, not
    inside the guesses, so their bits still agree."""
    gen = torch.Generator().manual_seed(start)
    nodes = 60
    lens = torch.tensor([start + nodes + 1])
    width = -(-int(lens[0]) // 4)
    k_cache, v_cache = (torch.randn(width, 4, 2, 64, generator=gen) for _ in range(2))
    bits = int("01" * 30 + "1", 2)  # the root and every other guess seen
    tree = torch.tensor([[start, bits]])
    q = torch.randn(1, 4, 64, generator=gen)
    got, twin = tree_and_twin(k_cache, v_cache, torch.arange(width)[None], lens, tree, q)
    assert torch.equal(got, twin)
