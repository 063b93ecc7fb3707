"""The request builder and the wire form of sampling under arbitrary input: a client's body is
either a job or an InvalidRequest naming a param (never another exception), and every valid
SamplingParams crosses the wire and comes back equal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.errors import InvalidRequest
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling import GrammarKind, GrammarSpec, SamplingParams
from pdserve.protocol.worker_api import PrefillRequest
from pdserve.router.api.request_builder import BuilderConfig, RequestBuilder

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 3000), st.floats(-5, 5), st.text(max_size=6)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n",
          "best_of", "logprobs", "top_logprobs", "echo", "stop", "seed", "min_p", "min_tokens",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
          "stop_token_ids", "response_format", "guided_json", "guided_regex", "guided_choice",
          "stream", "stream_options", "tools", "suffix", "user", "include_stop_str_in_output",
          "skip_special_tokens", "max_completion_tokens", "unknown"]  # fmt: skip
BODIES = st.fixed_dictionaries(
    {"model": st.just("tiny-v2")},
    optional={f: VALUES for f in FIELDS if f != "model"},
)


@pytest.fixture(scope="module")
def builder(tiny_model_path: Path) -> RequestBuilder:
    config = BuilderConfig(model_names=("tiny-v2",), max_model_len=2048)
    return RequestBuilder(config, Tokenizer(tiny_model_path))


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=BODIES, chat=st.booleans())
def test_any_body_is_a_job_or_a_named_400(
    builder: RequestBuilder, body: dict[str, Any], chat: bool
) -> None:
    try:
        job = builder.chat(body) if chat else builder.completion(body)
    except InvalidRequest as exc:
        assert exc.message
        return
    assert job.prompts and job.sampling.max_tokens >= 1


SPECS = st.one_of(
    st.none(),
    st.builds(GrammarSpec, st.sampled_from(list(GrammarKind)), st.text(max_size=10)),
)


@given(
    st.builds(
        SamplingParams,
        max_tokens=st.integers(20, 100),
        temperature=st.floats(0, 2),
        top_k=st.integers(-1, 50),
        top_p=st.floats(0.01, 1),
        min_p=st.floats(0, 1),
        seed=st.none() | st.integers(0, 2**63 - 1),
        stop=st.lists(st.text(min_size=1, max_size=4), max_size=2).map(tuple),
        stop_token_ids=st.lists(st.integers(0, 2000), max_size=3).map(tuple),
        min_tokens=st.integers(0, 20),
        presence_penalty=st.floats(-2, 2),
        frequency_penalty=st.floats(-2, 2),
        repetition_penalty=st.floats(0.1, 3),
        logit_bias=st.lists(st.tuples(st.integers(0, 2000), st.floats(-100, 100)), max_size=3).map(
            tuple
        ),
        logprobs=st.none() | st.integers(0, 20),
        prompt_logprobs=st.none() | st.integers(0, 20),
        grammar=SPECS,
    )
)
def test_sampling_round_trips_the_wire(params: SamplingParams) -> None:
    wire = PrefillRequest(request_id="r", prompt_token_ids=[1], sampling=params)
    assert PrefillRequest.model_validate_json(wire.model_dump_json()).sampling == params


@pytest.mark.parametrize(
    ("limits", "param"),
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 5000}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"max_tokens": 4, "max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_a_bad_output_limit_is_named_as_the_client_sent_it(
    builder: RequestBuilder, limits: dict[str, int], param: str
) -> None:
    body = {"model": "tiny-v2", "messages": [{"role": "user", "content": "hi"}], **limits}
    with pytest.raises(InvalidRequest) as caught:
        builder.chat(body)
    assert caught.value.param == param
    assert caught.value.message.startswith(f"{param}:"), caught.value.message
