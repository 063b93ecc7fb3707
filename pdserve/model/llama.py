"""The Llama-family decoder forward (Llama, Mistral, Qwen2) over pdserve's paged KV cache.

The module holds weights and constant RoPE tables only: every per-step input (token ids,
positions, the KV cache, the attention metadata) is an argument, so one module serves any number
of engines and requests and a forward has no side effect except writing this step's K/V into
the cache slots the metadata names.

One step is a flattened batch of T tokens from any mix of prefill chunks and decode tokens. Per
layer: RMSNorm -> fused q/k/v projection -> RoPE -> `write_kv` -> `paged_attention` -> o_proj
-> residual -> RMSNorm -> fused SiLU-gated MLP -> residual. Numerics follow transformers: RMSNorm
in float32, rotate-half RoPE with cos/sin computed in float32 and cast to the activation dtype,
inverse frequencies computed exactly as `modeling_rope_utils` does for default, linear and
llama3 scaling. q/k/v and gate/up are fused into one matmul each: on CPU at small batch sizes
the cost is dominated by per-op overhead, not FLOPs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.attention import AttentionMetadata, paged_attention, write_kv
from pdserve.model.batch_invariant import linear as invariant_linear
from pdserve.model.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, as transformers computes them."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between them
    # interpolated smoothly (Llama 3.1 context extension).
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_position_embeddings, head_dim] in float32 (rotate-half layout)."""
    inv_freq = rope_inv_freq(config)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float)
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by per-token cos/sin [T, 1, D] (non-interleaved halves)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, heads, D]
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    """x / rms(x) * weight, with the reduction in float32 like transformers."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] in x's dtype."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class DecoderLayer(nn.Module):
    """One pre-norm attention + MLP block."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = d
        self.q_size = config.num_heads * d
        self.kv_size = config.num_kv_heads * d
        self.scale = d**-0.5
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        # Rows: q (num_heads * d), then k and v (num_kv_heads * d each).
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=config.o_proj_bias)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        # Rows: gate (intermediate), then up (intermediate).
        self.gate_up_proj = nn.Linear(h, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this step's K/V for `self.layer`."""
        num_tokens = x.shape[0]
        lin = _linear if meta.invariant is None else invariant_linear
        qkv = lin(self.qkv_proj, self.input_layernorm(x))  # [T, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)  # [T, H, D]
        k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        write_kv(kv_cache, self.layer, k, v, meta)
        attn = paged_attention(q, kv_cache, self.layer, meta, self.scale)  # [T, H, D]
        x = x + lin(self.o_proj, attn.reshape(num_tokens, self.q_size))
        gate, up = lin(self.gate_up_proj, self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + lin(self.down_proj, F.silu(gate) * up)


def _linear(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = layer(x)
    return out


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head; stateless between calls."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # An explicit (uninitialized) weight skips nn.Embedding's normal_ init, which on the meta
        # device costs seconds of first-use imports for numbers that are overwritten anyway.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # None when tied: logits use the embedding matrix.
        self.lm_head: nn.Module | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # Constants, not weights: excluded from state_dict, always float32 on the CPU at
        # build time (explicit device so that a meta-device construction still computes them).
        with torch.device("cpu"):
            cos, sin = rope_cos_sin(config)
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def from_hf_weights(cls, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> LlamaModel:
        """Build the module around checked HF-named tensors (see `weights.expected_shapes`).

        Parameters are created on the meta device and then assigned, so no memory is spent
        on a random init that would be overwritten.
        """
        with torch.device("meta"):
            module = cls(config)
        module.load_state_dict(pack_hf_weights(config, tensors), strict=True, assign=True)
        return module.eval()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] (after the final norm) for a flattened batch of T tokens.

        input_ids, positions: [T] long. kv_cache: the engine's paged cache (see attention.py);
        this step's K/V are written at `meta`'s slots before attention reads them.
        """
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(1)  # [T, 1, D]
        for layer in self.layers:
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        """Logits [N, vocab] in float32 for hidden states [N, hidden] (fixed row tiles when
        `batch_invariant`, so a row's logits do not depend on N)."""
        head = self.lm_head if self.lm_head is not None else self._tied_head
        logits = invariant_linear(head, hidden) if batch_invariant else _linear(head, hidden)
        return logits.float()

    def _tied_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of tied embeddings: hidden @ embedding.T."""
        return F.linear(hidden, self.embed_tokens.weight)


def pack_hf_weights(
    config: ModelConfig, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """HF tensor names -> this module's state_dict (q/k/v and gate/up concatenated by rows)."""
    packed = {
        "embed_tokens.weight": tensors["model.embed_tokens.weight"],
        "norm.weight": tensors["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        packed["lm_head.weight"] = tensors["lm_head.weight"]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        packed[ours + "input_layernorm.weight"] = tensors[hf + "input_layernorm.weight"]
        packed[ours + "post_attention_layernorm.weight"] = tensors[
            hf + "post_attention_layernorm.weight"
        ]
        packed[ours + "qkv_proj.weight"] = torch.cat(
            [tensors[f"{attn}{p}_proj.weight"] for p in "qkv"]
        )  # [q + 2 kv, hidden]
        if config.attention_bias:
            packed[ours + "qkv_proj.bias"] = torch.cat(
                [tensors[f"{attn}{p}_proj.bias"] for p in "qkv"]
            )  # [q + 2 kv]
        packed[ours + "o_proj.weight"] = tensors[attn + "o_proj.weight"]
        if config.o_proj_bias:
            packed[ours + "o_proj.bias"] = tensors[attn + "o_proj.bias"]
        packed[ours + "gate_up_proj.weight"] = torch.cat(
            [tensors[hf + "mlp.gate_proj.weight"], tensors[hf + "mlp.up_proj.weight"]]
        )  # [2 * intermediate, hidden]
        packed[ours + "down_proj.weight"] = tensors[hf + "mlp.down_proj.weight"]
    return packed
