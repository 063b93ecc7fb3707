"""OutputStream and StopMatcher extensions: include_stop_str_in_output, min_tokens against
stop strings and stop tokens, skip_special_tokens, text offsets, echo-only. Pure."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling import SamplingParams
from pdserve.text.output import OutputStream
from pdserve.text.stop import StopMatcher, first_stop_span

TEXT = st.text(alphabet="ab c", max_size=6)
STOPS = st.lists(st.text(alphabet="ab c", min_size=1, max_size=3), min_size=1, max_size=3)


def reference(pieces: list[str], stop: list[str], min_pieces: int, include: bool) -> str:
    """Whole-text semantics: the first-completing stop string that ends after the text of
    the first `min_pieces` pieces; cut before it (or after it, with include)."""
    full = "".join(pieces)
    floor = len("".join(pieces[:min_pieces]))
    span = first_stop_span(full, stop, floor)
    if span is None:
        return full
    return full[: span[1] if include else span[0]]


@given(st.lists(TEXT, max_size=8), STOPS, st.integers(0, 4), st.booleans())
def test_streamed_stops_equal_the_whole_text_rule(
    pieces: list[str], stop: list[str], min_pieces: int, include: bool
) -> None:
    matcher = StopMatcher(stop, include)
    out = "".join(matcher.feed(p, can_stop=i >= min_pieces) for i, p in enumerate(pieces))
    out += matcher.flush()
    assert out == reference(pieces, stop, min_pieces, include)


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path) -> Tokenizer:
    return Tokenizer(tiny_model_path)


def stream(tok: Tokenizer, ids: list[int], **kw: object) -> tuple[str, OutputStream]:
    options = {k: kw.pop(k) for k in ("skip_special_tokens", "include_stop_str_in_output",
                                      "max_tokens") if k in kw}  # fmt: skip
    out = OutputStream(tok, SamplingParams(**kw), tok.eos_token_ids, **options)  # type: ignore[arg-type]
    text = out.add_all(ids)
    if not out.finished:
        text += out.finish("length")
    return text, out


def test_include_stop_str_and_offsets(tok: Tokenizer) -> None:
    ids = tok.encode("the cat sat on the mat", add_special_tokens=False)
    plain, _ = stream(tok, ids, max_tokens=50, stop=["sat"])
    kept, out = stream(tok, ids, max_tokens=50, stop=["sat"], include_stop_str_in_output=True)
    assert plain == "the cat " and kept == "the cat sat"
    assert out.finish_reason == "stop"
    whole, out = stream(tok, ids, max_tokens=50)
    # Each token's text starts where the text of the tokens before it ends (ASCII text).
    assert out.text_offsets == [len(tok.decode(ids[:i])) for i in range(len(ids))]
    assert whole == tok.decode(ids)


def test_min_tokens_holds_stop_tokens_and_strings(tok: Tokenizer) -> None:
    eos = tok.eos_token_ids[0]
    ids = tok.encode("a b", add_special_tokens=False)
    _, out = stream(tok, [*ids, eos, *ids], max_tokens=50, min_tokens=len(ids) + 2)
    assert out.num_tokens == 2 * len(ids) + 1  # EOS before min_tokens did not stop it
    text, _ = stream(tok, tok.encode("x y x y", add_special_tokens=False), max_tokens=50,
                     stop=["x"], min_tokens=2)  # fmt: skip
    assert text.startswith("x y ") and text.count("x") == 1


def test_skip_special_tokens_off_shows_them(tok: Tokenizer) -> None:
    eos = tok.eos_token_ids[0]
    ids = [*tok.encode("hi", add_special_tokens=False), eos]
    shown, _ = stream(tok, ids, max_tokens=50, ignore_eos=True, skip_special_tokens=False)
    hidden, _ = stream(tok, ids, max_tokens=50, ignore_eos=True)
    assert shown == hidden + tok.decode([eos], skip_special_tokens=False) != hidden


def test_echo_only_takes_no_token(tok: Tokenizer) -> None:
    out = OutputStream(tok, SamplingParams(max_tokens=1), tok.eos_token_ids, max_tokens=0)
    text = out.add_all([5, 6])
    assert (text, out.num_tokens, out.finish_reason) == ("", 0, "length")
