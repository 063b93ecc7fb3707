"""Reads a checkpoint's safetensors file(s) into Hugging Face-named tensors, checked and digested.

One `model.safetensors`, or `model.safetensors.index.json` plus the shards its `weight_map`
names. Every tensor the config implies must be present with exactly the implied shape; the
only tolerated extras are those that carry no information (`rotary_emb.inv_freq` buffers, and a
duplicate `lm_head.weight` in a tied checkpoint). Any other extra tensor means the config and
the weights disagree (e.g. more layers than `num_hidden_layers`) and is refused.

The weights digest identifies the checkpoint as stored, before any cast: xxh3-128 over each
tensor's name, shape, dtype and bytes in sorted name order. Two folders with the same digest
hold the same numbers, whatever their sharding.

This module knows HF names and shapes only; how the forward packs them is `llama.py`'s concern.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError, safe_open

from pdserve.errors import ModelConfigError, ModelFileMissing, WeightShapeMismatch
from pdserve.model.config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Weights:
    """A checkpoint's tensors by HF name, cast to one dtype, and the digest of the stored bytes."""

    tensors: dict[str, torch.Tensor]
    digest: str


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the config implies, with its shape ([out, in] for linear weights)."""
    h, d = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if config.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    return shapes


def load_weights(folder: str | Path, config: ModelConfig, dtype: str = "float32") -> Weights:
    """Load, check and digest every tensor of the checkpoint in `folder`, cast to `dtype`."""
    folder = Path(folder)
    target = TORCH_DTYPES[dtype]
    locations = _locate(folder)
    expected = expected_shapes(config)
    for name, file in sorted(locations.items()):
        if name not in expected and not _ignorable(name, config):
            raise ModelConfigError(
                file.name, name, "tensor not implied by config.json (wrong num_hidden_layers?)"
            )
    for name, shape in expected.items():
        if name not in locations:
            where = INDEX_FILE if (folder / INDEX_FILE).is_file() else SINGLE_FILE
            raise ModelConfigError(
                where, name, f"tensor missing from the checkpoint (config implies {list(shape)})"
            )
    hasher = xxhash.xxh3_128()
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in sorted(expected):
        by_file.setdefault(locations[name], []).append(name)
    stored: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in names:
                    stored[name] = handle.get_tensor(name)
        except SafetensorError as exc:
            raise ModelConfigError(
                file.name, "<file>", f"not a valid safetensors file: {exc}"
            ) from exc
    for name in sorted(expected):
        tensor = stored.pop(name)
        if tuple(tensor.shape) != expected[name]:
            raise WeightShapeMismatch(
                locations[name].name, name, expected[name], tuple(tensor.shape)
            )
        if not tensor.is_floating_point():
            raise ModelConfigError(
                locations[name].name, name, f"dtype {tensor.dtype} is not floating point"
            )
        _update_digest(hasher, name, tensor)
        tensors[name] = tensor.to(target).contiguous()
    return Weights(tensors=tensors, digest=hasher.hexdigest())


def _locate(folder: Path) -> dict[str, Path]:
    """Map each tensor name to the file holding it."""
    index = folder / INDEX_FILE
    single = folder / SINGLE_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelConfigError(INDEX_FILE, "weight_map", f"unreadable: {exc}") from exc
        if not isinstance(weight_map, dict):
            raise ModelConfigError(INDEX_FILE, "weight_map", "expected an object")
        locations: dict[str, Path] = {}
        for name, shard in weight_map.items():
            path = folder / str(shard)
            if not path.is_file():
                raise ModelFileMissing(str(path), f"weight shard listed in {INDEX_FILE}")
            locations[name] = path
        return locations
    if not single.is_file():
        raise ModelFileMissing(str(single), f"weights ({SINGLE_FILE} or {INDEX_FILE})")
    try:
        with safe_open(str(single), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single)
    except SafetensorError as exc:
        raise ModelConfigError(
            SINGLE_FILE, "<file>", f"not a valid safetensors file: {exc}"
        ) from exc


def _ignorable(name: str, config: ModelConfig) -> bool:
    # Old checkpoints saved the RoPE buffer; tied ones sometimes still carry the shared matrix.
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return name == "lm_head.weight" and config.tie_word_embeddings


def _update_digest(hasher: xxhash.xxh3_128, name: str, tensor: torch.Tensor) -> None:
    header = f"{name}|{list(tensor.shape)}|{str(tensor.dtype).removeprefix('torch.')}|"
    hasher.update(header.encode())
    # Raw stored bytes: view as uint8 works for bfloat16, which numpy cannot represent.
    hasher.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
