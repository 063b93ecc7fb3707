"""Signatures the cluster checks: control calls (HTTP) and reservations. Pure, clock injected.

**Calls.** Every worker control call carries `X-Pdserve-Auth: pdserve-v1 <ts> <nonce> <mac>`:
`mac` is HMAC-SHA256 (the "http" key) over the method, path, timestamp, nonce, SHA-256 of
the body and the call's target: `X-Pdserve-Target: <worker id>/<instance id>`, the one life of
one worker the call is meant for (the router sends it on every call; a call without it signs
"no target", so the header cannot be stripped from a captured call). The worker refuses
(`CallVerifier.verify`):
- no header, or one that does not parse: `Unauthenticated` (401);
- a MAC that does not match (forged, or the body changed): `Forbidden` (403);
- a target naming another worker (a replay across workers): `Forbidden`;
- a target naming an earlier instance of this worker (it restarted at the same address):
  `StaleInstance` (410, retryable: the router recovers as from a lost worker);
- a timestamp outside the window (default ±300 s, which allows for clock skew between hosts):
  `Forbidden`;
- a nonce already seen inside the window (a replay): `Forbidden`.
Only a call that passes every check is recorded, so refused calls leave no state behind but
the refusal counter. The nonce memory is bounded: when full, the oldest entries are dropped and
the earliest timestamp still accepted moves up past them, so a replay is never let through
for lack of memory (it is refused as stale instead).

**Fields.** `mac_fields` is the one way anything else is signed (reservations): each part
length-prefixed, so no two different field lists sign the same bytes.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import secrets
import struct
import time
from collections.abc import Callable

from pdserve.errors import AuthError, Forbidden, StaleInstance, Unauthenticated

AUTH_HEADER = "X-Pdserve-Auth"
# Which worker, and which life of it, a call is meant for (covered by the MAC).
TARGET_HEADER = "X-Pdserve-Target"
SCHEME = "pdserve-v1"
DEFAULT_WINDOW_S = 300.0
DEFAULT_MAX_NONCES = 200_000

Part = str | bytes | int | float | None


def mac_fields(key: bytes, *parts: Part) -> str:
    """Hex HMAC-SHA256 over `parts`, each typed and length-prefixed (unambiguous)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        raw = _encode_part(part)
        mac.update(struct.pack("<I", len(raw)))
        mac.update(raw)
    return mac.hexdigest()


def _encode_part(part: Part) -> bytes:
    if part is None:
        return b"n"
    if isinstance(part, bytes):
        return b"b" + part
    if isinstance(part, str):
        # surrogatepass: a path with undecodable bytes still signs (and compares) as bytes.
        return b"s" + part.encode("utf-8", "surrogatepass")
    if isinstance(part, bool):
        raise TypeError("mac_fields: bool is ambiguous with int; pass an int")
    if isinstance(part, int):
        return b"i" + str(part).encode()
    return b"f" + repr(float(part)).encode()


def _call_mac(
    key: bytes, method: str, path: str, timestamp: str, nonce: str, body: bytes, target: str | None
) -> str:
    digest = hashlib.sha256(body).digest()
    return mac_fields(key, method.upper(), path, timestamp, nonce, digest, target)


def call_target(worker_id: str, instance_id: str) -> str:
    """The `X-Pdserve-Target` of one life of one worker: `<worker id>/<instance id>`."""
    return f"{worker_id}/{instance_id}"


def sign_call(
    key: bytes,
    method: str,
    path: str,
    body: bytes,
    now_s: float,
    nonce: str | None = None,
    target: str | None = None,
) -> str:
    """The `X-Pdserve-Auth` header value for one call made at wall time `now_s` (to `target`,
    which then travels as `X-Pdserve-Target`, if given)."""
    nonce = nonce or secrets.token_hex(12)
    timestamp = f"{now_s:.3f}"
    mac = _call_mac(key, method, path, timestamp, nonce, body, target)
    return f"{SCHEME} {timestamp} {nonce} {mac}"


def auth_headers(
    key: bytes | None, method: str, path: str, body: bytes, target: str | None = None
) -> dict[str, str]:
    """Headers that sign one call now (none without a key: an insecure cluster)."""
    if key is None:
        return {}
    headers = {AUTH_HEADER: sign_call(key, method, path, body, time.time(), target=target)}
    if target is not None:
        headers[TARGET_HEADER] = target
    return headers


class CallVerifier:
    """Checks signed calls against one key; remembers nonces for the window."""

    def __init__(
        self,
        key: bytes,
        clock: Callable[[], float],
        window_s: float = DEFAULT_WINDOW_S,
        max_nonces: int = DEFAULT_MAX_NONCES,
        target: str | None = None,
    ) -> None:
        """`clock` is wall time in seconds (calls are compared across hosts); `target` is this
        worker's own `call_target` (None: targeted calls are not checked against it)."""
        if window_s <= 0 or max_nonces < 1:
            raise ValueError(f"CallVerifier: window_s {window_s} and max_nonces {max_nonces}")
        self._key = key
        self._target = target
        self._clock = clock
        self._window_s = window_s
        self._max_nonces = max_nonces
        self._seen: set[str] = set()
        self._sent: list[tuple[float, str]] = []  # heap of (sent at, nonce)
        # Timestamps at or below this are refused: their nonces may have been forgotten.
        self._floor = float("-inf")
        self.num_refused = 0

    def verify(
        self, header: str | None, method: str, path: str, body: bytes, target: str | None = None
    ) -> None:
        """Return if the call is authentic, fresh and meant for this worker (`target`: the
        call's `X-Pdserve-Target`); raise Unauthenticated, Forbidden or StaleInstance."""
        try:
            self._verify(header, method, path, body, target)
        except AuthError:
            self.num_refused += 1
            raise

    def _verify(
        self, header: str | None, method: str, path: str, body: bytes, target: str | None
    ) -> None:
        where = f"{method.upper()} {path}"
        if not header:
            raise Unauthenticated(f"{where}: no {AUTH_HEADER} header (cluster credential needed)")
        parts = header.split(" ")
        # Non-ASCII text (undecodable bytes arrive as lone surrogates) is no signature: refused
        # here, before encode() or compare_digest() could raise on it.
        if len(parts) != 4 or parts[0] != SCHEME or not header.isascii():
            raise Unauthenticated(f"{where}: {AUTH_HEADER} is not '{SCHEME} <ts> <nonce> <mac>'")
        _, timestamp, nonce, given = parts
        try:
            sent_at = float(timestamp)
        except ValueError:
            sent_at = math.nan
        if not math.isfinite(sent_at):  # "nan" would pass every window comparison
            raise Unauthenticated(f"{where}: {AUTH_HEADER} timestamp {timestamp!r}")
        if not 8 <= len(nonce) <= 64:
            raise Unauthenticated(f"{where}: {AUTH_HEADER} nonce must be 8..64 characters")
        want = _call_mac(self._key, method, path, timestamp, nonce, body, target)
        if not hmac.compare_digest(want, given):
            raise Forbidden(f"{where}: signature does not match (wrong secret or altered call)")
        if target is not None and self._target is not None and target != self._target:
            self._refuse_target(where, target)
        now = self._clock()
        self._forget(now)
        if abs(now - sent_at) > self._window_s or sent_at <= self._floor:
            raise Forbidden(
                f"{where}: signed at {sent_at:.3f}, {now - sent_at:+.1f} s from now: outside the"
                f" {self._window_s:.0f} s window (clock skew, or a replay)"
            )
        if nonce in self._seen:
            raise Forbidden(f"{where}: nonce {nonce} was already used (a replayed call)")
        self._seen.add(nonce)
        heapq.heappush(self._sent, (sent_at, nonce))
        while len(self._seen) > self._max_nonces:
            oldest, old = heapq.heappop(self._sent)
            self._seen.discard(old)
            self._floor = max(self._floor, oldest)

    def _refuse_target(self, where: str, target: str) -> None:
        assert self._target is not None
        own_worker = self._target.rsplit("/", 1)[0]
        if target.rsplit("/", 1)[0] != own_worker:
            # Signed for another worker: a replay across workers, never retried here.
            raise Forbidden(f"{where}: call signed for worker {target}, this is {self._target}")
        raise StaleInstance(
            f"{where}: call signed for {target}, an earlier life of this worker (now"
            f" {self._target}): it restarted, and what the caller held here is gone"
        )

    def _forget(self, now: float) -> None:
        # A nonce whose timestamp left the window can no longer be replayed: the window refuses.
        while self._sent and self._sent[0][0] + self._window_s < now:
            self._seen.discard(heapq.heappop(self._sent)[1])

    @property
    def num_remembered(self) -> int:
        """Nonces held (bounded by max_nonces)."""
        return len(self._seen)
