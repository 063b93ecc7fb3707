"""The offline Python API as a user calls it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from pdserve.errors import ConfigError, PromptTooLong, SamplingParamsError


@pytest.fixture(scope="module")
def llm(tiny_model_path: Path) -> LLM:
    return LLM(str(tiny_model_path))


def test_generate_text_and_token_prompts_in_order(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    text_out = llm.generate(["Hello world", "The cat"], params)
    ids = llm.tokenizer.encode("The cat")
    token_out = llm.generate([ids], params)
    assert [len(o.token_ids) for o in text_out] == [6, 6]
    assert token_out[0].token_ids == text_out[1].token_ids
    assert text_out[1].text == llm.tokenizer.decode(text_out[1].token_ids)
    assert all(o.finish_reason == "length" for o in text_out)


def test_per_prompt_params_and_seeded_replay(llm: LLM) -> None:
    a = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    b = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first = llm.generate(["x y z", "x y z"], [a, b])
    again = llm.generate(["x y z"], a)
    assert len(first[1].token_ids) == 3
    assert again[0].token_ids == first[0].token_ids


def test_bad_calls_are_refused_and_leave_nothing_queued(llm: LLM) -> None:
    with pytest.raises(ConfigError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])
    with pytest.raises(PromptTooLong):
        llm.generate(["fine", [5] * 5000], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ConfigError, match="not_an_option"):
        LLM(not_an_option=1)


def test_stop_strings_cut_the_text_and_stop_the_engine(llm: LLM) -> None:
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    whole = llm.generate(["The cat sat"], free)[0]
    stop = whole.text[len(whole.text) // 2 :][:2]
    assert stop.strip(), whole.text
    out = llm.generate(["The cat sat"], SamplingParams(**{**_fields(free), "stop": (stop,)}))[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text and whole.text.startswith(out.text)
    # The token that completed the stop string is the last one counted; nothing after it.
    n = len(out.token_ids)
    assert out.token_ids == whole.token_ids[:n] and n < 16
    assert stop in llm.tokenizer.decode(out.token_ids) and stop not in llm.tokenizer.decode(
        out.token_ids[:-1]
    )
    assert not llm.engine.has_unfinished()
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks


def test_min_tokens_delays_stop_strings(llm: LLM) -> None:
    free = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    tokens = llm.generate(["a b c d"], free)[0].token_ids
    text = llm.tokenizer.decode(tokens)
    stop = text[len(llm.tokenizer.decode(tokens[:3])) :][:1]
    assert stop
    stopped = {**_fields(free), "stop": (stop,)}
    early = llm.generate(["a b c d"], SamplingParams(**stopped))[0].token_ids
    later = llm.generate(["a b c d"], SamplingParams(**{**stopped, "min_tokens": 10}))[0].token_ids
    assert len(early) <= 4 < 10 < len(later)


def _fields(p: SamplingParams) -> dict[str, object]:
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
