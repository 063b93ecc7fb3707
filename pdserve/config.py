"""Typed configuration, built once from the CLI (or the Python API) and passed down by part.

Each part receives only its own sub-config: the engine never sees router settings. Every field
is validated at construction, so a bad value fails at start with the field's name, not deep in
a worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.errors import ConfigError
from pdserve.flag_types import positive_int
from pdserve.settings import Flag, setting

# float16 is served on CUDA only (`model.device`).
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = (None, "int8")

# The flags of the model to load, declared once here: `ModelLoadConfig` and the configs of the
# commands that start engines elsewhere (`pdserve up`, the benchmarks) share them.
MODEL = Flag(name="model", type=str, help="Hugging Face model folder (default: tiny built-in)")
DTYPE = Flag(choices=DTYPES, help="float16: CUDA only")
BLOCK_SIZE = Flag(type=positive_int, help="tokens per KV block")


def _quantization_flag(value: str) -> str | None:
    # "none" on the command line (and in files) is the field's None.
    return None if value == "none" else value


@dataclass(frozen=True, slots=True)
class ModelLoadConfig:
    """Which checkpoint to load and how."""

    # Hugging Face folder; None means the embedded tiny default model.
    path: str | None = setting(None, MODEL)
    dtype: str = setting("float32", DTYPE)
    # Weight-only int8 (per output channel) or None.
    quantization: str | None = setting(
        None,
        type=str,
        choices=("none", "int8"),
        to_field=_quantization_flag,
        to_flag=lambda value: value or "none",
    )
    # auto: CUDA when this torch build has it and a GPU is visible, else the CPU
    # (`model.device.resolve_device`, which also refuses float16 off CUDA).
    device: str = setting(
        "auto",
        choices=DEVICES,
        help="where the engine runs: auto is CUDA when torch has it and a GPU is visible",
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device not in DEVICES:
            raise ConfigError(f"device: {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization: {self.quantization!r} is not one of None, 'int8'")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """KV cache size and scheduling limits of one engine."""

    # Tokens per KV block.
    block_size: int = setting(16, BLOCK_SIZE)
    # Bytes of KV cache to allocate; the number of blocks follows from the model's shapes.
    kv_cache_bytes: int = setting(256 * 1024 * 1024)
    # Overrides kv_cache_bytes when set (tests use tiny pools to force preemption).
    num_blocks: int | None = None
    # Tokens one step may process across all requests (prefill chunks + decode tokens).
    max_num_batched_tokens: int = setting(2048)
    # Requests running at once.
    max_num_seqs: int = setting(64, help="requests running at once")
    # Split long prompts into chunks that share steps with decode tokens.
    enable_chunked_prefill: bool = setting(
        True, help="split long prompts into chunks that share steps with decoding"
    )
    # Reuse full KV blocks of earlier requests with the same token prefix.
    enable_prefix_caching: bool = setting(
        True, help="reuse KV blocks of earlier requests with the same prefix"
    )
    # Compute every token on canonical shapes (`model.batch_invariant`): its logits, and so
    # its logprobs and sampled token, are bitwise the same whatever else the step computes,
    # however the prompt was chunked or cached, and after a migration's recompute.
    batch_invariant: bool = setting(
        False, help="bitwise-reproducible logits whatever the batch (costs throughput; see README)"
    )
    # Longest prompt + output a request may have; None: the model's max_position_embeddings
    # (a larger value is refused when the model loads).
    max_model_len: int | None = setting(
        None,
        type=int,
        help="longest prompt + output in tokens (default: the model's max_position_embeddings)",
    )
    # The KV cache in an exported memfd arena that same-host peers map read-only, so the
    # shared-memory transport hands a handoff's blocks over with one copy (the receiver's)
    # instead of two. Set by workers that send KV over shm; nothing else changes.
    shared_kv: bool = False
    # KV handed off through a host mirror of the cache (`engine/kv_cache.py`): what a GPU
    # engine always does; on the CPU it exercises the same staging path in tests.
    kv_host_staging: bool = setting(
        False,
        help="hand KV off through a host mirror of the cache (always so on a GPU; on the CPU"
        " for tests of that path)",
    )
    # On CUDA, decode-only steps replay CUDA graphs captured per padded batch size.
    cuda_graphs: bool = setting(True, help="on CUDA, replay decode steps as captured graphs")
    model: ModelLoadConfig = field(default_factory=ModelLoadConfig)

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_bytes", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ConfigError(f"max_model_len: must be an integer >= 2, got {self.max_model_len!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks: must be >= 1, got {self.num_blocks!r}")
