"""Multi-LoRA test fixtures: a tiny base model, three PEFT adapters of different ranks and
targets, their merged models' greedy tokens and logprobs, and `run`, which checks a batch
of (adapter, prompt) jobs against them."""

from __future__ import annotations

from pathlib import Path

import torch

from tidal import SamplingParams

from model_fixtures import hf_greedy, small_folder

MAX_TOKENS = 8
PROMPTS = [[5, 9, 33, 2 + i, 17, 101, 64, 12, 7, 200, 3 + i, 88, 41][:6 + i] for i in range(6)]
# (name, rank, alpha, targets, rsLoRA)
ADAPTERS = [
    ("qv4", 4, 8, ["q_proj", "v_proj"], False),
    ("all8", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"], True),
    ("mlp16", 16, 8, ["o_proj", "gate_proj", "up_proj", "down_proj"], False),
]


def make_adapter(base_folder, out, rank, alpha, targets, rslora, seed):
    """A PEFT adapter of random A and B (B is zero at PEFT's default init: no delta)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                     init_lora_weights=False)
    peft = get_peft_model(model, cfg)
    with torch.no_grad():  # deltas large enough that each adapter changes the tokens
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    peft.save_pretrained(str(out))
    return out


def merged_model(base, folder=None, bf16: bool = False):
    """The float32 base model, with the adapter in `folder` merged in (PEFT's
    merge_and_unload); `bf16`: its weights first rounded as bfloat16 slots hold them (A, and
    B with the scale folded in)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if folder is None:
        return model.eval()
    model = PeftModel.from_pretrained(model, str(folder))
    lora = [m for m in model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    with torch.no_grad():
        for module in lora if bf16 else []:
            scale = module.scaling["default"]
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            a.copy_(a.bfloat16().float())
            b.copy_((b * scale).bfloat16().float() / scale)
    return model.merge_and_unload().eval()


def token_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Each position's log-probabilities after `prompt` + `tokens` (teacher-forced): one row
    per token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return logits.log_softmax(-1)


def lora_setup(tmp: Path) -> tuple[Path, dict[str, Path], dict]:
    """The base model in `tmp`, three adapters, and each one's merged-model greedy tokens
    (their logprobs kept in LOGPROBS for `run`)."""
    base = small_folder(tmp, "base", "llama", tie_word_embeddings=False)
    folders, refs = {}, {}
    for i, (name, rank, alpha, targets, rs) in enumerate(ADAPTERS):
        folders[name] = make_adapter(base, tmp / name, rank, alpha, targets, rs, seed=i + 1)
    for name in [None] + list(folders):
        model = merged_model(base, folders.get(name))
        refs[name] = [hf_greedy(model, p, MAX_TOKENS, None) for p in PROMPTS]
        for p, tokens in zip(PROMPTS, refs[name]):  # each greedy token's log-probability
            lp = token_logprobs(model, p, tokens)
            LOGPROBS[(name, tuple(p))] = (tokens, lp[range(len(tokens)), tokens])
    assert len({str(r) for r in refs.values()}) == len(refs), "an adapter changes nothing"
    return base, folders, refs


LOGPROBS: dict = {}  # (adapter, prompt) -> the merged model's greedy tokens and their logprobs


def run(llm, jobs):
    """Greedy tokens of (adapter, prompt index) jobs in one batch; each token's logprob
    within 1e-4 of the merged model's."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, lora=name,
                             logprobs=0) for name, _ in jobs]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for _, i in jobs], params,
                        use_tqdm=False)
    for (name, i), o in zip(jobs, outs):
        tokens, want = LOGPROBS[(name, tuple(PROMPTS[i]))]
        if o.outputs[0].token_ids == tokens:  # (else the caller's comparison fails)
            got = torch.tensor([lp.logprob for lp in o.outputs[0].logprobs])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    return [o.outputs[0].token_ids for o in outs]
