"""Where a decode step's time goes: wall-clock timers around the engine's parts, for a benchmark.

`measure_decode_breakdown(engine, prompts, num_steps)` admits the prompts, steps until every one
has its first token (prefill is not what is measured), then times `num_steps` decode steps with
timers patched around the functions each part runs in, and removes them after:

    model        LlamaModel.forward minus attention (projections, MLP, norms, RoPE, KV writes)
    attention    paged_attention minus its gathers (the SDPA calls and scatter of outputs)
    gathers      _gather: index_select of the K/V blocks each sequence reads
    logits       LlamaModel.compute_logits (final norm and the vocabulary projection)
    sampler      the batched argmax of plain greedy rows, sample_row per other sampling
                 request (and logprobs, when asked)
    python       the rest of Engine.step: scheduling, metadata, input tensors, bookkeeping

The timers cost a few perf_counter calls per layer; the throughput figures are measured without
them, in separate runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from pdserve.engine import model_runner
from pdserve.engine.engine import Engine
from pdserve.model import attention, llama
from pdserve.protocol.sampling import SamplingParams

PARTS = ("model", "attention", "gathers", "logits", "sampler", "python")


class _Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        return timed


@contextlib.contextmanager
def _patched(timers: _Timers) -> Iterator[None]:
    # (owner, attribute, timer name): each function is looked up through the owner at call time.
    targets = [
        (llama.LlamaModel, "forward", "forward"),
        (llama.LlamaModel, "compute_logits", "logits"),
        (llama, "paged_attention", "attention"),
        (attention, "_gather", "gathers"),
        (model_runner, "greedy_tokens", "sampler"),
        (model_runner, "sample_row", "sampler"),
        (model_runner, "token_logprobs", "sampler"),
    ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in targets]
    try:
        for owner, attr, name in targets:
            setattr(owner, attr, timers.wrap(name, getattr(owner, attr)))
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def measure_decode_breakdown(
    engine: Engine, prompts: list[list[int]], num_steps: int, tag: str = "breakdown"
) -> dict[str, float]:
    """Mean milliseconds per decode step for each of PARTS (and `step`, their sum), at a batch
    of len(prompts); the requests are finished (aborted) afterwards."""
    # Room for the prefill's steps too: a request whose prompt finished early decodes while
    # the others' chunks compute, and none may finish before the timed steps end.
    longest = max(len(p) for p in prompts)
    room = engine.max_model_len - longest
    params = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
    if room <= num_steps + len(prompts):
        raise ValueError(f"breakdown: prompts of {longest} tokens leave no room to decode")
    requests = [engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    while any(not r.output_token_ids for r in requests):
        engine.step()
    timers = _Timers()
    step = 0.0
    with _patched(timers):
        for _ in range(num_steps):
            start = time.perf_counter()
            engine.step()
            step += time.perf_counter() - start
    for r in requests:
        if not r.status.finished:
            engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    s = timers.seconds
    forward, attn, gathers = s.get("forward", 0.0), s.get("attention", 0.0), s.get("gathers", 0.0)
    parts = {
        "model": forward - attn,
        "attention": attn - gathers,
        "gathers": gathers,
        "logits": s.get("logits", 0.0),
        "sampler": s.get("sampler", 0.0),
    }
    parts["python"] = step - sum(parts.values())
    parts["step"] = step
    return {k: v / num_steps * 1e3 for k, v in parts.items()}
