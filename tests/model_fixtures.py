"""Models for the engine tests: the embedded default, tiny random Llama-family folders built
in the test (HF classes, random weights, the embedded tokenizer), and `small_folder`: the
same with a 256-token vocabulary and a word-level tokenizer, for per-architecture tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tidal.model.registry import resolve_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "every morning walked down to the harbour before sunrise. One day he found",
    "1, 2, 3, 4,",
    "Translate to French: I like apples and",
    "The three primary colours are",
    "A long list of fruits: apple, banana, cherry, date, elderberry, fig, grape, honeydew, "
    "kiwi, lemon, mango, nectarine, orange, papaya, quince, raspberry, strawberry,",
    "Q: What is 12 times 12?\nA:",
]


def embedded_folder() -> Path:
    return resolve_model("smollm2-135m")[0]


def tiny_folder(tmp: Path, family: str) -> Path:
    """A randomly initialised 2-layer model of `family` ('llama', 'qwen2', 'qwen3', or
    'mistral' and 'phi3' with a 6-token sliding window, phi3 rotating half of each head)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=family == "llama")
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=10000.0, **common))
    elif family == "qwen2":  # q/k/v carry a bias
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=1000000.0, **common))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(rope_theta=10000.0, sliding_window=6, **common))
    elif family == "phi3":
        rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
        model = Phi3ForCausalLM(Phi3Config(rope_parameters=rope, sliding_window=6,
                                           pad_token_id=0, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(rope_theta=1000000.0, **common))
    folder = tmp / family
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(embedded_folder() / name, folder / name)
    return folder


SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)


def small_folder(tmp: Path, name: str, family: str, seed: int = 0, **config) -> Path:
    """A randomly initialised float32 model of `family` (a transformers model_type) with
    SMALL's shapes updated by `config`, saved with save_pretrained, and a word-level
    tokenizer over its 256 ids (tidal's engine needs one; the tests send token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **{**SMALL, **config})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    folder = tmp / name
    model.save_pretrained(str(folder))
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def prefix_hit_tokens(llm, params) -> list[list[list[int]]]:
    """Greedy tokens of two calls on `llm`: one prompt, then that prompt extended beside two
    others, so the second call's first prompt hits the prefix cache (asserted)."""
    shared = llm.engine.tokenize(PROMPTS[0] + PROMPTS[1])
    calls = [[shared], [shared + llm.engine.tokenize(PROMPTS[2])] +
             [llm.engine.tokenize(p) for p in PROMPTS[3:5]]]
    out = [[o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        for prompts in calls]
    assert llm.engine.scheduler.stats().prefix_hit_rate > 0  # the second call hit
    return out


def hf_greedy(model, prompt_ids: list[int], max_tokens: int, eos: int | None) -> list[int]:
    """Greedy tokens from an HF model, recomputing the whole sequence each step."""
    ids = list(prompt_ids)
    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token == eos:
                break
    return out


def first_near_tie(out, margin: float = 0.02) -> int:
    """The first position of a generation (with logprobs of its top two) where they lie
    within `margin`, else its last: up to there two paths that round apart must pick the
    same tokens; there either may win, and past it their contexts differ."""
    return next((i for i, e in enumerate(out.logprobs) if e.top[0][1] - e.top[1][1] < margin),
                len(out.logprobs) - 1)
