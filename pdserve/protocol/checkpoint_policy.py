"""When a decoding request's blocks are checkpointed: off, the prompt only, or every N blocks.

    off        nothing is sent
    prompt     the prompt's full blocks, once, after the commit (a resume recomputes the
               generated tokens only)
    every-N    the prompt's full blocks first, then the generated ones in batches of at least
               N full blocks (a resume recomputes fewer than N + 1 blocks of tokens, plus what
               was in flight)

`next_batch` is the whole decision: given how many of the request's blocks hold computed KV and
how many were sent, which to send now. Pure: counts in, a range out.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from pdserve.errors import ConfigError


class Mode(enum.Enum):
    OFF = "off"
    PROMPT = "prompt"
    EVERY = "every"


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """The configured policy; `every_n_blocks` matters for EVERY only."""

    mode: Mode = Mode.OFF
    every_n_blocks: int = 1

    @classmethod
    def parse(cls, text: str, flag: str = "--checkpoint") -> CheckpointPolicy:
        """ "off", "prompt" or "every-N" (N >= 1); ConfigError naming the flag otherwise."""
        if text in ("off", "prompt"):
            return cls(Mode(text))
        match = re.fullmatch(r"every-([0-9]+)", text)
        if match is None or int(match.group(1)) < 1:
            raise ConfigError(f"{flag}: {text!r} is not off, prompt or every-N (N >= 1)")
        return cls(Mode.EVERY, int(match.group(1)))

    def __str__(self) -> str:
        return f"every-{self.every_n_blocks}" if self.mode is Mode.EVERY else self.mode.value

    @property
    def enabled(self) -> bool:
        return self.mode is not Mode.OFF

    def next_batch(
        self, num_prompt_tokens: int, num_full_blocks: int, num_sent_blocks: int, block_size: int
    ) -> range:
        """Block indices to send now: `num_full_blocks` of the request's blocks hold computed
        KV (prompt and generated), the first `num_sent_blocks` are at the holder already."""
        if self.mode is Mode.OFF or num_full_blocks <= num_sent_blocks:
            return range(num_sent_blocks, num_sent_blocks)
        prompt_blocks = min(num_prompt_tokens // block_size, num_full_blocks)
        if num_sent_blocks < prompt_blocks:
            # The prompt first, in one batch, as soon as it is computed; with EVERY the
            # generated blocks already full travel with it.
            end = prompt_blocks if self.mode is Mode.PROMPT else num_full_blocks
            return range(num_sent_blocks, end)
        if self.mode is Mode.PROMPT:
            return range(num_sent_blocks, num_sent_blocks)
        if num_full_blocks - num_sent_blocks >= self.every_n_blocks:
            return range(num_sent_blocks, num_full_blocks)
        return range(num_sent_blocks, num_sent_blocks)
