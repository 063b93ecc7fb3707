"""A request's output as the client sees it: tokens in, text deltas and a finish reason out.

Applies, per token and in this order: stop token ids and EOS (the token ends the request and
adds no text), incremental detokenization, stop strings (`StopMatcher`: text that may begin a
stop string is held back across chunk borders and the stop string itself is never sent), and
max_tokens ("length"). The router applies these itself rather than trusting each worker's own
checks, so the text is the same whichever path (and however many workers) produced the tokens.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection

from pdserve.model.tokenizer import Tokenizer
from pdserve.router.stop import StopMatcher
from pdserve.worker.protocol import SamplingModel


class OutputStream:
    """Turns one request's token ids into text deltas."""

    def __init__(
        self, tokenizer: Tokenizer, sampling: SamplingModel, eos_token_ids: Collection[int]
    ) -> None:
        self._detokenizer = tokenizer.detokenizer()
        self._matcher = StopMatcher(sampling.stop)
        self._max_tokens = sampling.max_tokens
        self._stop_token_ids = frozenset(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            self._stop_token_ids |= frozenset(eos_token_ids)
        self.token_ids: list[int] = []
        # None while the request runs; "stop" or "length" once it is over.
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        """True once the output is complete; later tokens are ignored."""
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Completion tokens counted (including a final stop or EOS token)."""
        return len(self.token_ids)

    def add(self, token_id: int) -> str:
        """Consume one token; return the text it releases."""
        if self.finished:
            return ""
        self.token_ids.append(token_id)
        if token_id in self._stop_token_ids:
            return self._finish("stop")
        text = self._matcher.feed(self._detokenizer.add(token_id))
        if self._matcher.stopped:
            self.finish_reason = "stop"
            return text
        if len(self.token_ids) >= self._max_tokens:
            return text + self._finish("length")
        return text

    def add_all(self, token_ids: list[int]) -> str:
        """Consume tokens until finished; return the text they release."""
        return "".join(self.add(t) for t in token_ids if not self.finished)

    def finish(self, worker_reason: str) -> str:
        """The worker ended the stream; release what is held and adopt its reason."""
        if self.finished:
            return ""
        return self._finish("length" if worker_reason == "length" else "stop")

    def _finish(self, reason: str) -> str:
        text = self._matcher.feed(self._detokenizer.flush())
        # The flushed tail may itself complete a stop string.
        self.finish_reason = "stop" if self._matcher.stopped else reason
        return text + self._matcher.flush()
