"""How a completion or chat completion is written: one JSON body, or SSE chunks ending in
`data: [DONE]` (the role or the echoed prompt first, a usage chunk last when asked)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from pdserve.router.api import responses, sse
from pdserve.router.api.fanout import ChoiceRun, Piece
from pdserve.router.api.logprobs_format import TokenTexts
from pdserve.router.api.openai_models import ChatCompletionChunk, ChatDelta, CompletionResponse
from pdserve.router.api.responses import ChoiceResult, Job, error_body


class ChatRender:
    """Writes one /v1/completions or /v1/chat/completions request's answer."""

    def __init__(self, job: Job, texts: TokenTexts, runs: Sequence[ChoiceRun]) -> None:
        self._job = job
        self._texts = texts
        self._runs = runs
        self._results = {run.result.index: run.result for run in runs}
        self._opened: set[int] = set()

    def observe(self, piece: Piece) -> None:
        """A piece of a request answered whole: each choice accumulates its own result."""

    def events(self, piece: Piece) -> list[bytes]:
        """The SSE events of one streamed piece (a choice's opening on its first)."""
        job, models = self._job, []
        first = piece.index not in self._opened
        if first:
            self._opened.add(piece.index)
            models += self._opening(self._results[piece.index])
        if (
            piece.text
            or piece.tool_calls
            or piece.finish_reason is not None
            or (job.body.return_token_ids and piece.token_ids)
            or (job.top_logprobs is not None and piece.token_ids)
        ):
            prefix = len(self._echo_prefix(self._results[piece.index]))
            lp = responses.output_logprobs(
                job, self._texts, piece.token_ids, piece.logprobs,
                [prefix + o for o in piece.text_offsets],
            )  # fmt: skip
            so_far = (
                responses.usage(job, [r.result for r in self._runs])
                if job.body.continuous_usage
                else None
            )
            body = responses.chunk(job, piece.index, piece.text, piece.finish_reason,
                                   piece.token_ids, lp, so_far, piece.tool_calls)  # fmt: skip
            models.append(body)
        if first and models and job.body.return_token_ids:
            self._add_prompt_ids(models[0], self._results[piece.index])
        return [sse.encode_event(m) for m in models]

    def _add_prompt_ids(self, model: BaseModel, choice: ChoiceResult) -> None:
        """With return_token_ids, vLLM sends the prompt once: on a completion choice's first
        chunk (each choice has its own prompt), on a chat stream's very first chunk."""
        ids = list(choice.prompt.token_ids)
        if isinstance(model, CompletionResponse):
            model.choices[0].prompt_token_ids = ids
        elif isinstance(model, ChatCompletionChunk) and len(self._opened) == 1:
            model.prompt_token_ids = ids

    def whole(self, chosen: Sequence[ChoiceResult]) -> BaseModel:
        """The answer of a request that was not streamed."""
        return responses.whole(self._job, chosen, self._texts)

    def failed(self, message: str, type_: str, code: str | None = None) -> list[bytes]:
        """The event that ends a stream which failed after its headers."""
        return [sse.encode_event(error_body(message, type_, code=code))]

    def closing(self, chosen: Sequence[ChoiceResult], ok: bool) -> list[bytes]:
        """The stream's last events: the usage chunk if asked (and all went well), [DONE]."""
        usage = ok and self._job.body.include_usage
        return [sse.encode_event(responses.usage_chunk(self._job, chosen))] * usage + [sse.DONE]

    def _opening(self, choice: ChoiceResult) -> list[BaseModel]:
        """What a streamed choice starts with: the role (chat), the echoed prompt (echo);
        with continuous usage, the role chunk carries the usage so far too (as vLLM's)."""
        job = self._job
        if job.kind == "chat":
            chunk = responses.chat_chunk(job, choice.index, ChatDelta(role=job.role))
            if job.body.continuous_usage:
                chunk.usage = responses.usage(job, [r.result for r in self._runs])
            if not job.chat_echo:
                return [chunk]
            echoed = responses.chat_chunk(job, choice.index, ChatDelta(content=job.chat_echo))
            echoed.usage = chunk.usage
            return [chunk, echoed]
        if not job.echo:
            return []
        offsets = responses.prompt_offsets(self._texts, choice.prompt)
        lp = responses.echo_logprobs(job, self._texts, choice, offsets)
        return [responses.chunk(job, choice.index, choice.prompt.text, None, None, lp)]

    def _echo_prefix(self, choice: ChoiceResult) -> str:
        return choice.prompt.text if self._job.echo else ""
