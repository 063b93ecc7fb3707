"""Our forward against transformers' own models (eager attention, float32) on tiny checkpoints.

Relative error is max|ours - theirs| / max|theirs| over every logit; 1e-4 leaves room for the
different (but equally valid) float32 summation orders of fused matmuls and SDPA, and is ~100x
below what a real bug (wrong RoPE frequency, missing bias, off-by-one mask) produces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from model_helpers import paged_greedy, prefill_logits, relative_error, save_hf_checkpoint

from pdserve.model.loader import LoadedModel, load_model

transformers = pytest.importorskip("transformers")

COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Wavelengths 16..64 fall in the smoothed band for head_dim 16: all three branches run.
    "original_max_position_embeddings": 64,
}


def _variants() -> dict[str, Any]:
    t = transformers
    return {
        "llama-gqa-llama3": t.LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE),
        "llama-linear-bias": t.LlamaConfig(
            **COMMON,
            attention_bias=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
        ),
        # head_dim 32 != hidden / heads: the explicit config field must win.
        "mistral-head-dim": t.MistralConfig(**COMMON, head_dim=32),
        # q/k/v bias, o without; one KV head (MQA).
        "qwen2-bias": t.Qwen2Config(**{**COMMON, "num_key_value_heads": 1}),
        "llama-tied": t.LlamaConfig(**COMMON, tie_word_embeddings=True),
    }


VARIANTS = ["llama-gqa-llama3", "llama-linear-bias", "mistral-head-dim", "qwen2-bias", "llama-tied"]
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [300], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]


@pytest.fixture(scope="module", params=VARIANTS)
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> tuple[LoadedModel, Any]:
    folder = tmp_path_factory.mktemp(request.param)
    reference = save_hf_checkpoint(folder, _variants()[request.param], tokenizer_dir)
    return load_model(folder), reference


def _hf_logits(reference: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([prompt])).logits[0].float()  # [len, vocab]


def test_config_matches_transformers(pair: tuple[LoadedModel, Any]) -> None:
    model, reference = pair
    c, hf = model.config, reference.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads) == (
        hf.num_hidden_layers,
        hf.num_attention_heads,
        hf.num_key_value_heads,
    )
    assert c.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert c.tie_word_embeddings == hf.tie_word_embeddings


def test_single_prompt_logits(pair: tuple[LoadedModel, Any]) -> None:
    model, reference = pair
    prompt = PROMPTS[0]
    ours = prefill_logits(model.module, [prompt], block_size=4)
    assert relative_error(ours, _hf_logits(reference, prompt)) < 1e-4


def test_mixed_length_batch_logits(pair: tuple[LoadedModel, Any]) -> None:
    model, reference = pair
    # The one-token prompt goes down the batched decode path of paged_attention.
    ours = prefill_logits(model.module, PROMPTS, block_size=4)
    theirs = torch.cat([_hf_logits(reference, p) for p in PROMPTS])
    assert ours.shape == theirs.shape
    assert relative_error(ours, theirs) < 1e-4


def test_greedy_decode_matches_generate(pair: tuple[LoadedModel, Any]) -> None:
    model, reference = pair
    max_new = 8
    ours = paged_greedy(model.module, PROMPTS, max_new, block_size=4)
    # No eos stop (and no eos suppression): compare every step's argmax as is.
    reference.generation_config.eos_token_id = None
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=max_new,
                pad_token_id=0,
            )
        assert tokens == out[0, len(prompt) :].tolist()


def test_bfloat16_smoke(tiny_model_path: Path) -> None:
    model = load_model(tiny_model_path, dtype="bfloat16")
    assert model.module.embed_tokens.weight.dtype == torch.bfloat16
    logits = prefill_logits(model.module, PROMPTS, block_size=16)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    tokens = paged_greedy(model.module, PROMPTS, 4, block_size=16)
    assert all(0 <= t < model.config.vocab_size for row in tokens for t in row)
