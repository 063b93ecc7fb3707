"""Per-request sampling parameters, validated at construction.

Field names, defaults and ranges follow vLLM's `SamplingParams` (and the OpenAI API where it
has the field) so that users moving from vLLM or the OpenAI API find what they expect;
`temperature == 0` means greedy. What each parameter does to the logits, and in which order,
is `engine.logits_processing`; the worker protocol's models carry it as it is (pydantic validates the dataclass).
Checks that need the vocabulary (token ids in `logit_bias`) happen when the engine admits
the request.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from pydantic import ConfigDict

from pdserve.errors import SamplingParamsError

# Most top logprobs a request may ask for per token (vLLM's default `max_logprobs`, and the
# OpenAI API's limit for chat `top_logprobs`).
MAX_LOGPROBS = 20
# OpenAI's range for one logit_bias value.
MAX_LOGIT_BIAS = 100.0
# Seeds are unsigned 64-bit integers (`sampler.draw_key` packs them into 8 bytes).
MAX_SEED = 1 << 64
# As the worker protocol's models: unknown fields, NaN and infinities refused (a 400 naming them).
_WIRE = ConfigDict(extra="forbid", allow_inf_nan=False)


class GrammarKind(enum.Enum):
    """What a structured-output spec is written in (`engine.grammar` compiles each)."""

    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    # A JSON list of the only strings allowed as the whole output.
    CHOICE = "choice"
    # A Lark or GBNF/EBNF grammar (vLLM's `guided_grammar`).
    GRAMMAR = "grammar"


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on the whole output: every token must keep it a valid prefix."""

    __pydantic_config__ = _WIRE

    kind: GrammarKind
    # The schema as JSON text, the regex, the JSON list of choices, or the grammar text.
    source: str


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Everything that shapes a token is here and travels as it is in the worker protocol, so a
    prefill worker, the decode worker that continues after the KV handoff and any worker a
    migration lands on sample alike."""

    __pydantic_config__ = _WIRE

    max_tokens: int = 16
    # 0 is greedy; otherwise logits are divided by it before sampling.
    temperature: float = 1.0
    # Keep the k most likely tokens; 0 or -1 keeps all.
    top_k: int = 0
    # Keep the smallest set of tokens whose probability reaches top_p.
    top_p: float = 1.0
    # Drop tokens whose probability is below min_p times the most likely token's.
    min_p: float = 0.0
    # Seeds the per-token randomness; None lets the engine pick one (and report it).
    seed: int | None = None
    # The output ends before the first of these its text contains (applied by whoever
    # detokenizes: the router, `LLM`; the engine checks no stop string).
    stop: tuple[str, ...] = field(default_factory=tuple)
    # Generation stops after sampling any of these token ids (EOS is added by the engine).
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Do not stop at the model's EOS token.
    ignore_eos: bool = False
    # Until this many tokens exist, EOS and stop_token_ids cannot be sampled and stop strings
    # do not end the output.
    min_tokens: int = 0
    # Penalties, as vLLM defines them (see `logits_processing`): presence and frequency count
    # output tokens, repetition counts prompt and output tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs added to that token's logit before sampling.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # Return the sampled token's logprob and this many top alternatives per output token
    # (0: the sampled token's only); None: no logprobs.
    logprobs: int | None = None
    # vLLM's `logprob_token_ids`: with `logprobs`, each output token's alternatives are these
    # tokens (after the sampled one) instead of the most likely ones.
    logprob_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # The same for every prompt token after the first (the prefix cache is bypassed, since
    # cached positions have no logits).
    prompt_logprobs: int | None = None
    # Structured output: the output must match this.
    grammar: GrammarSpec | None = None

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
        if not (0.0 <= self.min_p <= 1.0):
            raise SamplingParamsError(f"min_p: must be in [0, 1], got {self.min_p!r}")
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
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError(
                f"stop_token_ids: must be non-negative token ids, got {list(self.stop_token_ids)}"
            )
        self._check_penalties()
        self._check_logprobs()

    def _check_penalties(self) -> None:
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens: must be an integer in [0, max_tokens={self.max_tokens}],"
                f" got {self.min_tokens!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise SamplingParamsError(f"{name}: must be in [-2, 2], got {value!r}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise SamplingParamsError(
                f"repetition_penalty: must be a finite number > 0, got {self.repetition_penalty!r}"
            )
        object.__setattr__(
            self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias)
        )
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
                raise SamplingParamsError(
                    f"logit_bias: token {token_id} -> {bias}: token ids must be >= 0 and biases"
                    f" in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                )

    def _check_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise SamplingParamsError(
                    f"{name}: must be an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        ids = self.logprob_token_ids
        if ids and self.logprobs is None:
            raise SamplingParamsError("logprob_token_ids: needs logprobs")
        if len(ids) > MAX_LOGPROBS or any(t < 0 for t in ids):
            raise SamplingParamsError(
                f"logprob_token_ids: at most {MAX_LOGPROBS} token ids, each >= 0; got {list(ids)}"
            )

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax and needs no randomness."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any penalty changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
