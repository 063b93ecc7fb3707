"""Pins the public names of `pdserve.model`: a removal or rename must be deliberate."""

from __future__ import annotations

import pdserve.model

PUBLIC = {
    "KV_LAYOUT_VERSION",
    "SUPPORTED_ARCHITECTURES",
    "TINY_VERSION",
    "AttentionMetadata",
    "Fingerprint",
    "IncrementalDetokenizer",
    "Int8Linear",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "RopeScaling",
    "Tokenizer",
    "Weights",
    "build_metadata",
    "build_tiny_model",
    "contiguous_metadata",
    "default_model_path",
    "expected_shapes",
    "load_config",
    "load_model",
    "load_weights",
    "quantize_linears",
}


def test_public_names() -> None:
    assert set(pdserve.model.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(pdserve.model, name) is not None
