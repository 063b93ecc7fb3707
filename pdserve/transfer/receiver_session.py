"""`ReceiverSession`: the decode side of one KV transfer, as a transition table (sans-I/O).

One session per transfer id, across all its attempts. Life cycle (the table is the truth):

    IDLE ─Hello→ HANDSHAKEN ─Begin→ RECEIVING ─Chunk→ CHUNK_PENDING ─data→ RECEIVING …
    RECEIVING ─Commit→ COMMITTED (verified)
    a failed check anywhere → FAILED (this attempt's data is discarded)
    Hello of a higher attempt, from any open state or FAILED → HANDSHAKEN (a retry)
    COMMITTED ─Hello→ COMMITTED_RETRY ─same Begin→ COMMITTED (Ack(COMMIT) again: idempotent)
    Abort (either side) → ABORTED

Checks, each refused with a Nack naming the field, a local typed error, and FAILED:
Hello: the cluster MAC first (`cluster_key` set: Unauthenticated, nothing else is looked at),
protocol version and fingerprint (FingerprintMismatch lists every differing field).
Begin: capability token first (Unauthorized: nothing else is looked at or accepted), the
reservation's lease epoch (StaleLease: a sender fenced by a newer grant), the lease itself
(`guard`), then layout, request, tokens and snapshot against the plan.
Chunk: lease, data length, in bounds, no overlap; its data: payload checksum.
Commit: lease, every byte covered, chunk and byte counts, total digest; its value digest (the
canary) is kept for the owner, which checks it by recomputation.

Invariants:
- `verified` is True only after a Commit matched everything received in the same attempt.
- Frames of an older attempt raise StaleAttempt and change nothing; an illegal event raises
  IllegalTransition and changes nothing.
- Replies are returned by `receive`; when `receive` raises, its Nack stays queued for
  `take_outgoing`.

It knows messages and byte offsets within the transfer; not sockets, KV memory or schedulers
(lease checks arrive as callbacks).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum, auto
from typing import NoReturn

from pdserve.errors import (
    ChecksumMismatch,
    LeaseError,
    PdserveError,
    ProtocolError,
    StaleAttempt,
    StaleLease,
    Unauthorized,
)
from pdserve.transfer import handshake
from pdserve.transfer.codec import Envelope, FrameHeader
from pdserve.transfer.messages import (
    NACK_RETRYABLE,
    Abort,
    Ack,
    AckOf,
    Begin,
    Chunk,
    Commit,
    Hello,
    KVLayout,
    Message,
    Nack,
    NackCode,
    Renew,
    Role,
)
from pdserve.transfer.session import (
    ChunkLedger,
    FingerprintCompare,
    FingerprintMap,
    Outbound,
    fingerprint_diff,
    transition,
)


@dataclass(frozen=True, slots=True)
class ReceivePlan:
    """What the decode side reserved for this transfer; None fields are not checked."""

    transfer_id: bytes
    capability_token: bytes
    layout: KVLayout
    request_id: str | None = None
    num_tokens: int | None = None
    token_digest: bytes | None = None
    # The reservation lease's epoch; a Begin naming another one is refused.
    epoch: int | None = None


class ReceiverState(Enum):
    IDLE = auto()
    HANDSHAKEN = auto()
    RECEIVING = auto()
    CHUNK_PENDING = auto()  # a Chunk was accepted; its data is being landed
    COMMITTED = auto()
    COMMITTED_RETRY = auto()  # committed, and a retry's Hello arrived: awaiting its Begin
    FAILED = auto()
    ABORTED = auto()


class ReceiverEvent(Enum):
    HELLO = auto()  # a Hello opening a new (higher) attempt
    BEGIN = auto()
    CHUNK = auto()
    DATA = auto()  # the data of the pending chunk has landed (`data_received`)
    COMMIT = auto()
    RENEW = auto()
    ABORT = auto()
    REJECT = auto()  # a check failed
    UNEXPECTED = auto()  # Ack/Nack, a repeated Hello, a new attempt not opened by Hello


_S, _E = ReceiverState, ReceiverEvent
_OPEN = (_S.IDLE, _S.HANDSHAKEN, _S.RECEIVING, _S.CHUNK_PENDING, _S.FAILED)

RECEIVER_TRANSITIONS: Mapping[tuple[ReceiverState, ReceiverEvent], ReceiverState] = {
    **{(s, _E.HELLO): _S.HANDSHAKEN for s in _OPEN},
    (_S.COMMITTED, _E.HELLO): _S.COMMITTED_RETRY,
    (_S.COMMITTED_RETRY, _E.HELLO): _S.COMMITTED_RETRY,
    (_S.HANDSHAKEN, _E.BEGIN): _S.RECEIVING,
    (_S.COMMITTED_RETRY, _E.BEGIN): _S.COMMITTED,
    (_S.RECEIVING, _E.CHUNK): _S.CHUNK_PENDING,
    (_S.CHUNK_PENDING, _E.DATA): _S.RECEIVING,
    (_S.RECEIVING, _E.COMMIT): _S.COMMITTED,
    (_S.HANDSHAKEN, _E.RENEW): _S.HANDSHAKEN,
    (_S.RECEIVING, _E.RENEW): _S.RECEIVING,
    **{(s, _E.ABORT): _S.ABORTED for s in _OPEN},
    **{(s, _E.REJECT): _S.FAILED for s in _OPEN},
    # A confused retry never discards KV that was already verified.
    (_S.COMMITTED, _E.REJECT): _S.COMMITTED,
    (_S.COMMITTED_RETRY, _E.REJECT): _S.COMMITTED,
}


class ReceiverSession:
    """One transfer from the receiving side, across attempts."""

    def __init__(
        self,
        plan: ReceivePlan,
        fingerprint: FingerprintMap,
        *,
        role: Role = Role.DECODE,
        compare: FingerprintCompare = fingerprint_diff,
        guard: Callable[[], object] | None = None,
        renew: Callable[[Renew], object] | None = None,
        cluster_key: bytes | None = None,
    ) -> None:
        """`guard` raises LeaseError once the reservation's lease is gone (called before
        accepting Begin, each Chunk and Commit); `renew` applies a Renew to that lease, raising
        LeaseError to refuse it. Their return values are ignored. With `cluster_key`, a Hello
        without a valid MAC under it is refused, and the reply carries one."""
        self.plan = plan
        self._role = role
        self._fingerprint = dict(fingerprint)
        self._key = cluster_key
        self._compare = compare
        self._guard = guard
        self._renew = renew
        self.state = ReceiverState.IDLE
        self.attempt = -1  # no attempt yet; the first Hello sets it
        self._recv_seq = 0
        self._send_seq = 0
        self._outbox: list[Outbound] = []
        self._ledger: ChunkLedger | None = None
        self.pending_chunk: Chunk | None = None  # accepted; its data is awaited
        self.begin: Begin | None = None  # the Begin of the current or committed attempt
        self._max_snapshot = -1
        # The committed attempt's value digest (the prefill side's canary); b"" if none.
        self.value_digest = b""

    @property
    def verified(self) -> bool:
        """True once every block arrived, matched its checksum and the commit digest."""
        return self.state in (ReceiverState.COMMITTED, ReceiverState.COMMITTED_RETRY)

    def take_outgoing(self) -> list[Outbound]:
        """Replies queued and not yet taken (a Nack after `receive` raised)."""
        out, self._outbox = self._outbox, []
        return out

    def receive(self, header: FrameHeader, message: Message) -> list[Outbound]:
        """Apply one frame from the sender; returns the replies to send, in order."""
        if header.transfer_id != self.plan.transfer_id:
            raise ProtocolError(f"{self._who}: frame for transfer {header.transfer_id.hex()}")
        if header.attempt < self.attempt:
            raise StaleAttempt(f"{self._who}: frame from attempt {header.attempt}")
        new_attempt = header.attempt > self.attempt
        event = self._classify(message, new_attempt)
        next_state = transition(RECEIVER_TRANSITIONS, self.state, event, self._who)
        if new_attempt:
            self.attempt = header.attempt
            self._recv_seq = self._send_seq = 0
            self._discard_attempt()
        if header.seq != self._recv_seq:
            text = f"frame seq {header.seq}, expected {self._recv_seq}"
            self._refuse(NackCode.SEQUENCE_GAP, ProtocolError, text)
        self._recv_seq += 1
        if isinstance(message, Hello):
            self._on_hello(header, message)
        elif isinstance(message, Begin):
            self._on_begin(message)
        elif isinstance(message, Chunk):
            self._on_chunk(header, message)
        elif isinstance(message, Commit):
            self._on_commit(message)
        elif isinstance(message, Renew):
            self._on_renew(message)
        else:  # Abort: the table allowed nothing else through
            self._discard_attempt()
        self.state = next_state
        return self.take_outgoing()

    def data_received(self, checksum: int) -> list[Outbound]:
        """The pending chunk's data has landed; `checksum` is xxh3_64 over it, as received."""
        next_state = transition(RECEIVER_TRANSITIONS, self.state, _E.DATA, self._who)
        chunk, ledger = self.pending_chunk, self._ledger
        if chunk is None or ledger is None:
            raise ProtocolError(f"{self._who}: no chunk is pending")
        if checksum != chunk.payload_checksum:
            text = f"chunk at byte {chunk.offset}: data checksum {checksum:#x}"
            self._refuse(NackCode.CHECKSUM_MISMATCH, ChecksumMismatch, text)
        ledger.add(chunk)
        self.pending_chunk = None
        self.state = next_state
        return self.take_outgoing()

    def abort(self, reason: str) -> Outbound:
        """Give the transfer up from this side (e.g. its deadline passed)."""
        self.state = transition(RECEIVER_TRANSITIONS, self.state, _E.ABORT, self._who)
        self._discard_attempt()
        return self._reply(Abort(reason))

    # ---- per-message checks ------------------------------------------------------------------

    def _on_hello(self, header: FrameHeader, hello: Hello) -> None:
        want = handshake.peer_mac(self._key, header, hello)
        problem = handshake.problem(hello, want, self._fingerprint, self._compare, self._who)
        if problem is not None:
            self._reject(*problem)
        own = handshake.own_hello(
            self._key, self._role, self.plan.transfer_id, self.attempt, self._fingerprint
        )
        self._outbox.append(self._reply(own))

    def _on_begin(self, begin: Begin) -> None:
        # The token first: an unauthorised peer learns nothing about the plan.
        if not hmac.compare_digest(begin.capability_token, self.plan.capability_token):
            self._refuse(NackCode.UNAUTHORIZED, Unauthorized, "wrong capability token")
        if not self.verified:  # after commit the reservation has become the running request
            if self.plan.epoch is not None and begin.epoch != self.plan.epoch:
                text = (
                    f"Begin names lease epoch {begin.epoch}, the reservation's is {self.plan.epoch}"
                )
                self._refuse(NackCode.LEASE, StaleLease, text)
            self._check_lease()
        mismatch = self._begin_mismatch(begin)
        if mismatch:
            code = NackCode.ALREADY_COMMITTED if self.verified else NackCode.BEGIN_MISMATCH
            self._refuse(code, ProtocolError, f"Begin {mismatch}")
        if self.verified:  # a retry of what is already committed: say so again
            self._outbox.append(self._reply(Ack(AckOf.COMMIT)))
            return
        self.begin = begin
        self._max_snapshot = begin.snapshot_version
        self._ledger = ChunkLedger(begin.layout)
        self._outbox.append(self._reply(Ack(AckOf.BEGIN)))

    def _begin_mismatch(self, begin: Begin) -> str:
        plan = self.plan
        checks: list[tuple[str, object, object]] = [
            ("transfer_id", plan.transfer_id, begin.transfer_id),
            ("layout", plan.layout, begin.layout),
        ]
        optional: list[tuple[str, object, object]] = [
            ("request_id", plan.request_id, begin.request_id),
            ("num_tokens", plan.num_tokens, begin.num_tokens),
            ("token_digest", plan.token_digest, begin.token_digest),
        ]
        checks += [check for check in optional if check[1] is not None]
        if self.verified and self.begin is not None:
            # Idempotent only if it is the very transfer that was committed.
            checks.append(("snapshot_version", self.begin.snapshot_version, begin.snapshot_version))
            checks.append(("request_id", self.begin.request_id, begin.request_id))
        for name, want, got in checks:
            if want != got:
                return f"{name}: expected {want!r}, got {got!r}"
        if begin.snapshot_version < self._max_snapshot:
            return f"snapshot_version {begin.snapshot_version} older than {self._max_snapshot}"
        return ""

    def _on_chunk(self, header: FrameHeader, chunk: Chunk) -> None:
        self._check_lease()
        ledger = self._require_ledger()
        if header.data_len != chunk.num_bytes:
            text = f"chunk data_len {header.data_len}, its num_bytes {chunk.num_bytes}"
            self._refuse(NackCode.CHUNK_OUT_OF_RANGE, ProtocolError, text)
        problem = ledger.problem(chunk)
        if problem is not None:
            self._refuse(problem[0], ProtocolError, problem[1])
        self.pending_chunk = chunk

    def _on_commit(self, commit: Commit) -> None:
        self._check_lease()
        ledger = self._require_ledger()
        got = (commit.num_chunks, commit.num_bytes)
        have = (ledger.num_chunks, ledger.num_bytes)
        if not ledger.complete or got != have:
            text = f"commit (chunks, bytes) {got}, received {have}, complete={ledger.complete}"
            self._refuse(NackCode.COMMIT_MISMATCH, ProtocolError, text)
        if commit.total_digest != ledger.digest():
            text = f"commit digest {commit.total_digest:#x} != {ledger.digest():#x}"
            self._refuse(NackCode.COMMIT_MISMATCH, ChecksumMismatch, text)
        self.value_digest = commit.value_digest
        self._outbox.append(self._reply(Ack(AckOf.COMMIT)))

    def _on_renew(self, renew: Renew) -> None:
        if self._renew is not None:
            try:
                self._renew(renew)
            except LeaseError as e:
                self._reject(NackCode.LEASE, e)
        self._outbox.append(self._reply(Ack(AckOf.RENEW)))

    # ---- internals ---------------------------------------------------------------------------

    @property
    def _who(self) -> str:
        return f"receiver {self.plan.transfer_id.hex()} attempt {self.attempt}"

    def _classify(self, message: Message, new_attempt: bool) -> ReceiverEvent:
        if isinstance(message, Hello):
            return _E.HELLO if new_attempt else _E.UNEXPECTED
        if new_attempt:  # every attempt opens with a Hello
            return _E.UNEXPECTED
        return _EVENTS.get(type(message), _E.UNEXPECTED)

    def _check_lease(self) -> None:
        if self._guard is not None:
            try:
                self._guard()
            except LeaseError as e:
                self._reject(NackCode.LEASE, e)

    def _require_ledger(self) -> ChunkLedger:
        if self._ledger is None:  # unreachable: RECEIVING is entered only with a ledger
            raise ProtocolError(f"{self._who}: no Begin accepted in this attempt")
        return self._ledger

    def _reply(self, message: Message) -> Outbound:
        envelope = Envelope(self.plan.transfer_id, max(self.attempt, 0), self._send_seq)
        self._send_seq += 1
        return Outbound(envelope, message)

    def _discard_attempt(self) -> None:
        # Blocks already written stay unverified: only a later complete attempt commits them.
        if not self.verified:
            self._ledger = None
            self.begin = None
        self.pending_chunk = None

    def _refuse(self, code: NackCode, error: Callable[[str], PdserveError], text: str) -> NoReturn:
        self._reject(code, error(f"{self._who}: {text}"))

    def _reject(self, code: NackCode, error: PdserveError) -> NoReturn:
        self.state = transition(RECEIVER_TRANSITIONS, self.state, _E.REJECT, self._who)
        self._discard_attempt()
        self._outbox.append(self._reply(Nack(code, str(error)[:512], NACK_RETRYABLE[code])))
        raise error


_EVENTS: Mapping[type, ReceiverEvent] = {
    Begin: _E.BEGIN,
    Chunk: _E.CHUNK,
    Commit: _E.COMMIT,
    Renew: _E.RENEW,
    Abort: _E.ABORT,
}
