"""One client request, several independent worker requests: `n`, `best_of`, lists of prompts.

Each (prompt i, sample j) is its own flow with its own timeline and worker request, exactly as
a single request would run: its own routing, reservation, handoff, recovery and migration.
Sample j of every prompt runs with seed `choice_seed(seed, j)`: the request's seed itself for
j = 0 (so n=1 is unchanged) and a hash of (seed, j) otherwise. With the client's seed the
whole fan-out is reproducible, and since each flow carries its own seed, a migrated or
re-prefilled sample continues its own random stream. The router draws the seed when the
client gave none.

Ids: a request of one sample keeps the response id as its flow id; otherwise sample k (k =
i * best_of + j) runs as `<id>-<k>` (its timeline at /debug/requests/<id>-<k>).

Choices are returned with index i * n + j. With best_of > n the n samples of each prompt with
the highest total logprob are returned (vLLM's rule), re-indexed in that order; best_of > n is
refused when streaming, as in vLLM. Streams of several samples are merged as chunks arrive,
each chunk naming its choice's index; if one fails, the others are closed (their workers
released) and the error is the request's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import secrets
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

import xxhash

from pdserve.errors import RouterError
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.request_state import RequestTimeline
from pdserve.protocol.worker_api import LogprobModel
from pdserve.router.api.responses import ChoiceResult, Job
from pdserve.router.flows import progress
from pdserve.router.flows.dispatcher import Dispatcher
from pdserve.router.flows.flow import Flow, FlowRequest
from pdserve.text.output import OutputStream
from pdserve.tools.parser import ToolCallDelta, ToolCallParser


def call_id() -> str:
    """A new tool call's id (OpenAI's form: `call_` and 24 random characters)."""
    return f"call_{secrets.token_hex(12)}"


def choice_seed(seed: int, sample: int) -> int:
    """The seed of sample `sample` of a request seeded with `seed` (63 bits)."""
    if sample == 0:
        return seed
    h = xxhash.xxh3_64(seed.to_bytes(8, "little"))
    h.update(sample.to_bytes(8, "little"))
    return h.intdigest() & 0x7FFF_FFFF_FFFF_FFFF


@dataclass(frozen=True, slots=True)
class Piece:
    """What one worker chunk added to one choice."""

    index: int
    text: str
    finish_reason: str | None
    # The tokens the output accepted from this chunk, and their logprobs if computed.
    token_ids: list[int]
    logprobs: list[LogprobModel]
    # Where each accepted token's text starts in the choice's output text.
    text_offsets: list[int]
    # Pieces of tool calls (chat with tools); `text` is then the content only.
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(slots=True)
class ChoiceRun:
    """One sample in flight: its flow, request and accumulating result."""

    flow: Flow
    request: FlowRequest
    result: ChoiceResult

    @property
    def timeline(self) -> RequestTimeline:
        return self.request.timeline


def start(
    job: Job,
    dispatcher: Dispatcher,
    tokenizer: Tokenizer,
    session_id: str | None,
    deadline: float = math.inf,
) -> list[ChoiceRun]:
    """Begin every sample of `job` (a timeline each, the request's `deadline` in loop time
    each); nothing runs until `pieces`."""
    runs = []
    num_samples = len(job.prompts) * job.best_of
    seed = job.sampling.seed or 0
    b = job.body
    for i, prompt in enumerate(job.prompts):
        for j in range(job.best_of):
            k = i * job.best_of + j
            rid = job.request_id if num_samples == 1 else f"{job.request_id}-{k}"
            sampling = dataclasses.replace(job.sampling, seed=choice_seed(seed, j))
            flow, timeline = dispatcher.begin(rid)
            output = OutputStream(
                tokenizer,
                sampling,
                tokenizer.eos_token_ids,
                skip_special_tokens=b.skip_special_tokens,
                include_stop_str_in_output=b.include_stop_str_in_output,
                max_tokens=0 if job.echo_only else None,
            )
            request = FlowRequest(rid, prompt.token_ids, sampling, timeline, session_id, deadline)
            index = i * job.n + j if job.best_of == job.n else k
            parser = None if job.tool_format is None else ToolCallParser(job.tool_format, call_id)
            runs.append(ChoiceRun(flow, request, ChoiceResult(index, prompt, output, parser)))
    return runs


async def _choice_pieces(run: ChoiceRun) -> AsyncGenerator[Piece, None]:
    """One sample's pieces; its result accumulates as they pass."""
    freq, output, result = run.request, run.result.output, run.result
    timeline = freq.timeline
    async with contextlib.aclosing(run.flow.stream(freq)) as chunks:
        async for chunk in chunks:
            before = output.num_tokens
            text = output.add_all(chunk.token_ids)
            accepted = output.token_ids[before:]
            if chunk.finish_reason is not None and not output.finished:
                text += output.finish(chunk.finish_reason)
            if output.finished and not timeline.done:
                # Finished here (stop string, max_tokens) before the worker said so; closing
                # the flow after this releases the worker's copy without a failure record.
                progress.finished(timeline, f"router: {output.finish_reason}")
            logprobs = (chunk.logprobs or [])[: len(accepted)]
            delta = result.add_text(text)
            result.logprobs.extend(logprobs)
            if chunk.prompt_logprobs is not None and result.prompt_logprobs is None:
                result.prompt_logprobs = chunk.prompt_logprobs
            if chunk.num_cached_tokens is not None and result.num_cached_tokens is None:
                result.num_cached_tokens = chunk.num_cached_tokens
            offsets = output.text_offsets[before:]
            yield Piece(result.index, delta.content, result.finish_reason, accepted, logprobs,
                        offsets, delta.calls)  # fmt: skip
            if output.finished:
                return
    raise RouterError(f"request {freq.request_id}: the flow ended without finishing")


async def pieces(runs: Sequence[ChoiceRun]) -> AsyncGenerator[Piece, None]:
    """Every sample's pieces, merged in arrival order (one sample: its own, directly)."""
    if len(runs) == 1:
        async with contextlib.aclosing(_choice_pieces(runs[0])) as only:
            async for piece in only:
                yield piece
        return
    queue: asyncio.Queue[tuple[Piece | None, BaseException | None]] = asyncio.Queue()

    async def pump(run: ChoiceRun) -> None:
        try:
            async with contextlib.aclosing(_choice_pieces(run)) as own:
                async for piece in own:
                    await queue.put((piece, None))
            await queue.put((None, None))
        except Exception as exc:
            await queue.put((None, exc))

    tasks = [asyncio.create_task(pump(run), name=run.request.request_id) for run in runs]
    try:
        remaining = len(tasks)
        while remaining:
            item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is None:
                remaining -= 1
                continue
            yield item
    finally:
        # A failure, the client leaving or the timeout: stop the others; each closes its flow
        # (releasing its workers) as it is cancelled.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def returned(job: Job, runs: Sequence[ChoiceRun]) -> list[ChoiceResult]:
    """The choices the response carries, in index order (best_of: the n best per prompt)."""
    results = [run.result for run in runs]
    if job.best_of == job.n:
        return sorted(results, key=lambda c: c.index)
    chosen = []
    for i in range(len(job.prompts)):
        samples = results[i * job.best_of : (i + 1) * job.best_of]
        best = sorted(samples, key=lambda c: -c.total_logprob)[: job.n]
        for rank, c in enumerate(best):
            c.index = i * job.n + rank
            chosen.append(c)
    return chosen
