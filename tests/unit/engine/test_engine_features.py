"""Engine features on the tiny model: logprobs (bitwise across batching, chunking, prefix
caching, resume and the KV-handoff path; equal to transformers' log_softmax), penalties,
min_tokens, logit_bias and structured output, each giving the same tokens when the request is
resumed from its output tokens elsewhere."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from openai_cases import SCHEMA

from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestDelta
from pdserve.errors import GrammarError, SamplingParamsError
from pdserve.model.loader import LoadedModel, load_model
from pdserve.protocol.sampling import GrammarKind, GrammarSpec, SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model_path: Path) -> LoadedModel:
    return load_model(str(tiny_model_path))


def engine(model: LoadedModel, **kw: object) -> Engine:
    kw.setdefault("num_blocks", 96)
    kw.setdefault("batch_invariant", True)  # these tests compare logits bit for bit
    return Engine(model, EngineConfig(model=ModelLoadConfig(path=str(model.path)), **kw))  # type: ignore[arg-type]


def prompt(model: LoadedModel, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, model.config.vocab_size) for _ in range(n)]


def run(
    eng: Engine,
    rid: str,
    ids: list[int],
    params: SamplingParams,
    *,
    outputs: list[int] | None = None,
    others: int = 0,
) -> list[RequestDelta]:
    """Run `rid` to the end (with `others` unrelated requests in the same steps)."""
    eng.add_request(rid, ids, params, output_token_ids=outputs)
    for j in range(others):
        other = SamplingParams(max_tokens=12, temperature=0.7, seed=j, ignore_eos=True)
        eng.add_request(f"{rid}-other{j}", prompt(eng.model, 9 + 13 * j, 100 + j), other)
    deltas: list[RequestDelta] = []
    while eng.has_unfinished():
        deltas += [d for d in eng.step() if d.request_id == rid]
    return deltas


def tokens_and_logprobs(deltas: list[RequestDelta]) -> tuple[list[int], list[object]]:
    tokens = [t for d in deltas for t in d.new_token_ids]
    return tokens, [lp for d in deltas for lp in d.logprobs]


GREEDY_LP = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
SEEDED_LP = SamplingParams(
    max_tokens=24, temperature=0.9, seed=11, ignore_eos=True, logprobs=5, top_p=0.95
)


@pytest.mark.parametrize("params", [GREEDY_LP, SEEDED_LP], ids=["greedy", "seeded"])
def test_logprobs_are_bitwise_equal_however_the_request_ran(
    model: LoadedModel, params: SamplingParams
) -> None:
    ids = prompt(model, 70)
    ref_tokens, ref_lp = tokens_and_logprobs(run(engine(model), "a", ids, params))
    assert len(ref_lp) == len(ref_tokens) == 24
    # Batched with other requests of other lengths.
    assert tokens_and_logprobs(run(engine(model), "b", ids, params, others=3)) == (
        ref_tokens,
        ref_lp,
    )
    # Chunked prefill of 16 tokens per step.
    small = engine(model, max_num_batched_tokens=16)
    assert tokens_and_logprobs(run(small, "c", ids, params)) == (ref_tokens, ref_lp)
    # A prefix-cache hit: the first 64 prompt tokens' KV comes from another request.
    warm = engine(model)
    run(warm, "warm", ids[:64] + prompt(model, 5, 9), GREEDY_LP)
    assert tokens_and_logprobs(run(warm, "d", ids, params)) == (ref_tokens, ref_lp)
    assert warm.stats().prefix_cache_hit_tokens >= 64
    # Resumed after k tokens (a migration): the rest is the same, bit for bit.
    for k in (1, 7, 16):
        tokens, lps = tokens_and_logprobs(
            run(engine(model), f"m{k}", ids, params, outputs=ref_tokens[:k])
        )
        assert (tokens, lps) == (ref_tokens[k:], ref_lp[k:])


def test_remote_kv_path_gives_the_same_logprobs(model: LoadedModel) -> None:
    """Prefill on one engine, KV bytes copied into another's remote allocation, decode there
    (what a disaggregated request does): the same tokens and logprobs as one engine."""
    ids = prompt(model, 40, 3)
    ref_tokens, ref_lp = tokens_and_logprobs(run(engine(model), "ref", ids, SEEDED_LP))
    pre, dec = engine(model), engine(model)
    first = SamplingParams(**{**_fields(SEEDED_LP), "max_tokens": 1})
    pre.add_request("r", ids, first, hold_kv=True)
    (delta,) = pre.step()
    assert delta.new_token_ids[0] == ref_tokens[0] and delta.logprobs[0] == ref_lp[0]
    dec.add_remote_request("r", ids, SEEDED_LP)
    for src, dst in zip(pre.kv_block_views("r"), dec.kv_block_views("r"), strict=False):
        dst[:] = src
    dec.mark_remote_kv_ready("r", delta.new_token_ids[0])
    deltas = []
    while dec.has_unfinished():
        deltas += dec.step()
    assert tokens_and_logprobs(deltas) == (ref_tokens[1:], ref_lp[1:])


def _fields(params: SamplingParams) -> dict[str, object]:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_logprobs_equal_transformers_log_softmax(model: LoadedModel) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(model.path), torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = prompt(model, 30, 5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)  # fmt: skip
    deltas = run(engine(model), "x", ids, params)
    tokens, lps = tokens_and_logprobs(deltas)
    full = ids + tokens
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
    # Output token i is predicted at position len(ids) - 1 + i.
    for i, lp in enumerate(lps):
        expected = ref[len(ids) - 1 + i]
        assert abs(lp.logprob - float(expected[tokens[i]])) <= 1e-4 * abs(
            float(expected[tokens[i]])
        )
        top_ids = [t for t, _ in lp.top]
        assert top_ids == torch.topk(expected, 3).indices.tolist()
    # Prompt logprobs: position p predicts prompt token p + 1.
    prompt_lps = deltas[0].prompt_logprobs
    assert prompt_lps is not None and len(prompt_lps) == len(ids) - 1
    for p, lp in enumerate(prompt_lps):
        expected = float(ref[p][ids[p + 1]])
        assert lp.token_id == ids[p + 1]
        assert abs(lp.logprob - expected) <= 1e-4 * abs(expected)


def test_logprob_token_ids_give_those_tokens_logprobs(model: LoadedModel) -> None:
    """vLLM's `logprob_token_ids`: each output token's alternatives are the sampled token,
    then the named ones (a repeat once), with transformers' log_softmax values."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(model.path), torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = prompt(model, 20, 3)
    wanted = (100, 7, 1000, 100)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=4, ignore_eos=True, logprobs=5,
                            logprob_token_ids=wanted)  # fmt: skip
    tokens, lps = tokens_and_logprobs(run(engine(model), "x", ids, params))
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids + tokens])).logits[0].float(), dim=-1)
    for i, lp in enumerate(lps):
        expected = ref[len(ids) - 1 + i]
        names = [t for t, _ in lp.top]
        assert names == [tokens[i], *(t for t in (100, 7, 1000) if t != tokens[i])]
        for t, value in lp.top:
            assert abs(value - float(expected[t])) <= 1e-4 * max(1.0, abs(float(expected[t])))
    with pytest.raises(SamplingParamsError, match="logprob_token_ids: needs logprobs"):
        SamplingParams(max_tokens=1, logprob_token_ids=(1,))


def _reference_penalties(logits: torch.Tensor, prompt_ids: list[int], out: list[int],
                         rep: float, freq: float, pres: float) -> torch.Tensor:  # fmt: skip
    """vLLM's definition, written per token: repetition on prompt or output tokens, then
    frequency (count in output) and presence (in output at all)."""
    x = logits.clone()
    for t in set(prompt_ids) | set(out):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(out):
        x[t] -= freq * out.count(t) + pres
    return x


def test_penalties_follow_vllm_definition_and_survive_resume(model: LoadedModel) -> None:
    from pdserve.engine.logits_processing import LogitsContext, process

    torch.manual_seed(0)
    logits = torch.randn(50)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3)
    ctx = LogitsContext(params, [1, 2, 3], [3, 4, 4, 9], frozenset())
    expected = _reference_penalties(logits, [1, 2, 3], [3, 4, 4, 9], 1.3, 0.3, 0.5)
    assert torch.allclose(process(logits, ctx), expected, atol=1e-6)
    # In the engine: penalties change the output, and a resume continues it exactly.
    ids = prompt(model, 20, 7)
    plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    penalized = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                               repetition_penalty=1.5, frequency_penalty=1.0,
                               presence_penalty=1.0)  # fmt: skip
    base, _ = tokens_and_logprobs(run(engine(model), "p0", ids, plain))
    ref, _ = tokens_and_logprobs(run(engine(model), "p1", ids, penalized))
    assert ref != base
    for k in (3, 11):
        rest, _ = tokens_and_logprobs(run(engine(model), f"p{k}", ids, penalized, outputs=ref[:k]))
        assert rest == ref[k:]


def test_min_p_min_tokens_and_logit_bias(model: LoadedModel) -> None:
    from pdserve.engine.logits_processing import LogitsContext, process
    from pdserve.engine.sampler import SamplingRow, sample_row

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # min_p 0.4: tokens below 0.4 * 0.5 = 0.2 are dropped (vLLM's apply_min_p).
    seen = {sample_row(logits, SamplingRow(1.0, 0, 1.0, s, 0, 0.4)) for s in range(300)}
    assert seen == {0, 1}
    stops = frozenset({1})
    held = LogitsContext(SamplingParams(min_tokens=2, max_tokens=4), [], [5], stops)
    assert process(torch.zeros(4), held)[1] == float("-inf")
    free = LogitsContext(SamplingParams(min_tokens=2, max_tokens=4), [], [5, 6], stops)
    assert process(torch.zeros(4), free)[1] == 0.0
    biased = LogitsContext(SamplingParams(logit_bias=((3, 100.0),)), [], [], frozenset())
    assert int(torch.argmax(process(logits, biased))) == 3
    # In the engine: EOS is banned until min_tokens, then allowed again.
    eos = model.eos_token_ids[0]
    ids = prompt(model, 10, 2)
    params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=5, logit_bias=((eos, 100.0),))
    tokens, _ = tokens_and_logprobs(run(engine(model), "eos", ids, params))
    assert tokens[:5].count(eos) == 0 and tokens[5] == eos and len(tokens) == 6


def test_structured_output_is_valid_and_survives_resume_mid_json(model: LoadedModel) -> None:
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=5, grammar=spec, logprobs=1)
    ids = prompt(model, 15, 1)
    tokens, lps = tokens_and_logprobs(run(engine(model), "j", ids, params))
    text = model.tokenizer.decode(tokens)
    value = json.loads(text)
    assert set(value) == {"name", "age", "tags"} and value["name"] in ("ada", "bob", "cy")
    # Resumed mid-JSON from any point: the grammar state is rebuilt from the tokens and the
    # output continues identically (valid JSON, equal to the uninterrupted one).
    for k in (1, len(tokens) // 2, len(tokens) - 2):
        rest, rest_lps = tokens_and_logprobs(
            run(engine(model), f"j{k}", ids, params, outputs=tokens[:k])
        )
        assert (rest, rest_lps) == (tokens[k:], lps[k:])
    # Each regex / choice spec holds too.
    for kind, source, check in [
        (GrammarKind.REGEX, r"[0-9]{3}-[a-c]{2}", lambda t: len(t) == 6 and t[3] == "-"),
        (GrammarKind.CHOICE, json.dumps(["yes", "no"]), lambda t: t in ("yes", "no")),
    ]:
        p = SamplingParams(
            max_tokens=20, temperature=1.0, seed=1, grammar=GrammarSpec(kind, source)
        )
        out, _ = tokens_and_logprobs(run(engine(model), kind.value, ids, p))
        assert check(model.tokenizer.decode(out)), model.tokenizer.decode(out)


def test_bad_grammar_and_bad_resume_are_named(model: LoadedModel) -> None:
    eng = engine(model)
    with pytest.raises(GrammarError, match="regex"):
        eng.add_request("bad", [5, 6], SamplingParams(grammar=GrammarSpec(GrammarKind.REGEX, "[")))
    choice = GrammarSpec(GrammarKind.CHOICE, json.dumps(["yes"]))
    not_yes = model.tokenizer.encode("no", add_special_tokens=False)
    with pytest.raises(GrammarError, match="not allowed"):
        eng.add_request("resume", [5, 6], SamplingParams(grammar=choice), output_token_ids=not_yes)
