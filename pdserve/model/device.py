"""Which device an engine runs on: `auto`, `cpu` or `cuda`, resolved once at load.

`auto` picks CUDA when this torch build has it and a GPU is visible, else the CPU. An explicit
`cuda` that cannot be had is an error at start naming why (a CPU-only torch build, or no GPU
visible), never a silent fallback to the CPU. float16 is CUDA only: on the CPU torch's float16
matmuls are slow and numerically unlike the GPU's, so a CPU engine is float32 or bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.config import DEVICES
from pdserve.errors import ConfigError

# dtypes each device kind serves.
DEVICE_DTYPES = {"cpu": ("float32", "bfloat16"), "cuda": ("float32", "bfloat16", "float16")}


def _cuda_state() -> tuple[bool, str]:
    """(usable, why not): CUDA in this torch build and at least one visible GPU."""
    if torch.version.cuda is None:
        return False, f"this torch build ({torch.__version__}) has no CUDA"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    return True, ""


def resolve_device(
    requested: str, dtype: str = "float32", cuda_state: Callable[[], tuple[bool, str]] = _cuda_state
) -> torch.device:
    """The torch device for `requested` (auto|cpu|cuda); ConfigError names the field and why."""
    if requested not in DEVICES:
        raise ConfigError(f"device: {requested!r} is not one of {', '.join(DEVICES)}")
    usable, why = cuda_state()
    if requested == "cuda" and not usable:
        raise ConfigError(f"device: cuda was asked for, but {why}")
    kind = "cuda" if requested == "cuda" or (requested == "auto" and usable) else "cpu"
    if dtype not in DEVICE_DTYPES[kind]:
        raise ConfigError(
            f"dtype: {dtype!r} is not served on {kind} (one of {', '.join(DEVICE_DTYPES[kind])})"
        )
    return torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")


def device_memory(device: torch.device) -> dict[str, int]:
    """torch's allocator figures on a GPU: bytes held by live tensors ("allocated") and by the
    caching allocator in all ("reserved", what other processes cannot have); {} on the CPU."""
    if device.type != "cuda":
        return {}
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
    }
