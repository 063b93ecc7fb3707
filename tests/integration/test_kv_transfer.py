"""KV moved between two real engines over TCP loopback: a prefill engine holds its KV, the
transfer layer lands it in a decode engine's remote allocation, and decode continues exactly
as a colocated engine would. Fingerprint skew is refused at the handshake, naming the field."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from pathlib import Path

import pytest

from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.engine.engine import Engine
from pdserve.errors import TransferRefused
from pdserve.model.loader import LoadedModel, load_model
from pdserve.protocol.sampling import SamplingParams
from pdserve.transfer.backoff import BackoffPolicy
from pdserve.transfer.faulty import Fault, FaultAction, FaultPlan, FaultyStream
from pdserve.transfer.messages import KVLayout, token_digest
from pdserve.transfer.receiver import IncomingTransfer, KVReceiver
from pdserve.transfer.receiver_session import ReceivePlan
from pdserve.transfer.sender import OutgoingTransfer, SendPolicy, send_with_retries
from pdserve.transfer.sender_session import SenderSession
from pdserve.transfer.stream import ByteStream
from pdserve.transfer.tcp import open_tcp_stream, serve_tcp

PARAMS = SamplingParams(max_tokens=12, temperature=0.7, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_path: Path) -> LoadedModel:
    return load_model(str(tiny_model_path))


def make_engine(model: LoadedModel) -> Engine:
    return Engine(model, EngineConfig(model=ModelLoadConfig(path=str(model.path))))


def drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


async def disaggregated(
    prefill: Engine, decode: Engine, prompt: list[int], plans: list[FaultPlan]
) -> tuple[list[int], int, int, int]:
    """Prefill → hold → reserve on decode → transfer over TCP → decode.

    Returns (tokens, attempts, bytes sent, prompt tokens already cached on the decode side).
    """
    first = prefill.add_request(
        "r", prompt, dataclasses.replace(PARAMS, max_tokens=1), hold_kv=True
    )
    drain(prefill)
    num_cached = decode.add_remote_request("r", prompt, PARAMS)
    bs = decode.config.block_size
    skip = num_cached // bs  # blocks the decode side already has: they do not travel
    src = prefill.kv_block_views("r")[skip:]
    dst = decode.kv_block_views("r")[skip : skip + len(src)]
    m = prefill.model
    layout = KVLayout(m.config.num_layers, len(src), prefill.kv_cache.block_bytes, m.dtype, bs)
    tid, token = os.urandom(16), os.urandom(16)
    digest = token_digest(prompt)
    receiver = KVReceiver(dataclasses.asdict(decode.model.fingerprint))
    receiver.expect(
        IncomingTransfer(
            ReceivePlan(tid, token, layout, "r", len(prompt), digest),
            dst,
            lambda: decode.mark_remote_kv_ready("r", first.output_token_ids[0]),
        )
    )
    server = await serve_tcp(receiver.handle)

    async def connect() -> ByteStream:
        stream = await open_tcp_stream(server.address)
        return FaultyStream(stream, plans.pop(0) if plans else FaultPlan())

    try:
        session = SenderSession(tid, dataclasses.asdict(prefill.model.fingerprint))
        outgoing = OutgoingTransfer(tid, "r", 1, layout, len(prompt), digest, token, src)
        policy = SendPolicy(
            frame_bytes=2 * layout.block_bytes,
            chunk_timeout_s=2.0,
            backoff=BackoffPolicy(0.001, 0.01, 3),
        )
        report = await send_with_retries(
            connect,
            session,
            outgoing,
            policy,
            deadline=asyncio.get_running_loop().time() + 1e6,
            rng=random.Random(0),
        )
    finally:
        await server.aclose()
    prefill.release("r")
    request = decode.get_request("r")
    drain(decode)
    return list(request.output_token_ids), report.attempts, report.bytes_sent, num_cached


def colocated(model: LoadedModel, prompt: list[int]) -> list[int]:
    engine = make_engine(model)
    r = engine.add_request("c", prompt, PARAMS)
    drain(engine)
    return list(r.output_token_ids)


def prompt_of(model: LoadedModel, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, model.config.vocab_size) for _ in range(n)]


def assert_idle(engine: Engine) -> None:
    s = engine.stats()
    assert (s.num_free_blocks, s.num_held_blocks) == (s.num_blocks, 0)


def test_disaggregated_tokens_equal_colocated_over_tcp(model: LoadedModel) -> None:
    prompt = prompt_of(model, 75, 1)
    prefill, decode = make_engine(model), make_engine(model)
    tokens, attempts, sent, _ = asyncio.run(disaggregated(prefill, decode, prompt, []))
    assert tokens == colocated(model, prompt)
    assert attempts == 1
    assert sent == 5 * prefill.kv_cache.block_bytes  # ceil(75 / 16) blocks
    assert_idle(prefill)
    assert_idle(decode)


def test_corrupted_chunk_is_resent_and_output_is_unchanged(model: LoadedModel) -> None:
    prompt = prompt_of(model, 64, 2)
    prefill, decode = make_engine(model), make_engine(model)
    plans = [FaultPlan(faults=(Fault(FaultAction.CORRUPT, 3, 10_000),))]
    tokens, attempts, _, _ = asyncio.run(disaggregated(prefill, decode, prompt, plans))
    assert attempts == 2
    assert tokens == colocated(model, prompt)
    assert_idle(prefill)
    assert_idle(decode)


def test_decode_with_a_warm_prefix_receives_only_the_missing_blocks(model: LoadedModel) -> None:
    prompt = prompt_of(model, 70, 3)
    prefill, decode = make_engine(model), make_engine(model)
    warm = decode.add_request("warm", prompt[:40], SamplingParams(max_tokens=1, temperature=0.0))
    drain(decode)
    assert warm.status.finished
    tokens, _, sent, num_cached = asyncio.run(disaggregated(prefill, decode, prompt, []))
    # 40 warm tokens = 2 full cached blocks; the other ceil(70 / 16) - 2 = 3 travel.
    assert num_cached == 32
    assert sent == 3 * prefill.kv_cache.block_bytes
    assert tokens == colocated(model, prompt)


def test_int8_decode_worker_is_refused_naming_quantization(model: LoadedModel) -> None:
    prompt = prompt_of(model, 20, 4)
    prefill = make_engine(model)
    int8 = load_model(str(model.path), quantization="int8")
    decode = Engine(
        int8, EngineConfig(model=ModelLoadConfig(path=str(model.path), quantization="int8"))
    )
    with pytest.raises(TransferRefused, match="quantization") as info:
        asyncio.run(disaggregated(prefill, decode, prompt, []))
    # Weights are digested as stored, so quantization is the only differing field.
    assert "fingerprint mismatch on quantization: 'int8' != 'none'" in str(
        info.value
    )  # receiver's first
    assert not info.value.retryable
