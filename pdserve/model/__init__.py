"""Model folder -> config, weights, forward, tokenizer and fingerprint (see each module).

`load_model` is the entry point; `default_model_path` gives the embedded tiny model. The forward
(`LlamaModel`) is stateless and runs over the paged KV cache defined in `attention.py`.

The names below are imported on first use (PEP 562), so that importing a torch-free module of
this package (`tokenizer`, `fingerprint`, `config`), as the router does, does not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "KV_LAYOUT_VERSION": "kv_layout",
    "AttentionMetadata": "attention",
    "build_metadata": "attention",
    "contiguous_metadata": "attention",
    "SUPPORTED_ARCHITECTURES": "config",
    "ModelConfig": "config",
    "RopeScaling": "config",
    "load_config": "config",
    "Fingerprint": "fingerprint",
    "LlamaModel": "llama",
    "LoadedModel": "loader",
    "load_model": "loader",
    "Int8Linear": "quant",
    "quantize_linears": "quant",
    "TINY_VERSION": "tiny",
    "build_tiny_model": "tiny",
    "default_model_path": "tiny",
    "IncrementalDetokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "Weights": "weights",
    "expected_shapes": "weights",
    "load_weights": "weights",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'pdserve.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pdserve.model.{module}"), name)
