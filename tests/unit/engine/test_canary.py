"""The KV canary (invariant 8): received KV checked by value, between two real engines.

A prefill engine computes a prompt's KV and its value digest; its blocks' bytes are copied
into a decode engine's remote allocation, as a verified transfer would land them. The decode
engine's recomputation must match exactly when everything is right, and must not match when
the blocks are mapped wrongly (a shifted table), when the decode side runs a model that differs
in a way the fingerprint was made to miss (RoPE theta, int8 weights), or when the source KV was
damaged before its checksum was taken. Checksums would pass in every one of those cases.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.engine.canary import CanaryMatch, ValueDigest, compare
from pdserve.engine.engine import Engine
from pdserve.errors import ProtocolError
from pdserve.model.loader import LoadedModel, load_model
from pdserve.protocol.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_path: Path) -> LoadedModel:
    return load_model(str(tiny_model_path))


def engine(model: LoadedModel) -> Engine:
    config = EngineConfig(model=ModelLoadConfig(path=str(model.path)), num_blocks=64)
    return Engine(model, config)


def prompt(n: int, seed: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def prefilled(eng: Engine, tokens: list[int]) -> tuple[ValueDigest, list[memoryview]]:
    """Prefill with held KV: (the value digest, the held blocks as bytes)."""
    eng.add_request("p", tokens, GREEDY, hold_kv=True)
    while eng.has_unfinished():
        eng.step()
    position, logits = eng.canary_logits("p")
    return ValueDigest.of_logits(logits, position), eng.kv_block_views("p")


def received(eng: Engine, tokens: list[int], blocks: list[memoryview], order: list[int]) -> None:
    """Allocate a remote request and land `blocks` in it in the given order."""
    eng.add_remote_request("d", tokens, GREEDY)
    views = eng.kv_block_views("d")
    for dst, src in zip(views, [blocks[i] for i in order], strict=False):
        dst[:] = src


def check(eng: Engine, digest: ValueDigest, dtype: str = "float32") -> CanaryMatch:
    position, logits = eng.canary_logits("d")
    return compare(digest, logits, position, dtype).match


def test_the_same_kv_in_another_engine_matches_exactly(model: LoadedModel) -> None:
    tokens = prompt(70)  # 5 blocks, the last one partly filled
    digest, blocks = prefilled(engine(model), tokens)
    decode = engine(model)
    received(decode, tokens, blocks, list(range(len(blocks))))
    assert check(decode, digest) is CanaryMatch.EXACT
    # The canary never writes into the request's blocks (a shared prefix must not change).
    before = [bytes(v) for v in decode.kv_block_views("d")]
    decode.canary_logits("d")
    assert [bytes(v) for v in decode.kv_block_views("d")] == before


def test_blocks_mapped_one_place_off_do_not_match(model: LoadedModel) -> None:
    tokens = prompt(70)
    digest, blocks = prefilled(engine(model), tokens)
    decode = engine(model)
    received(decode, tokens, blocks, [1, 2, 3, 4, 0])  # a stale / shifted block table
    assert check(decode, digest) is CanaryMatch.MISMATCH


def test_kv_damaged_before_its_checksum_does_not_match(model: LoadedModel) -> None:
    tokens = prompt(70)
    digest, blocks = prefilled(engine(model), tokens)
    view = blocks[1]
    view[203] ^= 0x40  # the top exponent bit of one float32 (little-endian byte 3 of 4)
    decode = engine(model)
    received(decode, tokens, blocks, list(range(len(blocks))))
    assert check(decode, digest) is CanaryMatch.MISMATCH


def _variant(src: Path, dst: Path, **config: object) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    data.update(config)
    (dst / "config.json").write_text(json.dumps(data))
    return dst


def test_a_rope_difference_the_fingerprint_missed_does_not_match(
    model: LoadedModel, tmp_path: Path
) -> None:
    tokens = prompt(70)
    digest, blocks = prefilled(engine(model), tokens)
    other = load_model(str(_variant(Path(model.path), tmp_path / "rope", rope_theta=500000.0)))
    decode = engine(other)
    received(decode, tokens, blocks, list(range(len(blocks))))
    assert check(decode, digest) is CanaryMatch.MISMATCH


def test_int8_weights_the_fingerprint_missed_do_not_match(model: LoadedModel) -> None:
    tokens = prompt(70)
    digest, blocks = prefilled(engine(model), tokens)
    quantized = load_model(str(model.path), quantization="int8")
    decode = engine(quantized)
    received(decode, tokens, blocks, list(range(len(blocks))))
    assert check(decode, digest) is CanaryMatch.MISMATCH


def test_a_prefix_the_decode_side_computed_itself_matches_within_tolerance(
    model: LoadedModel,
) -> None:
    # The decode engine has the first 3 blocks from its own earlier prefill (another chunking,
    # so possibly other low bits); the rest arrives. Harmless differences: a match.
    tokens = prompt(70)
    prefill = engine(model)
    digest, blocks = prefilled(prefill, tokens)
    decode = Engine(
        model,
        EngineConfig(
            model=ModelLoadConfig(path=str(model.path)), num_blocks=64, max_num_batched_tokens=7
        ),
    )
    decode.add_request("warm", tokens[:48], GREEDY)
    while decode.has_unfinished():
        decode.step()
    cached = decode.add_remote_request("d", tokens, GREEDY)
    assert cached == 48
    views = decode.kv_block_views("d")
    for i in range(3, len(blocks)):
        views[i][:] = blocks[i]
    position, logits = decode.canary_logits("d")
    assert compare(digest, logits, position, "float32").match is not CanaryMatch.MISMATCH


def test_digest_round_trips_and_bad_bytes_are_refused() -> None:
    logits = torch.linspace(-3, 5, 2048)
    digest = ValueDigest.of_logits(logits, 41)
    assert ValueDigest.decode(digest.encode()) == digest
    assert digest.top_ids[0] == 2047 and len(digest.top_ids) == 8
    raw = digest.encode()
    for bad in (b"", raw[:-1], raw + b"\0", bytes([9]) + raw[1:]):
        with pytest.raises(ProtocolError):
            ValueDigest.decode(bad)
    # Wrong position, and a logit moved past the tolerance, are mismatches with a reason.
    assert compare(digest, logits, 40, "float32").match is CanaryMatch.MISMATCH
    moved = logits.clone()
    moved[2047] += 0.5
    verdict = compare(digest, moved, 41, "float32")
    assert verdict.match is CanaryMatch.MISMATCH and "token 2047" in verdict.detail
    nudged = logits.clone()
    nudged[2047] += 1e-5
    assert compare(digest, nudged, 41, "float32").match is CanaryMatch.TOLERANCE
    louder = logits.clone()
    louder[7] = 10.0  # a token outside the sender's top-k now wins
    assert compare(digest, louder, 41, "float32").match is CanaryMatch.MISMATCH
