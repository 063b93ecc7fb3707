"""A request's output as the client sees it: tokens in, text deltas and a finish reason out.

Applies, per token and in this order: stop token ids and EOS (the token ends the request and
adds no text; not before `min_tokens` tokens), incremental detokenization (special tokens
skipped unless `skip_special_tokens` is off), stop strings (`StopMatcher`: text that may begin
a stop string is held back across chunk borders; the stop string itself is never sent unless
`include_stop_str_in_output`; none counts before `min_tokens` tokens), and max_tokens
("length"). The router applies these to every request (and `pdserve.llm` to offline ones); the
engine checks no stop string, so the text is the same whichever path (and however many
workers) produced the tokens, and no step re-decodes an output.

Per token it also records where the token's text starts in the output (`text_offsets`, for
completions logprobs). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from pdserve.model.tokenizer import Tokenizer
from pdserve.text.stop import StopMatcher


class StopRules(Protocol):
    """What ends a request's output: `SamplingParams`."""

    @property
    def stop(self) -> Sequence[str]: ...
    @property
    def stop_token_ids(self) -> Sequence[int]: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...


class OutputStream:
    """Turns one request's token ids into text deltas."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        sampling: StopRules,
        eos_token_ids: Collection[int],
        *,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        max_tokens: int | None = None,
    ) -> None:
        self._detokenizer = tokenizer.detokenizer(skip_special_tokens)
        self._matcher = StopMatcher(sampling.stop, include_stop_str_in_output)
        # 0 only for an echo of the prompt alone: the worker's token is not part of it.
        self._max_tokens = sampling.max_tokens if max_tokens is None else max_tokens
        self._min_tokens = sampling.min_tokens
        self._stop_token_ids = frozenset(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            self._stop_token_ids |= frozenset(eos_token_ids)
        self.token_ids: list[int] = []
        # Per token: characters of decoded output before it (the untruncated text).
        self.text_offsets: list[int] = []
        self._decoded_len = 0
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
        if self._max_tokens == 0:
            return self._finish("length")
        self.token_ids.append(token_id)
        self.text_offsets.append(self._decoded_len)
        past_min = len(self.token_ids) > self._min_tokens
        if past_min and token_id in self._stop_token_ids:
            return self._finish("stop")
        decoded = self._detokenizer.add(token_id)
        self._decoded_len += len(decoded)
        text = self._matcher.feed(decoded, can_stop=past_min)
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
        tail = self._detokenizer.flush()
        self._decoded_len += len(tail)
        text = self._matcher.feed(tail, can_stop=len(self.token_ids) > self._min_tokens)
        # The flushed tail may itself complete a stop string.
        self.finish_reason = "stop" if self._matcher.stopped else reason
        return text + self._matcher.flush()
