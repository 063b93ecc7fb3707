"""Checkpoints the tests make: random Llama-layout models saved by transformers.

`save_hf_checkpoint` writes any transformers config as a Hugging Face folder (safetensors and
the tiny model's tokenizer), with unit-scale random weights so greedy tokens have clear
winners. `kv_heavy_config` is the shape the scale tests use: head_dim 128 and 32 KV heads in a
few small layers, so the KV is real-model-sized (2 MiB per 16-token block in float32, as a
Llama-2-7B has) while the weights stay small.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Re-init an HF model with unit-scale weights so logits have clear winners.

    transformers' own init (std 0.02) gives near-uniform logits, where greedy ties would make
    token comparisons meaningless. Norm weights and biases are random too, so a forward that
    forgot one of them would fail.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def save_hf_checkpoint(
    folder: Path, hf_config: Any, tokenizer_dir: Path, seed: int = 0
) -> torch.nn.Module:
    """Build a random transformers model for hf_config, save it (safetensors) with a tokenizer.

    Returns the transformers model in eval mode, the numerical reference.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    randomize_(model, seed)
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return model


def kv_heavy_config(num_layers: int = 4, max_positions: int = 8192) -> Any:
    """head_dim 128, 32 KV heads, small hidden size: 128 KiB of float32 KV per token per layer."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
