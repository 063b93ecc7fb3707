"""Stop strings across chunk borders: streamed text equals the whole-text truncation."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling import SamplingParams
from pdserve.text.output import OutputStream
from pdserve.text.stop import StopMatcher, first_stop, held_suffix_len, truncate_at_stop

TEXT = st.text(alphabet="ab c\n", max_size=12)
STOPS = st.lists(st.text(alphabet="ab c\n", min_size=1, max_size=4), max_size=3)


def stream(pieces: list[str], stop: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stop)
    out = "".join(matcher.feed(p) for p in pieces)
    return out + matcher.flush(), matcher.stopped


@given(st.lists(TEXT, max_size=8), STOPS)
def test_streamed_text_equals_truncation(pieces: list[str], stop: list[str]) -> None:
    out, stopped = stream(pieces, stop)
    full = "".join(pieces)
    assert out == truncate_at_stop(full, stop)
    assert stopped == (truncate_at_stop(full, stop) != full or any(s in full for s in stop))


def test_examples() -> None:
    assert stream(["hel", "lo wo", "rld"], ["o w"]) == ("hell", True)
    assert stream(["ab", "c"], ["abcd"]) == ("abc", False)  # held "abc" released at the end
    # The first stop string to complete wins, not the first to start.
    assert truncate_at_stop("abcd", ["abcd", "bc"]) == "a"
    assert first_stop("xxbcab", ["ab", "bc"]) == 2
    assert held_suffix_len("xyab", ["abc", "b!"]) == 2
    matcher = StopMatcher(["END"])
    assert matcher.feed("tokE") == "tok"  # "E" may start "END": held back
    assert matcher.feed("N") == ""
    assert matcher.feed("Dmore") == ""
    assert matcher.stopped and matcher.flush() == ""


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Tokenizer:
    return Tokenizer(tiny_model_path)


def test_token_stream_with_real_detokenizer(tokenizer: Tokenizer) -> None:
    @settings(max_examples=60, deadline=None)
    @given(
        st.lists(st.integers(0, tokenizer.vocab_size - 1), min_size=1, max_size=24),
        st.lists(st.text(alphabet="etaoin shr", min_size=1, max_size=3), max_size=3),
    )
    def check(token_ids: list[int], stop: list[str]) -> None:
        sampling = SamplingParams(max_tokens=len(token_ids), stop=stop)
        output = OutputStream(tokenizer, sampling, eos_token_ids=())
        text = ""
        for i, token_id in enumerate(token_ids):
            text += output.add(token_id)
            if output.finished:
                assert output.num_tokens == i + 1
                break
        full = tokenizer.decode(token_ids)
        assert text == truncate_at_stop(full, stop)
        assert output.finish_reason == ("stop" if any(s in full for s in stop) else "length")

    check()


def test_eos_and_stop_token_ids_end_without_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello there", add_special_tokens=False)
    output = OutputStream(tokenizer, SamplingParams(max_tokens=10, stop_token_ids=[7]), (3,))
    text = output.add_all([*ids, 3, *ids])
    assert text == tokenizer.decode(ids)
    assert output.finish_reason == "stop" and output.num_tokens == len(ids) + 1
