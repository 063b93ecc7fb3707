"""A checkpoint replication link, both ends, sans-I/O: one handshake, then Put after Put.

A decode worker (the writer) replicates its requests' KV to a checkpoint holder. A transfer
session per put costs three round trips and a fresh handshake; a link costs the handshake once
per connection and then one frame and one reply per put:

    writer                                   holder
    IDLE ─hello()→ HELLO_SENT                LISTENING ─accept(Hello)→ READY (or a Nack, closed)
    HELLO_SENT ─receive_hello(Hello)→ READY
    READY ─put()→ READY (reply owed)         READY ─check_put(Put)→ READY ─ack()/nack()→ READY
    READY ─receive_reply(Ack|Nack)→ READY    any failed check → FAILED (the caller closes)

Authentication, with a cluster key: the writer's Hello carries `handshake.mac` over its random link
id, as any Hello; the holder answers with a Hello in the envelope of its own fresh nonce, whose
MAC covers both the link id and that nonce (the writer knows the answer is fresh). Both then
derive the link key from the two, and every Put carries an HMAC under it over its sequence
number, its fields and the checksum of its data: a recorded link replayed later fails, because
the holder's nonce differs, and no Put can be altered or injected into a live link.

Invariants:
- The writer sends no Put before it verified the holder's Hello (MAC, protocol version,
  fingerprint): KV copies go only to a cluster member whose engine can use them.
- Replies come in Put order: each names the sequence number of the Put it answers.
- Any failed check leaves the session FAILED; nothing more is accepted on that connection.

It knows messages, envelopes and MACs; not sockets, the host tier, leases or HTTP.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections import deque
from enum import Enum, auto
from typing import NoReturn

from pdserve.errors import (
    CheckpointRefused,
    FingerprintMismatch,
    IllegalTransition,
    LinkUnsupported,
    PdserveError,
    ProtocolError,
    TransferRefused,
    Unauthenticated,
    UnsupportedVersion,
)
from pdserve.transfer import handshake
from pdserve.transfer.codec import Envelope, FrameHeader
from pdserve.transfer.messages import (
    PROTOCOL_VERSION,
    TRANSFER_ID_BYTES,
    Ack,
    AckOf,
    Hello,
    Message,
    Nack,
    NackCode,
    Put,
    Role,
    token_digest,
)
from pdserve.transfer.session import (
    FingerprintCompare,
    FingerprintMap,
    Outbound,
    fingerprint_diff,
)
from pdserve.transfer.wire import encode_fingerprint

_ATTEMPT = 1  # a link has one attempt: a broken one is replaced by a new connection


class LinkState(Enum):
    IDLE = auto()
    HELLO_SENT = auto()
    LISTENING = auto()
    READY = auto()
    FAILED = auto()


def holder_hello_mac(
    key: bytes | None, role: Role, link_id: bytes, nonce: bytes, fingerprint: FingerprintMap
) -> bytes:
    """The holder's Hello tag: binds the writer's link id and the holder's nonce."""
    if key is None:
        return b""
    mac = hmac.new(key, b"pdkv2 link hello", hashlib.sha256)
    mac.update(struct.pack("<B16s16s", int(role), link_id, nonce))
    mac.update(encode_fingerprint(fingerprint))
    return mac.digest()


def link_key(key: bytes | None, link_id: bytes, nonce: bytes) -> bytes | None:
    """The key every Put of one link is signed with (None without a cluster key)."""
    if key is None:
        return None
    return hmac.new(key, b"pdkv2 link key" + link_id + nonce, hashlib.sha256).digest()


_PUT_FIELDS = struct.Struct("<QQQdQ")


def put_mac(key: bytes | None, seq: int, put: Put, data_checksum: int) -> bytes:
    """A Put's tag under its link key: its sequence number, every field and its data."""
    if key is None:
        return b""
    mac = hmac.new(key, b"pdkv2 put", hashlib.sha256)
    mac.update(
        _PUT_FIELDS.pack(seq, put.parent_hash, put.first_version, put.lease_ttl, data_checksum)
    )
    owner = put.owner.encode("utf-8")
    mac.update(struct.pack("<H", len(owner)) + owner)
    mac.update(token_digest(put.token_ids))
    mac.update(struct.pack("<B", len(put.value_digest)) + put.value_digest)
    return mac.digest()


class _Link:
    """What both ends share: state, sequence numbers, the link key."""

    def __init__(
        self,
        fingerprint: FingerprintMap,
        key: bytes | None,
        state: LinkState,
        compare: FingerprintCompare,
    ) -> None:
        self._fingerprint = dict(fingerprint)
        self._compare = compare
        self._key = key
        self.state = state
        self._send_seq = 0
        self._recv_seq = 0
        self._put_key: bytes | None = None
        self.link_id = b""

    @property
    def _who(self) -> str:
        return f"checkpoint link {self.link_id.hex()[:8]}"

    def _require(self, *states: LinkState) -> None:
        if self.state not in states:
            raise IllegalTransition(f"{self._who}: not allowed in {self.state.name}")

    def _envelope(self, transfer_id: bytes) -> Envelope:
        envelope = Envelope(transfer_id, _ATTEMPT, self._send_seq)
        self._send_seq += 1
        return envelope

    def _take_seq(self, header: FrameHeader) -> None:
        if header.attempt != _ATTEMPT or header.seq != self._recv_seq:
            self._fail(
                ProtocolError(
                    f"{self._who}: frame seq {header.seq} attempt {header.attempt},"
                    f" expected seq {self._recv_seq}"
                )
            )
        self._recv_seq += 1

    def _check_hello(self, hello: Hello, want_mac: bytes) -> None:
        problem = handshake.problem(hello, want_mac, self._fingerprint, self._compare, self._who)
        if problem is not None:
            self._fail(problem[1])

    def _fail(self, error: PdserveError) -> NoReturn:
        self.state = LinkState.FAILED
        raise error


class LinkWriter(_Link):
    """The decode worker's end: handshake, then Puts, each answered in order."""

    def __init__(
        self,
        fingerprint: FingerprintMap,
        cluster_key: bytes | None,
        *,
        link_id: bytes | None = None,
        compare: FingerprintCompare = fingerprint_diff,
        peer_instance: bytes = b"",
    ) -> None:
        super().__init__(fingerprint, cluster_key, LinkState.IDLE, compare)
        self.link_id = link_id or os.urandom(TRANSFER_ID_BYTES)
        # The holder's process instance this link is meant for (b"": any).
        self._peer_instance = peer_instance
        # Sequence numbers of the Puts sent and not yet answered, oldest first.
        self._owed: deque[int] = deque()

    def hello(self) -> Outbound:
        """Open the link (this side's fingerprint and, with a cluster key, its MAC)."""
        self._require(LinkState.IDLE)
        hello = handshake.own_hello(
            self._key, Role.REPLICA, self.link_id, _ATTEMPT, self._fingerprint, self._peer_instance
        )
        out = Outbound(self._envelope(self.link_id), hello)
        self.state = LinkState.HELLO_SENT
        return out

    def receive_hello(self, header: FrameHeader, message: Message) -> None:
        """Check the holder's answer; raises (typed) unless it is a cluster member with a
        bit-compatible engine."""
        self._require(LinkState.HELLO_SENT)
        self._take_seq(header)
        if isinstance(message, Nack):
            if message.code is NackCode.UNKNOWN_TRANSFER:
                # A receiver that knows no links took the link id for a transfer id.
                self._fail(LinkUnsupported(f"{self._who}: the holder serves no links"))
            self._fail(_refusal(message, self._who))
        if not isinstance(message, Hello):
            self._fail(ProtocolError(f"{self._who}: {type(message).__name__} before Hello"))
        nonce = header.transfer_id
        want = holder_hello_mac(self._key, message.role, self.link_id, nonce, message.fingerprint)
        self._check_hello(message, want)
        self._put_key = link_key(self._key, self.link_id, nonce)
        self.state = LinkState.READY

    def put(self, put: Put, data_checksum: int) -> Outbound:
        """Frame a Put (its `auth` is filled in here); its data must hash to `data_checksum`."""
        self._require(LinkState.READY)
        envelope = self._envelope(self.link_id)
        signed = Put(
            put.owner,
            put.parent_hash,
            put.first_version,
            put.token_ids,
            put.lease_ttl,
            put.value_digest,
            put_mac(self._put_key, envelope.seq, put, data_checksum),
        )
        self._owed.append(envelope.seq)
        return Outbound(envelope, signed)

    def receive_reply(self, header: FrameHeader, message: Message) -> None:
        """The answer to the oldest Put still owed one: returns on Ack(PUT), raises
        CheckpointRefused / TransferRefused on a Nack, ProtocolError on anything else."""
        self._require(LinkState.READY)
        self._take_seq(header)
        if not self._owed:
            self._fail(ProtocolError(f"{self._who}: a reply to no Put"))
        self._owed.popleft()
        if isinstance(message, Ack) and message.of is AckOf.PUT:
            return
        if isinstance(message, Nack):
            error = _refusal(message, self._who)
            if isinstance(error, CheckpointRefused):
                raise error  # the link itself is fine: only this Put was refused
            self._fail(error)
        self._fail(ProtocolError(f"{self._who}: {type(message).__name__} answers a Put"))

    @property
    def num_owed(self) -> int:
        """Puts sent and not yet answered."""
        return len(self._owed)


class LinkHolder(_Link):
    """The holder's end: checks the writer's Hello, answers it, then checks each Put."""

    def __init__(
        self,
        fingerprint: FingerprintMap,
        cluster_key: bytes | None,
        role: Role,
        *,
        nonce: bytes | None = None,
        compare: FingerprintCompare = fingerprint_diff,
    ) -> None:
        super().__init__(fingerprint, cluster_key, LinkState.LISTENING, compare)
        self._role = role
        self._nonce = nonce or os.urandom(TRANSFER_ID_BYTES)

    def accept(self, header: FrameHeader, hello: Hello) -> tuple[Outbound, PdserveError | None]:
        """The answer to the writer's Hello: this side's Hello, or a Nack and the error
        (the caller sends it and closes)."""
        self._require(LinkState.LISTENING)
        self.link_id = header.transfer_id
        try:
            self._take_seq(header)
            self._check_writer(header, hello)
        except PdserveError as error:
            self.state = LinkState.FAILED
            return self._nack_for(error), error
        self._put_key = link_key(self._key, self.link_id, self._nonce)
        self.state = LinkState.READY
        auth = holder_hello_mac(self._key, self._role, self.link_id, self._nonce, self._fingerprint)
        reply = Hello(PROTOCOL_VERSION, self._role, self._fingerprint, auth)
        return Outbound(self._envelope(self._nonce), reply), None

    def _check_writer(self, header: FrameHeader, hello: Hello) -> None:
        if hello.role is not Role.REPLICA:
            self._fail(ProtocolError(f"{self._who}: Hello from a {hello.role.name}, not a link"))
        self._check_hello(hello, handshake.peer_mac(self._key, header, hello))

    def check_put(self, header: FrameHeader, put: Put) -> None:
        """Sequence and MAC of one Put (its data is checked against `header.data_checksum`
        once it landed); raises, leaving the session FAILED, when either is wrong."""
        self._require(LinkState.READY)
        seq = header.seq
        self._take_seq(header)
        want = put_mac(self._put_key, seq, put, header.data_checksum)
        if self._key is not None and not hmac.compare_digest(want, put.auth):
            self._fail(Unauthenticated(f"{self._who}: Put {seq} has no valid MAC"))

    def ack(self) -> Outbound:
        """The Put was verified and is held."""
        self._require(LinkState.READY)
        return Outbound(self._envelope(self._nonce), Ack(AckOf.PUT))

    def nack(self, code: NackCode, text: str) -> Outbound:
        """The Put was refused (the link goes on unless the caller closes it)."""
        return Outbound(self._envelope(self._nonce), Nack(code, text[:2000], False))

    def _nack_for(self, error: PdserveError) -> Outbound:
        code = next(
            (c for cls, c in _HANDSHAKE_NACKS if isinstance(error, cls)), NackCode.SEQUENCE_GAP
        )
        return self.nack(code, str(error))


# Why a handshake failed -> the Nack code that tells the writer (first match wins).
_HANDSHAKE_NACKS: tuple[tuple[type[PdserveError], NackCode], ...] = (
    (Unauthenticated, NackCode.UNAUTHENTICATED),
    (FingerprintMismatch, NackCode.FINGERPRINT_MISMATCH),
    (UnsupportedVersion, NackCode.VERSION_MISMATCH),
)


def _refusal(nack: Nack, who: str) -> PdserveError:
    """The writer's error for a Nack: a refused Put, or a refused link."""
    if nack.code is NackCode.CHECKPOINT_REFUSED:
        return CheckpointRefused("holder", f"{who}: {nack.text}")
    return TransferRefused(f"{nack.code.name}: {nack.text}", nack.retryable)
