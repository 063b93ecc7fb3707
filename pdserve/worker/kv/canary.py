"""The worker's side of the KV canary (invariant 8; the arithmetic is `engine/canary.py`).

Prefill side: right after its prefill, before the KV can be touched by anything else, the
worker computes the value digest of the held KV on the engine thread (`digest_now`) and sends it
in the transfer's Commit. Decode side: once the KV is verified by checksums, and before the
request is scheduled, the worker recomputes the same position from the blocks it now holds and
compares (`checker`); a mismatch is a typed `KVValueMismatch` that fails the handoff, so the
router's recovery runs and no token computed from that KV reaches anyone. Every check is
counted by result; one costs a one-token forward (measured: README § Fail closed).

It knows the engine and the canary's digest; not HTTP, transfers or the engine loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from pdserve.engine.canary import CanaryMatch, ValueDigest, compare
from pdserve.engine.engine import Engine
from pdserve.errors import KVValueMismatch, ProtocolError

MISSING = "missing"


def digest_now(engine: Engine, request_id: str) -> bytes:
    """The encoded value digest of a request's held KV (its last prompt position); on the
    engine thread (an `EngineLoop.add` finish hook)."""
    position, logits = engine.canary_logits(request_id)
    return ValueDigest.of_logits(logits, position).encode()


def checker(
    request_id: str, expected: bytes, dtype: str, counts: Counter[str]
) -> Callable[[Engine], str]:
    """The value check of a request's received KV, to run on the engine thread just before
    the request is scheduled (`EngineLoop.mark_ready(check=...)`, so that it does not wait
    behind a step of its own): recompute the last prompt position and compare with the
    sender's digest. Returns "exact" or "tolerance"; KVValueMismatch when it differs, and here
    at once when the digest is missing or does not parse. Every result is counted."""
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

    def run(e: Engine) -> str:
        position, logits = e.canary_logits(request_id)
        verdict = compare(want, logits, position, dtype)
        counts[verdict.match.value] += 1
        if verdict.match is CanaryMatch.MISMATCH:
            raise KVValueMismatch(
                f"request {request_id}: received KV does not compute what the prefill side's"
                f" did: {verdict.detail}"
            )
        return verdict.match.value

    return run
