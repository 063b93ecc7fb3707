"""The Hello that opens every KV connection (transfer attempt or checkpoint link): this side's
own, and the checks a peer's must pass before anything else is read from it.

Used qualified (`handshake.problem`, `handshake.own_hello`): the sessions' own variables are
named `hello`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import struct

from pdserve.errors import FingerprintMismatch, PdserveError, Unauthenticated, UnsupportedVersion
from pdserve.transfer.codec import FrameHeader
from pdserve.transfer.messages import PROTOCOL_VERSION, Hello, NackCode, Role
from pdserve.transfer.session import FingerprintCompare, FingerprintMap
from pdserve.transfer.wire import encode_fingerprint


def mac(key: bytes | None, hello: Hello, transfer_id: bytes, attempt: int) -> bytes:
    """The `Hello.auth` tag: HMAC-SHA256 under the cluster's KV key over what the Hello says
    (its `auth` aside) and which attempt of which transfer it opens; b"" without a secret."""
    if key is None:
        return b""
    tag = hmac.new(key, b"pdkv3 hello", hashlib.sha256)
    tag.update(struct.pack("<B16sI", int(hello.role), transfer_id, attempt))
    tag.update(encode_fingerprint(hello.fingerprint))
    tag.update(struct.pack("<B", len(hello.peer_instance)) + hello.peer_instance)
    return tag.digest()


def peer_mac(key: bytes | None, header: FrameHeader, hello: Hello) -> bytes:
    """The MAC a peer's Hello must carry for the transfer (or link) and attempt it opens."""
    return mac(key, hello, header.transfer_id, header.attempt)


def own_hello(
    key: bytes | None,
    role: Role,
    transfer_id: bytes,
    attempt: int,
    fingerprint: FingerprintMap,
    peer_instance: bytes = b"",
) -> Hello:
    """This side's Hello for one attempt: this build's protocol, its fingerprint and MAC, and
    the peer's instance it is meant for (b"": any)."""
    hello = Hello(PROTOCOL_VERSION, role, dict(fingerprint), b"", peer_instance)
    return dataclasses.replace(hello, auth=mac(key, hello, transfer_id, attempt))


def problem(
    hello: Hello,
    want_mac: bytes,
    local: FingerprintMap,
    compare: FingerprintCompare,
    who: str,
) -> tuple[NackCode, PdserveError] | None:
    """Why a peer's Hello is not trusted, or None: checked in this order, so that a peer outside
    the cluster learns nothing about this build, its MAC (`want_mac`, b"" without a cluster
    key), its protocol version, then its fingerprint against this side's."""
    if want_mac and not hmac.compare_digest(want_mac, hello.auth):
        text = f"{who}: the peer's Hello has no valid MAC under the cluster secret"
        return NackCode.UNAUTHENTICATED, Unauthenticated(text)
    if hello.protocol_version != PROTOCOL_VERSION:
        text = f"{who}: the peer speaks {hello.protocol_version}, this build {PROTOCOL_VERSION}"
        return NackCode.VERSION_MISMATCH, UnsupportedVersion(text)
    diff = compare(local, hello.fingerprint)
    if diff:
        return NackCode.FINGERPRINT_MISMATCH, FingerprintMismatch(diff, context=who)
    return None
