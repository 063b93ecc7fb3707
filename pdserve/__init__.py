"""pdserve: LLM serving with disaggregated prefill and decode, built to survive the split."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.llm import LLM, CompletionOutput
    from pdserve.protocol.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Lazy, so that importing a pure module (codec, block manager) does not import torch.
    if name == "SamplingParams":
        from pdserve.protocol.sampling import SamplingParams

        return SamplingParams
    if name in ("LLM", "CompletionOutput"):
        from pdserve import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
