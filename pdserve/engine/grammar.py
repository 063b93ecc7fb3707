"""Structured output: compile a `GrammarSpec` with llguidance and follow it token by token.

llguidance (one of vLLM's structured-output backends) is the optional extra
`pdserve[grammar]`: it is imported only when a request asks for structured output, and its
absence is `GrammarUnavailable`, which the API turns into a 400 naming the extra.

State and resumption: a `GrammarState` is the matcher of one request. It only ever moves by
`accept(token)`, so its state is a pure function of the output tokens so far. Whoever
rebuilds a request elsewhere (the decode worker after a KV handoff: the prefill's first token;
a migration or local prefill: every token the client already has) replays those tokens
through a fresh matcher (`GrammarCompiler.state(spec, tokens)`) and is exactly where the
original was: a request moved mid-JSON continues the same JSON.

The allowed-token mask covers the model's vocabulary; ids the tokenizer does not know (a
padded embedding matrix) are never allowed. Pure: no I/O; used on the engine thread, and by
the router to check a spec once at the API boundary, so it needs no torch.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from pdserve.errors import GrammarError, GrammarUnavailable
from pdserve.protocol.sampling import GrammarKind, GrammarSpec

EXTRA = "pdserve[grammar]"
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def _llguidance() -> ModuleType:
    try:
        return importlib.import_module("llguidance")
    except ImportError as exc:
        raise GrammarUnavailable(
            f"structured output needs the grammar library: pip install '{EXTRA}' ({exc})"
        ) from None


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for `spec`; GrammarError naming what is malformed."""
    llg = _llguidance()
    try:
        if spec.kind is GrammarKind.JSON_SCHEMA:
            schema = json.loads(spec.source)
            if not isinstance(schema, dict):
                raise GrammarError(f"json schema: must be a JSON object, got {spec.source[:80]}")
            # Compact JSON (vLLM's `disable_any_whitespace`): no free whitespace between
            # tokens, which a weak model could otherwise emit until max_tokens.
            return str(llg.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT_JSON))
        if spec.kind is GrammarKind.CHOICE:
            choices = json.loads(spec.source)
            if (
                not isinstance(choices, list)
                or not choices
                or not all(isinstance(c, str) for c in choices)
            ):
                raise GrammarError("choice: must be a non-empty list of strings")
            return str(llg.grammar_from("choice", json.dumps(choices)))
        if spec.kind is GrammarKind.REGEX:
            return str(llg.LLMatcher.grammar_from_regex(spec.source))
        return str(llg.grammar_from("grammar", spec.source))
    except GrammarError:
        raise
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"{spec.kind.value}: {exc}") from None


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size

    def bitmask(self) -> bytes:
        """The tokens that keep the output a valid prefix: bit `i % 32` of little-endian
        int32 word `i // 32` is token `i` (`logits_processing.allowed_mask` reads it)."""
        return bytes(self._matcher.compute_bitmask())

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (the mask's length)."""
        return self._vocab_size

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`; GrammarError if the grammar does not allow it."""
        if not self._matcher.consume_token(token_id):
            raise GrammarError(
                f"token {token_id} is not allowed by the grammar here: "
                f"{self._matcher.get_error() or 'rejected'}"
            )

    @property
    def finished(self) -> bool:
        """True once the grammar is complete and nothing more may follow."""
        return bool(self._matcher.is_stopped())


class GrammarCompiler:
    """Builds matchers for one tokenizer (the library's tokenizer is built once, lazily)."""

    def __init__(
        self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        # Called on the first grammar request only: serializing a large tokenizer costs time
        # that engines and routers without structured output need not spend.
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: Any = None

    def _ll_tokenizer(self) -> Any:
        if self._tokenizer is None:
            llg = _llguidance()
            self._tokenizer = llg.LLTokenizer(
                self._tokenizer_json(), n_vocab=self._vocab_size, eos_token=self._eos or None
            )
        return self._tokenizer

    def check(self, spec: GrammarSpec) -> None:
        """Compile `spec` once; GrammarError naming the problem if it does not compile."""
        self.state(spec)

    def state(self, spec: GrammarSpec, token_ids: Sequence[int] = ()) -> GrammarState:
        """A matcher at the start of `spec`, advanced past `token_ids` (a resumed request)."""
        llg = _llguidance()
        text = grammar_text(spec)
        matcher = llg.LLMatcher(self._ll_tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{spec.kind.value}: {matcher.get_error()}")
        state = GrammarState(matcher, self._vocab_size)
        for token_id in token_ids:
            state.accept(token_id)
        return state
