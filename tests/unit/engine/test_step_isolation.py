"""One request's failure in a step ends that request alone: a grammar whose mask or accept
raises (a structured-output library's bug, a token it rejects) finishes its request with the
finish reason "error" and frees its blocks, while the other requests in the same steps go on
to the tokens they produce without it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestDelta
from pdserve.errors import GrammarError
from pdserve.model.loader import LoadedModel, load_model
from pdserve.protocol.sampling import SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model_path: Path) -> LoadedModel:
    return load_model(str(tiny_model_path))


def engine(model: LoadedModel) -> Engine:
    # Batch-invariant: the survivors' tokens must not depend on who shares their steps.
    config = EngineConfig(
        model=ModelLoadConfig(path=str(model.path)), num_blocks=96, batch_invariant=True
    )
    return Engine(model, config)


class BrokenGrammar:
    """Allows every token; raises in `bitmask` or `accept` from the `at`-th token on."""

    def __init__(self, vocab_size: int, where: str, at: int) -> None:
        self.vocab_size, self.where, self.at, self.seen = vocab_size, where, at, 0
        self.finished = False

    def bitmask(self) -> bytes:
        if self.where == "bitmask" and self.seen >= self.at:
            raise RuntimeError("grammar library crashed computing its mask")
        return b"\xff" * (4 * ((self.vocab_size + 31) // 32))

    def accept(self, token_id: int) -> None:
        if self.where == "accept" and self.seen >= self.at:
            raise GrammarError(f"token {token_id} is not allowed by the grammar here")
        self.seen += 1


def prompts(model: LoadedModel) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in (9, 23, 40)]


PARAMS = [
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.9, seed=5, ignore_eos=True, logprobs=2),
]


def run(eng: Engine, broken: tuple[str, int] | None) -> dict[str, list[RequestDelta]]:
    ids = prompts(eng.model)
    for i, p in enumerate(ids[:2]):
        eng.add_request(f"ok-{i}", p, PARAMS[i])
    if broken is not None:
        request = eng.add_request("bad", ids[2], PARAMS[0])
        request.grammar = BrokenGrammar(eng.model.config.vocab_size, *broken)  # type: ignore[assignment]
    deltas: dict[str, list[RequestDelta]] = {}
    while eng.has_unfinished():
        for d in eng.step():
            deltas.setdefault(d.request_id, []).append(d)
    return deltas


@pytest.mark.parametrize("where", ["bitmask", "accept"])
@pytest.mark.parametrize("at", [0, 4])
def test_a_failing_request_ends_alone_and_the_others_are_unchanged(
    model: LoadedModel, where: str, at: int
) -> None:
    reference = run(engine(model), None)
    eng = engine(model)
    free = eng.block_manager.num_free_blocks
    got = run(eng, (where, at))
    bad = got["bad"]
    assert [d.finish_reason for d in bad if d.finished] == ["error"]
    # The tokens it had before the failure were delivered; none after.
    assert sum(len(d.new_token_ids) for d in bad) == at
    for rid in ("ok-0", "ok-1"):
        assert [t for d in got[rid] for t in d.new_token_ids] == [
            t for d in reference[rid] for t in d.new_token_ids
        ]
        assert got[rid][-1].finish_reason == "length"
    assert eng.block_manager.num_free_blocks == free
    assert not eng.has_unfinished()
