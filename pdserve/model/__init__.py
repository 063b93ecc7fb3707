"""Model folder -> config, weights, forward, tokenizer and fingerprint (see each module).

`load_model` is the entry point; `default_model_path` gives the embedded tiny model. The forward
(`LlamaModel`) is stateless and runs over the paged KV cache defined in `attention.py`.
"""

from pdserve.model.attention import (
    KV_LAYOUT_VERSION,
    AttentionMetadata,
    build_metadata,
    contiguous_metadata,
)
from pdserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling, load_config
from pdserve.model.fingerprint import Fingerprint
from pdserve.model.llama import LlamaModel
from pdserve.model.loader import LoadedModel, load_model
from pdserve.model.quant import Int8Linear, quantize_linears
from pdserve.model.tiny import TINY_VERSION, build_tiny_model, default_model_path
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.model.weights import Weights, expected_shapes, load_weights

__all__ = [
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
]
