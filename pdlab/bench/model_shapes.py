"""Random checkpoints of real small-model shapes, written by transformers (nothing downloaded).

A benchmark on the 4M-parameter tiny model measures mostly per-step Python; these shapes make
the arithmetic count. Each is a Llama-layout folder saved by transformers' `save_pretrained`
from a random `LlamaConfig` with the named model's dimensions, plus the tiny model's tokenizer
files (benchmarks feed token ids, so only the embedding table's size matters).

    smollm-135m   SmolLM-135M: 30 layers, hidden 576, 9 heads / 3 KV heads of 64, vocab 49152,
                  tied embeddings (~135M parameters; 30 KiB of float32 KV per token)
    llama-3.2-1b  Llama-3.2-1B: 16 layers, hidden 2048, 32 heads / 8 KV heads of 64, vocab
                  128256, tied embeddings (~1.24B parameters, 2.47 GB in bfloat16; 32 KiB of
                  bfloat16 KV per token). The GPU check's roofline shape; without the published
                  rope scaling (random weights: only the bytes a step reads matter there).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from pdserve.errors import ConfigError
from pdserve.model.tiny import TINY_CONFIG, default_model_path

# LlamaConfig keyword arguments of each shape (the published configs' dimensions).
SHAPES: dict[str, dict[str, Any]] = {
    "smollm-135m": {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "llama-3.2-1b": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
}


def save_random_llama(
    folder: Path,
    config_kwargs: dict[str, Any],
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
) -> Path:
    """Save a seeded random LlamaForCausalLM of this config in `dtype`, with the tiny
    tokenizer's files, into `folder` (created); returns it. `device`: where the weights are
    initialised (a GPU draws a 1B model's in well under a second)."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise ConfigError(
            f"random checkpoints need transformers (pip install 'pdserve[test]'): {exc}"
        ) from None
    config = LlamaConfig(
        bos_token_id=TINY_CONFIG["bos_token_id"],
        eos_token_id=TINY_CONFIG["eos_token_id"],
        **config_kwargs,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer_dir = default_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def build_shape_checkpoint(
    name: str,
    folder: Path,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    **overrides: Any,
) -> Path:
    """Write the named shape's random checkpoint into `folder` (`overrides`: config fields to
    change, e.g. fewer layers for a smoke run); ConfigError for an unknown name."""
    if name not in SHAPES:
        raise ConfigError(f"--model-shape: {name!r} is not one of {', '.join(sorted(SHAPES))}")
    return save_random_llama(folder, {**SHAPES[name], **overrides}, seed, dtype, device)
