"""config.json parsing: both RoPE spellings, defaults, eos merging, bias flags, exact inv_freq."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve.model.config import RopeScaling, parse_config
from pdserve.model.llama import rope_cos_sin, rope_inv_freq

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 100,
    "max_position_embeddings": 512,
}
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_defaults() -> None:
    c = parse_config(BASE)
    assert (c.num_kv_heads, c.head_dim, c.rope_theta, c.rms_norm_eps) == (4, 16, 10000.0, 1e-6)
    assert c.rope_scaling is None and c.rope_type == "default"
    assert not c.tie_word_embeddings and not c.attention_bias and not c.o_proj_bias
    assert c.eos_token_ids == () and c.bos_token_id is None


def test_rope_spellings_agree() -> None:
    old = parse_config(
        {**BASE, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **LLAMA3}}
    )
    old_type_key = parse_config(
        {**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA3}}
    )
    new = parse_config(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}}
    )
    assert old == old_type_key == new
    assert new.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert new.rope_theta == 5e5
    default_new = parse_config(
        {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}
    )
    assert default_new.rope_scaling is None and default_new.rope_theta == 7.0


def test_llama3_original_length_defaults_to_max_positions() -> None:
    params = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    c = parse_config({**BASE, "rope_scaling": {"rope_type": "llama3", **params}})
    assert c.rope_scaling is not None
    assert c.rope_scaling.original_max_position_embeddings == 512


def test_eos_merges_generation_config_and_model_type_fallback() -> None:
    raw = {k: v for k, v in BASE.items() if k != "architectures"}
    c = parse_config(
        {**raw, "model_type": "mistral", "eos_token_id": 2}, {"eos_token_id": [2, 7, 9]}
    )
    assert c.architecture == "MistralForCausalLM"
    assert c.eos_token_ids == (2, 7, 9)


def test_bias_flags() -> None:
    qwen = parse_config({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen.attention_bias and not qwen.o_proj_bias
    llama = parse_config({**BASE, "attention_bias": True})
    assert llama.attention_bias and llama.o_proj_bias


def test_canonical_rope_scaling_is_sorted_json() -> None:
    assert RopeScaling("linear", 2.0).canonical() == '{"factor":2.0,"rope_type":"linear"}'


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0},
        {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3},
    ],
)
def test_inv_freq_and_tables_equal_transformers(rope: dict[str, Any]) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(
        **{k: v for k, v in BASE.items() if k != "architectures"}, rope_parameters=dict(rope)
    )
    ours = parse_config({**BASE, "rope_parameters": dict(rope)})
    if rope["rope_type"] == "default":
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
        theirs = rotary.inv_freq
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    assert torch.equal(rope_inv_freq(ours), theirs)
    cos, sin = rope_cos_sin(ours)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
    positions = torch.arange(512)[None]
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
