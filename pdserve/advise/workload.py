"""The workload `pdserve advise` measures: the user's length distributions, or a JSONL trace.
Pure: parsing, validation and seeded generation; no I/O beyond the text handed in.

Two sources, one shape of request:
- **synthetic**: `--prompt-tokens A-B` and `--output-tokens A-B` (or a single number),
  lengths drawn uniformly in each range (`serve_stats.WorkloadShape`);
- **trace**: a JSONL file, one request per line, `{"prompt_tokens": N, "output_tokens": M}`
  (blank lines and lines starting with `#` are skipped); at every rate each request's lengths
  are drawn from the trace's lines (with replacement), so the length distribution is the
  trace's own. Any other line (not JSON, not an object, a missing, unknown or out-of-range
  field, prompt + output over the model's context) is refused with its line number.

Arrivals are Poisson at each rate (`serve_stats.poisson_arrivals`), prompts are random ids from
`serve_stats.VOCAB`, every request greedy with ignore_eos (it gets exactly its output tokens).
`respell` gives each arm of a comparison different prompt ids with the same lengths and
arrivals: arms share one cluster, and identical prompts would hit the prefix cache of the arm
that ran second.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.advise.goodput_stats import (
    VOCAB,
    RequestSpec,
    WorkloadShape,
    build_workload,
    poisson_arrivals,
)
from pdserve.errors import ConfigError

# A trace beyond this is a mistake (the run would never end), refused before anything starts.
MAX_TRACE_LINES = 1_000_000


def parse_range(flag: str, text: str, high: int) -> tuple[int, int]:
    """ "A-B" or "A" as (A, B) with 1 <= A <= B <= high; ConfigError naming the flag."""
    want = f"expected N or MIN-MAX with 1 <= MIN <= MAX <= {high}"
    parts = text.split("-")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"{flag}: {want}, got {text!r}") from None
    if len(values) not in (1, 2):
        raise ConfigError(f"{flag}: {want}, got {text!r}")
    low, top = values[0], values[-1]
    if not 1 <= low <= top <= high:
        raise ConfigError(f"{flag}: {want}, got {text!r}")
    return low, top


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One line of a trace."""

    num_prompt_tokens: int
    num_output_tokens: int


_FIELDS = ("prompt_tokens", "output_tokens")


def parse_trace(text: str, max_model_len: int, source: str = "--workload") -> list[TraceRequest]:
    """Every request of a JSONL trace; ConfigError naming `source` and the first bad line."""
    requests: list[TraceRequest] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source} line {lineno}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: expected an object with {', '.join(_FIELDS)}")
        unknown = sorted(set(item) - set(_FIELDS))
        if unknown:
            raise ConfigError(
                f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(_FIELDS)})"
            )
        values = []
        for name in _FIELDS:
            value = item.get(name)
            if value is None:
                raise ConfigError(f"{where}: missing {name}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: {name} must be an integer >= 1, got {value!r}")
            values.append(value)
        prompt, output = values
        if prompt + output > max_model_len:
            raise ConfigError(
                f"{where}: prompt_tokens {prompt} + output_tokens {output} exceed the model's"
                f" context of {max_model_len} tokens"
            )
        requests.append(TraceRequest(prompt, output))
        if len(requests) > MAX_TRACE_LINES:
            raise ConfigError(f"{source}: more than {MAX_TRACE_LINES} requests")
    if not requests:
        raise ConfigError(f"{source}: no request in the file")
    return requests


@dataclass(frozen=True, slots=True)
class AdviseWorkload:
    """Where request lengths come from: a synthetic shape, or a trace (exactly one)."""

    shape: WorkloadShape | None = None
    trace: tuple[TraceRequest, ...] = ()

    def __post_init__(self) -> None:
        if (self.shape is None) == (not self.trace):
            raise ConfigError("workload: give a synthetic shape or a trace, exactly one")

    def describe(self) -> dict[str, object]:
        """The workload as the report shows it."""
        if self.shape is not None:
            s = self.shape
            return {
                "source": "synthetic",
                "prompt_tokens": [s.min_prompt_tokens, s.max_prompt_tokens],
                "output_tokens": [s.min_output_tokens, s.max_output_tokens],
            }
        prompts = [r.num_prompt_tokens for r in self.trace]
        outputs = [r.num_output_tokens for r in self.trace]
        return {
            "source": "trace",
            "num_lines": len(self.trace),
            "prompt_tokens": [min(prompts), max(prompts)],
            "output_tokens": [min(outputs), max(outputs)],
            "mean_prompt_tokens": sum(prompts) / len(prompts),
            "mean_output_tokens": sum(outputs) / len(outputs),
        }

    def build(
        self, rate: float, seed: int, num_requests: int | None, duration_s: float | None
    ) -> list[RequestSpec]:
        """The seeded requests of one rate (exactly one of num_requests / duration_s)."""
        if self.shape is not None:
            return build_workload(rate, seed, self.shape, num_requests, duration_s)
        rng = random.Random(seed)
        arrivals = poisson_arrivals(rate, rng, num_requests, duration_s)
        specs = []
        for index, arrival in enumerate(arrivals):
            picked = rng.choice(self.trace)
            prompt = tuple(rng.randrange(*VOCAB) for _ in range(picked.num_prompt_tokens))
            specs.append(RequestSpec(index, arrival, prompt, picked.num_output_tokens))
        return specs


def respell(specs: Sequence[RequestSpec], seed: int) -> list[RequestSpec]:
    """The same requests (arrivals, lengths) with fresh prompt ids drawn from `seed`."""
    rng = random.Random(seed)
    return [
        RequestSpec(
            s.index,
            s.arrival_s,
            tuple(rng.randrange(*VOCAB) for _ in s.prompt_token_ids),
            s.max_tokens,
        )
        for s in specs
    ]
