"""Per-request sampling parameters, validated at construction.

Field names and defaults follow vLLM's `SamplingParams` so that users moving from vLLM or the
OpenAI API find what they expect; `temperature == 0` means greedy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.errors import SamplingParamsError

# Seeds are unsigned 64-bit integers (`sampler.draw_key` packs them into 8 bytes).
MAX_SEED = 1 << 64


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop."""

    max_tokens: int = 16
    # 0 is greedy; otherwise logits are divided by it before sampling.
    temperature: float = 1.0
    # Keep the k most likely tokens; 0 or -1 keeps all.
    top_k: int = 0
    # Keep the smallest set of tokens whose probability reaches top_p.
    top_p: float = 1.0
    # Seeds the per-token randomness; None lets the engine pick one (and report it).
    seed: int | None = None
    # Generation stops when the output text contains any of these; the text excludes it.
    stop: tuple[str, ...] = field(default_factory=tuple)
    # Generation stops after sampling any of these token ids (EOS is added by the engine).
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Do not stop at the model's EOS token.
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingParamsError(
                f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(
                f"temperature: must be a finite number >= 0, got {self.temperature!r}"
            )
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingParamsError(
                f"top_k: must be -1, 0 or a positive integer, got {self.top_k!r}"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not 0 <= self.seed < MAX_SEED
        ):
            raise SamplingParamsError(f"seed: must be an integer in [0, 2**64), got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError(
                f"stop: every stop string must be non-empty, got {self.stop!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax and needs no randomness."""
        return self.temperature == 0.0
