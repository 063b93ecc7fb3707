"""A KV-heavy test checkpoint: little compute per token, a lot of KV per token.

`build_kv_heavy_checkpoint(folder)` writes a Llama-layout Hugging Face folder with
transformers' own `save_pretrained` of a random `LlamaConfig`: few small layers, but many KV
heads of an explicit `head_dim` 128 (32 x 128 per layer, 128 KiB of float32 KV per token, 2 MiB
per 16-token block), so a few hundred prompt tokens carry tens of MiB of KV and the handoff's
transfer time is not lost in the noise. The tokenizer is the tiny default model's (its files are
copied), so the vocabulary matches. Nothing is downloaded; transformers (the `test` extra) is
imported only here.

The weights are random: the text is noise, but greedy output is deterministic, which is all a
latency benchmark needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdlab.bench.model_shapes import save_random_llama
from pdserve.model.tiny import TINY_CONFIG


@dataclass(frozen=True, slots=True)
class KVHeavyShape:
    """The checkpoint's shape; KV bytes per token = layers * 2 * kv_heads * head_dim * 4."""

    num_layers: int = 4
    num_kv_heads: int = 32
    head_dim: int = 128
    # Small: prefill compute grows with it, the KV does not (it is kv_heads x head_dim wide).
    hidden_size: int = 64
    intermediate_size: int = 128
    max_position_embeddings: int = 4096

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 K and V of every layer."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4


def build_kv_heavy_checkpoint(
    folder: Path, shape: KVHeavyShape | None = None, seed: int = 0
) -> Path:
    """Write the checkpoint into `folder` (created) and return it."""
    shape = shape or KVHeavyShape()
    config = {
        "vocab_size": TINY_CONFIG["vocab_size"],
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_kv_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    return save_random_llama(folder, config, seed)
