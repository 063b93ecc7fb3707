"""`load_model`: one call from a model folder to a ready forward, tokenizer and fingerprint.

Order: validate the arguments, parse the config, open the tokenizer, load and check the
weights, build the module (eval mode, no grad), quantize if asked, then compute the
fingerprint from what was actually loaded. Every failure is a typed error from `errors.py`
naming the file and field, raised before any large allocation where possible (config and
tokenizer are checked before the weights are read).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.config import QUANTIZATIONS
from pdserve.errors import ConfigError, ModelConfigError
from pdserve.model.config import ModelConfig, load_config
from pdserve.model.device import resolve_device
from pdserve.model.fingerprint import Fingerprint
from pdserve.model.llama import LlamaModel
from pdserve.model.quant import quantize_linears
from pdserve.model.tiny import default_model_path
from pdserve.model.tokenizer import TOKENIZER_FILE, Tokenizer
from pdserve.model.weights import TORCH_DTYPES, load_weights

CPU = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A loaded checkpoint: everything an engine needs from the model folder."""

    config: ModelConfig
    # Eval mode; forward and compute_logits run under inference_mode.
    module: LlamaModel
    tokenizer: Tokenizer
    fingerprint: Fingerprint
    # The config's and generation config's eos ids, then the tokenizer's, without repeats.
    eos_token_ids: tuple[int, ...]
    path: Path
    dtype: str
    quantization: str | None
    # Where the weights live; the engine puts its KV cache and every per-step tensor there.
    device: torch.device = CPU


def load_model(
    path: str | Path | None = None,
    dtype: str = "float32",
    quantization: str | None = None,
    kv_block_size: int = 16,
    device: str = "cpu",
) -> LoadedModel:
    """Load the HF folder at `path` (None: the embedded tiny default) for serving.

    dtype: "float32" or "bfloat16" (weights are cast on load; activations and KV use it).
    quantization: None or "int8" (weight-only, per output channel, linear layers only).
    kv_block_size: tokens per KV block, recorded in the fingerprint.
    device: "auto", "cpu" or "cuda" (`model.device.resolve_device`); checked before any load.
    """
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"dtype: {dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization: {quantization!r} is not one of None, 'int8'")
    if isinstance(kv_block_size, bool) or not isinstance(kv_block_size, int) or kv_block_size < 1:
        raise ConfigError(f"kv_block_size: must be a positive integer, got {kv_block_size!r}")
    where = resolve_device(device, dtype)
    folder = Path(path) if path is not None else default_model_path()
    config = load_config(folder)
    tokenizer = Tokenizer(folder)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelConfigError(
            TOKENIZER_FILE,
            "vocab",
            f"{tokenizer.vocab_size} tokens exceed config.json vocab_size={config.vocab_size}",
        )
    weights = load_weights(folder, config, dtype)
    module = LlamaModel.from_hf_weights(config, weights.tensors)
    if quantization == "int8":
        quantize_linears(module)
    if where.type != "cpu":
        module = module.to(where)
    fingerprint = Fingerprint.build(
        config,
        weights_digest=weights.digest,
        tokenizer_digest=tokenizer.digest,
        dtype=dtype,
        quantization=quantization,
        kv_block_size=kv_block_size,
        device=where.type,
    )
    eos = tuple(dict.fromkeys(config.eos_token_ids + tokenizer.eos_token_ids))
    return LoadedModel(
        config=config,
        module=module,
        tokenizer=tokenizer,
        fingerprint=fingerprint,
        eos_token_ids=eos,
        path=folder,
        dtype=dtype,
        quantization=quantization,
        device=where,
    )
