"""The worker's side of the KV canary (invariant 8; the arithmetic is `engine/canary.py`).

Prefill side: right after its prefill, before the KV can be touched by anything else, the
worker computes the value digest of the held KV on the engine thread (`digest`) and sends it
in the transfer's Commit. Decode side: once the KV is verified by checksums, and before the
request is scheduled, the worker recomputes the same position from the blocks it now holds and
compares (`check`); a mismatch is a typed `KVValueMismatch` that fails the handoff, so the
router's recovery runs and no token computed from that KV reaches anyone. Every check is
counted by result; one costs a one-token forward (measured: README § Fail closed).

It knows the engine loop and the canary's digest; not HTTP or transfers.
"""

from __future__ import annotations

from collections import Counter

from pdserve.engine.canary import CanaryMatch, ValueDigest, compare
from pdserve.engine.engine import Engine
from pdserve.errors import KVValueMismatch, ProtocolError
from pdserve.worker.engine_loop import EngineLoop

MISSING = "missing"


async def digest(engine: EngineLoop, request_id: str) -> bytes:
    """The encoded value digest of a request's held KV (its last prompt position)."""

    def run(e: Engine) -> bytes:
        position, logits = e.canary_logits(request_id)
        return ValueDigest.of_logits(logits, position).encode()

    return await engine.call(run)


async def check(
    engine: EngineLoop, request_id: str, expected: bytes, dtype: str, counts: Counter[str]
) -> str:
    """Recompute the request's last prompt position and compare with the sender's digest:
    "exact" or "tolerance" (counted); KVValueMismatch (counted) when it differs, is missing
    or does not parse."""
    if not expected:
        counts[MISSING] += 1
        raise KVValueMismatch(
            f"request {request_id}: the transfer carried no value digest, and this worker"
            " checks received KV by value (--kv-canary); the prefill worker must send one"
        )
    try:
        want = ValueDigest.decode(expected)
    except ProtocolError as exc:
        counts[CanaryMatch.MISMATCH.value] += 1
        raise KVValueMismatch(f"request {request_id}: {exc}") from None

    def run(e: Engine) -> tuple[str, str]:
        position, logits = e.canary_logits(request_id)
        verdict = compare(want, logits, position, dtype)
        return verdict.match.value, verdict.detail

    result, detail = await engine.call(run)
    counts[result] += 1
    if result == CanaryMatch.MISMATCH.value:
        raise KVValueMismatch(
            f"request {request_id}: received KV does not compute what the prefill side's did:"
            f" {detail}"
        )
    return result
