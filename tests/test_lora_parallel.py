"""Multi-LoRA across processes and restarts: adapters on two tensor-parallel ranks and on two
pipeline stages, a prefill/decode pair serving them, and a restart on the KV disk tier, each
giving every adapter's merged-model tokens."""

from __future__ import annotations

import pytest

from tidal import LLM, SamplingParams
from tidal.model.lora import LoRAError

from lora_fixtures import MAX_TOKENS, PROMPTS, lora_setup, run


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return lora_setup(tmp_path_factory.mktemp("lora"))


@pytest.mark.parametrize("cpu_decoder", [True, False])
def test_adapters_on_two_tensor_parallel_ranks_equal_their_merged_models(setup, cpu_decoder):
    """Each rank holds its share of every adapter, cut as its base layers are (B's rows of
    q/k/v and gate/up; A's columns of o and down, whose deltas join the partial sums): the
    merged models' tokens and logprobs with adapters mixed in one batch, one of them loaded
    on first use; an adapter that does not fit is refused by rank 0, as in one process,
    and the ranks serve on."""
    from tidal import LoRARequest

    base, folders, refs = setup
    llm = LLM(str(base), dtype="float32", num_kv_blocks=96, block_size=4, max_loras=3,
              tensor_parallel_size=2, num_threads=1, cpu_decoder=cpu_decoder,
              lora_modules=[f"{n}={folders[n]}" for n in ("qv4", "all8")])
    try:
        assert llm.engine.executor.info.decoder == cpu_decoder
        jobs = [(name, i) for i in range(3) for name in [None, "qv4", "all8"]]
        assert run(llm, jobs) == [refs[name][i] for name, i in jobs]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params,
                            use_tqdm=False,
                            lora_request=LoRARequest("mlp16", 3, str(folders["mlp16"])))
        assert [o.outputs[0].token_ids for o in outs] == refs["mlp16"][:2]
        with pytest.raises(LoRAError, match="already loaded"):
            llm.engine.executor.register_adapter("qv4", str(folders["qv4"]))
        assert run(llm, [("all8", 4)]) == [refs["all8"][4]]
    finally:
        llm.close()


def test_adapters_on_two_pipeline_stages_equal_their_merged_models(setup):
    """Each stage holds every adapter's pieces of its own layer (one of two here): the
    merged models' tokens and logprobs with adapters mixed in one batch, through each
    stage's C++ decoder, a step in flight per stage."""
    base, folders, refs = setup
    llm = LLM(str(base), dtype="float32", num_kv_blocks=96, block_size=4, max_loras=3,
              pipeline_parallel_size=2, num_threads=1,
              lora_modules=[f"{n}={p}" for n, p in folders.items()])
    try:
        assert llm.engine.executor.info.decoder
        jobs = [(name, i) for i in range(3) for name in [None, *folders]]
        assert run(llm, jobs) == [refs[name][i] for name, i in jobs]
    finally:
        llm.close()


def test_a_prefill_decode_pair_serves_adapters(setup):
    """1P1D: both instances hold the adapters; the prefill side computes the prompt under
    the adapter, the decode side continues under it."""
    from tokenizers import Tokenizer

    from server_fixtures import Server, openai_client

    base, folders, refs = setup
    text = Tokenizer.from_file(str(base / "tokenizer.json")).decode
    pd = Server("--pd", "1P1D", "--model", str(base), "--dtype", "float32", "--max-loras", "2",
                "--lora-modules", f"qv4={folders['qv4']}", f"all8={folders['all8']}")
    try:
        client = openai_client(pd)
        for name, i in (("qv4", 0), ("all8", 1), ("base", 2), ("all8", 3)):
            out = client.completions.create(model=name, prompt=PROMPTS[i], temperature=0,
                                            max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
            assert out.choices[0].text == text(refs[None if name == "base" else name][i])
    finally:
        log = pd.stop()
    assert "Traceback" not in log, log


def test_adapters_load_their_own_prefixes_from_the_disk_tier(setup, tmp_path):
    """A restart on a disk tier (docs/design/kv-tiers.md): every prompt loads its blocks
    from disk, each adapter's own (keys are salted by the adapter), and each answer still
    equals its merged model's."""
    base, folders, refs = setup
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in [None, *folders]]
    kwargs = dict(dtype="float32", num_kv_blocks=96, block_size=4, max_loras=3,
                  lora_modules=[f"{n}={p}" for n, p in folders.items()],
                  kv_cache_dir=str(tmp_path / "kv"))
    first = LLM(str(base), **kwargs)
    assert run(first, jobs) == [refs[name][i] for name, i in jobs]
    first.close()
    again = LLM(str(base), **kwargs)
    assert run(again, jobs) == [refs[name][i] for name, i in jobs]
    tiers = again.engine.scheduler.kv.tiers
    assert tiers.hit_blocks == sum((len(PROMPTS[i]) - 1) // 4 for _, i in jobs)
    again.close()
