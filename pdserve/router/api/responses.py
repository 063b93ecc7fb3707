"""OpenAI response bodies for one request: whole responses, streamed chunks, errors. Pure.

`Job` is a validated request on its way through its flows (what every builder needs: id,
creation time, the client's body, the prompts and the sampling); `ChoiceResult` is one
choice's output as it accumulates. Completion chunks reuse the `text_completion` object as
OpenAI does; chat chunks carry a `delta`, the role on the first one; a usage chunk
(`stream_options.include_usage`) has no choices. Usage sums every prompt (once each) and every
returned choice; `prompt_tokens_details.cached_tokens` is what the workers' prefix caches
supplied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel

from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker_api import LogprobModel
from pdserve.router.api.logprobs_format import (
    TokenName,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
    token_id_name,
)
from pdserve.router.api.openai_models import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    FunctionCallOut,
    FunctionDeltaOut,
    PromptTokensDetails,
    SamplingFields,
    ToolCallDeltaOut,
    ToolCallOut,
    Usage,
)
from pdserve.text.output import OutputStream
from pdserve.tools.formats import ToolFormat
from pdserve.tools.parser import ParsedDelta, ToolCallDelta, ToolCallParser


@dataclass(frozen=True, slots=True)
class PromptInput:
    """One prompt: its token ids and its text (echoed with `echo`)."""

    token_ids: list[int]
    text: str


@dataclass(slots=True)
class Job:
    """One validated request on its way through its flows."""

    kind: str  # "completion" or "chat"
    request_id: str
    created: int
    body: SamplingFields
    prompts: list[PromptInput]
    # The base sampling: choice k of each prompt runs with `fanout.choice_seed(seed, k)`.
    sampling: SamplingParams
    # Samples per prompt (>= n; the n with the highest total logprob are returned).
    best_of: int = 1
    # Logprob alternatives the client asked for per token; None: no logprobs in the answer.
    top_logprobs: int | None = None
    # Completions: prepend the prompt to each choice; echo_only: and generate nothing.
    echo: bool = False
    echo_only: bool = False
    # Chat with `echo`: the text each choice's content starts with (the final message's).
    chat_echo: str = ""
    # Chat: the answer's role: "assistant", or with add_generation_prompt false the final
    # message's (the prompt did not open an assistant turn, so the model continues that one).
    role: str = "assistant"
    # vLLM's `prompt_logprobs`: alternatives per prompt position; None: not asked.
    prompt_logprobs: int | None = None
    # Chat with tools (tool_choice not "none"): the output is read for calls in this format.
    tool_format: ToolFormat | None = None

    @property
    def n(self) -> int:
        """Choices returned per prompt."""
        return self.body.n

    @property
    def prompt_token_ids(self) -> list[int]:
        """The first (usually only) prompt's token ids."""
        return self.prompts[0].token_ids


@dataclass(slots=True)
class ChoiceResult:
    """One choice's output so far: its content, and its tool calls when it is read for them."""

    index: int
    prompt: PromptInput
    output: OutputStream
    # Reads the output for tool calls (chat with tools); None: the output is all content.
    parser: ToolCallParser | None = None
    text: str = ""
    tool_calls: list[ToolCallOut] = field(default_factory=list)
    # One per accepted output token when logprobs were computed.
    logprobs: list[LogprobModel] = field(default_factory=list)
    prompt_logprobs: list[LogprobModel] | None = None
    num_cached_tokens: int | None = None

    @property
    def total_logprob(self) -> float:
        """Sum of the output tokens' logprobs (best_of ranks by it)."""
        return sum(lp.logprob for lp in self.logprobs)

    @property
    def finish_reason(self) -> str | None:
        """The output's finish reason; `tool_calls` when it stopped after making calls."""
        reason = self.output.finish_reason
        return "tool_calls" if reason == "stop" and self.tool_calls else reason

    def add_text(self, text: str) -> ParsedDelta:
        """Take the next output text: what it adds to the content and to the calls (the
        parser's held text is flushed once the output has finished)."""
        delta = self.parser.feed(text) if self.parser is not None else ParsedDelta(text)
        if self.parser is not None and self.output.finished:
            tail = self.parser.finish()
            delta.content += tail.content
            delta.calls.extend(tail.calls)
        self.text += delta.content
        for call in delta.calls:
            if call.id is not None:
                function = FunctionCallOut(name=call.name or "", arguments=call.arguments)
                self.tool_calls.append(ToolCallOut(id=call.id, function=function))
            else:
                self.tool_calls[call.index].function.arguments += call.arguments
        return delta


def usage(job: Job, choices: Sequence[ChoiceResult]) -> Usage:
    """Token counts of these choices (so far, while streaming)."""
    num_prompt = sum(len(p.token_ids) for p in job.prompts)
    num_completion = sum(c.output.num_tokens for c in choices)
    cached: dict[int, int] = {}
    for c in choices:
        if c.num_cached_tokens is not None:
            cached.setdefault(id(c.prompt), c.num_cached_tokens)
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())),
    )


def echo_logprobs(
    job: Job, texts: TokenTexts, choice: ChoiceResult, prompt_offsets: Sequence[int]
) -> CompletionLogprobs | None:
    """Logprobs of the echoed prompt (first token: none), or None if not asked."""
    if job.top_logprobs is None:
        return None
    names = token_names(job, texts)
    # The worker may have computed more alternatives (for prompt_logprobs): trim to logprobs.
    entries: list[LogprobModel | None] = [
        None,
        *(_trim(e, job.top_logprobs) for e in choice.prompt_logprobs or []),
    ]
    ids = choice.prompt.token_ids
    entries = (entries + [None] * len(ids))[: len(ids)]
    return completion_logprobs(names, ids, entries, prompt_offsets)


def output_logprobs(
    job: Job,
    texts: TokenTexts,
    token_ids: Sequence[int],
    entries: Sequence[LogprobModel],
    offsets: Sequence[int],
) -> CompletionLogprobs | ChatLogprobs | None:
    """Logprobs of these output tokens in the job's shape, or None if not asked."""
    if job.top_logprobs is None:
        return None
    names = token_names(job, texts)
    if job.kind == "chat":
        return chat_logprobs(names, [_trim(e, job.top_logprobs) for e in entries])
    return completion_logprobs(
        names, token_ids, [_trim(e, job.top_logprobs) for e in entries], offsets
    )


def token_names(job: Job, texts: TokenTexts) -> TokenName:
    """How the job's logprobs name tokens: by text, or `token_id:N` when it asked for ids."""
    return token_id_name if job.body.return_tokens_as_token_ids else texts


def _trim(entry: LogprobModel, num_top: int) -> LogprobModel:
    # best_of computes logprobs the client did not ask for: return only what was asked.
    if len(entry.top_token_ids) <= num_top:
        return entry
    return entry.model_copy(
        update={
            "top_token_ids": entry.top_token_ids[:num_top],
            "top_logprobs": entry.top_logprobs[:num_top],
        }
    )


def chunk(
    job: Job,
    index: int,
    text: str,
    finish_reason: str | None,
    token_ids: list[int] | None = None,
    logprobs: CompletionLogprobs | ChatLogprobs | None = None,
    usage: Usage | None = None,
    calls: Sequence[ToolCallDelta] = (),
) -> BaseModel:
    """One streamed chunk adding `text` (and chat tool-call pieces `calls`) to choice `index`
    (finish_reason on the last); `token_ids` when asked, `logprobs` of the chunk's tokens,
    `usage` so far if asked."""
    ids = token_ids if job.body.return_token_ids else None
    if job.kind == "chat":
        chat_lp = logprobs if isinstance(logprobs, ChatLogprobs) else None
        delta = ChatDelta(
            content=text if text or not calls else None,
            tool_calls=[_call_delta(c) for c in calls] or None,
        )
        chunk = chat_chunk(job, index, delta, finish_reason, ids, chat_lp)
        chunk.usage = usage
        return chunk
    lp = logprobs if isinstance(logprobs, CompletionLogprobs) else None
    choice = CompletionChoice(
        index=index, text=text, finish_reason=finish_reason, token_ids=ids, logprobs=lp
    )
    return CompletionResponse(
        id=job.request_id, created=job.created, model=job.body.model, choices=[choice],
        usage=usage,
    )  # fmt: skip


def _call_delta(call: ToolCallDelta) -> ToolCallDeltaOut:
    # OpenAI's shape: the first piece of a call carries its id, type and whole name.
    first = call.id is not None
    return ToolCallDeltaOut(
        index=call.index,
        id=call.id,
        type="function" if first else None,
        function=FunctionDeltaOut(name=call.name if first else None, arguments=call.arguments),
    )


def chat_chunk(
    job: Job,
    index: int,
    delta: ChatDelta,
    finish_reason: str | None = None,
    token_ids: list[int] | None = None,
    logprobs: ChatLogprobs | None = None,
) -> ChatCompletionChunk:
    """A chat chunk with one choice's delta."""
    choice = ChatChunkChoice(
        index=index, delta=delta, finish_reason=finish_reason, token_ids=token_ids,
        logprobs=logprobs,
    )  # fmt: skip
    return ChatCompletionChunk(
        id=job.request_id, created=job.created, model=job.body.model, choices=[choice]
    )


def whole(job: Job, choices: Sequence[ChoiceResult], texts: TokenTexts) -> BaseModel:
    """The non-streamed response with these choices (in index order)."""
    counts = usage(job, choices)
    if job.kind == "chat":
        chat_choices = [
            ChatChoice(
                index=c.index,
                message=ChatMessageOut(
                    role=job.role,
                    content=job.chat_echo + c.text
                    if job.chat_echo or c.text or not c.tool_calls
                    else None,
                    tool_calls=c.tool_calls or None,
                ),
                finish_reason=c.finish_reason,
                token_ids=list(c.output.token_ids) if job.body.return_token_ids else None,
                logprobs=output_logprobs(job, texts, c.output.token_ids, c.logprobs, []),  # type: ignore[arg-type]
            )
            for c in choices
        ]
        prompt_lps = None
        if job.prompt_logprobs is not None and choices:
            # One prompt, so every choice's prompt logprobs are the same: the first's.
            first = choices[0]
            prompt_lps = prompt_logprobs(texts, first.prompt.token_ids,
                                         first.prompt_logprobs or [], job.prompt_logprobs)  # fmt: skip
        return ChatCompletionResponse(
            id=job.request_id, created=job.created, model=job.body.model,
            choices=chat_choices, usage=counts, prompt_logprobs=prompt_lps,
            prompt_token_ids=list(job.prompt_token_ids) if job.body.return_token_ids else None,
        )  # fmt: skip
    out = []
    for c in choices:
        prefix = c.prompt.text if job.echo else ""
        lp = output_logprobs(
            job, texts, c.output.token_ids, c.logprobs,
            [len(prefix) + o for o in c.output.text_offsets],
        )  # fmt: skip
        if job.echo and isinstance(lp, CompletionLogprobs):
            head = echo_logprobs(job, texts, c, prompt_offsets(texts, c.prompt))
            assert head is not None
            lp = _concat(head, lp)
        out.append(
            CompletionChoice(
                index=c.index,
                text=prefix + c.text,
                finish_reason=c.output.finish_reason,
                token_ids=list(c.output.token_ids) if job.body.return_token_ids else None,
                logprobs=lp if isinstance(lp, CompletionLogprobs) else None,
                prompt_token_ids=list(c.prompt.token_ids) if job.body.return_token_ids else None,
                prompt_logprobs=None
                if job.prompt_logprobs is None
                else prompt_logprobs(
                    texts, c.prompt.token_ids, c.prompt_logprobs or [], job.prompt_logprobs
                ),
            )
        )
    return CompletionResponse(
        id=job.request_id, created=job.created, model=job.body.model, choices=out, usage=counts
    )


def prompt_offsets(texts: TokenTexts, prompt: PromptInput) -> list[int]:
    """Where each prompt token's text starts in the echoed prompt (cumulative token texts,
    capped at the prompt text's length)."""
    offsets, at = [], 0
    for t in prompt.token_ids:
        offsets.append(min(at, len(prompt.text)))
        at += len(texts(t))
    return offsets


def _concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def usage_chunk(job: Job, choices: Sequence[ChoiceResult]) -> BaseModel:
    """The final streamed chunk of `stream_options.include_usage`: no choices, the usage."""
    counts = usage(job, choices)
    if job.kind == "chat":
        return ChatCompletionChunk(
            id=job.request_id, created=job.created, model=job.body.model, choices=[],
            usage=counts,
        )  # fmt: skip
    return CompletionResponse(
        id=job.request_id, created=job.created, model=job.body.model, choices=[], usage=counts
    )


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None,
    code: str | None = None,
) -> ErrorResponse:  # fmt: skip
    """The OpenAI error object as a model."""
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code))
