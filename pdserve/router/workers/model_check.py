"""Does a worker run the model this router serves? Compared field by field. Pure.

The router tokenizes prompts and detokenizes outputs with its own copy of the model folder
(`--model`); a worker that runs another model (another tokenizer, another architecture or
RoPE) would answer every request with text that is wrong and looks fine. So the router
computes the fingerprint fields it can from its folder, without loading weights, and compares
them with each worker's fingerprint (from /health): a worker that differs is never chosen, the
router's /health says why (`degraded`), and at start-up any such worker is an error that names
the differing fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pdserve.model.config import load_config
from pdserve.model.tokenizer import Tokenizer

# Fingerprint fields a router can compute from its model folder (weights digest, dtype,
# quantization and KV layout belong to the workers, which check them among themselves).
ROUTER_FIELDS = (
    "architecture",
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rope_type",
    "rope_theta",
    "rope_scaling",
    "tokenizer_digest",
)

ModelFields = dict[str, str | int | float]


def router_model_fields(folder: Path, tokenizer: Tokenizer | None = None) -> ModelFields:
    """The fingerprint fields of the router's model folder."""
    config = load_config(folder)
    tokenizer = tokenizer or Tokenizer(folder)
    return {
        "architecture": config.architecture,
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "rope_type": config.rope_type,
        "rope_theta": float(config.rope_theta),
        "rope_scaling": "none" if config.rope_scaling is None else config.rope_scaling.canonical(),
        "tokenizer_digest": tokenizer.digest,
    }


def model_mismatch(
    router: Mapping[str, str | int | float], worker: Mapping[str, object]
) -> dict[str, tuple[object, object]]:
    """Every router field the worker's fingerprint differs on: name -> (router's, worker's)."""
    diff: dict[str, tuple[object, object]] = {}
    for name, mine in router.items():
        theirs = worker.get(name)
        same = (
            float(mine) == float(theirs)
            if isinstance(mine, float) and isinstance(theirs, int | float)
            else mine == theirs
        )
        if not same:
            diff[name] = (mine, theirs)
    return diff


def describe(diff: Mapping[str, tuple[object, object]]) -> str:
    """`field: router's != worker's, ...` for a mismatch."""
    return ", ".join(f"{name} {a!r} != {b!r}" for name, (a, b) in sorted(diff.items()))
