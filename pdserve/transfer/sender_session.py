"""`SenderSession`: the prefill side of one KV transfer, as a transition table (sans-I/O).

Life cycle of one attempt (the table below is the whole truth):

    IDLE ─send_hello→ HELLO_SENT ─Hello→ READY ─send_begin→ BEGIN_SENT ─Ack(BEGIN)→ SENDING
    SENDING ─send_chunk→ SENDING ─send_commit→ COMMIT_SENT ─Ack(COMMIT)→ DONE
    BEGIN_SENT ─Ack(COMMIT)→ DONE        (the receiver had already committed an earlier attempt)
    any open state ─Nack / bad reply→ FAILED ─restart→ IDLE (attempt + 1);  ─Abort→ ABORTED

Invariants:
- The lease on the prefill KV is reported releasable (`SenderAction.RELEASE_LEASE`) only on
  Ack(COMMIT), i.e. once the receiver verified everything. A Nack, a timeout or a restart
  keep the KV held: a retry resends from the same snapshot.
- An illegal call or reply raises IllegalTransition and leaves the state unchanged; a reply
  from an older attempt raises StaleAttempt and is otherwise ignored.
- Chunks are in bounds and never overlap; Commit is built from the chunks actually sent.
- With a cluster key, the receiver's Hello must carry a valid MAC under it before the sender
  goes on: KV is only ever sent to a cluster member.

It knows messages, envelopes and byte offsets; not sockets, KV memory, leases or schedulers.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum, auto
from typing import NoReturn

from pdserve.errors import (
    IllegalTransition,
    ProtocolError,
    StaleAttempt,
    TransferRefused,
)
from pdserve.transfer import handshake, messages, session
from pdserve.transfer.codec import Envelope, FrameHeader


class SenderState(Enum):
    IDLE = auto()
    HELLO_SENT = auto()
    READY = auto()
    BEGIN_SENT = auto()
    SENDING = auto()
    COMMIT_SENT = auto()
    DONE = auto()
    FAILED = auto()
    ABORTED = auto()


class SenderEvent(Enum):
    SEND_HELLO = auto()
    RECV_HELLO = auto()
    SEND_BEGIN = auto()
    RECV_ACK_BEGIN = auto()
    SEND_CHUNK = auto()
    SEND_COMMIT = auto()
    RECV_ACK_COMMIT = auto()
    SEND_RENEW = auto()
    RECV_ACK_RENEW = auto()
    RECV_NACK = auto()
    RECV_ABORT = auto()
    RECV_UNEXPECTED = auto()  # Begin/Chunk/Commit/Renew from the receiver: never legal
    SEND_ABORT = auto()
    FAIL = auto()  # a reply that fails a local check (fingerprint, version, sequence)
    RESTART = auto()


class SenderAction(Enum):
    """What the caller should do after a reply."""

    NONE = auto()
    SEND_BEGIN = auto()  # handshake verified
    SEND_CHUNKS = auto()  # Begin accepted
    RELEASE_LEASE = auto()  # commit acknowledged: the prefill KV may be released
    STOP = auto()  # the receiver aborted the transfer


_S, _E = SenderState, SenderEvent
_OPEN = (_S.HELLO_SENT, _S.READY, _S.BEGIN_SENT, _S.SENDING, _S.COMMIT_SENT)
_RENEWABLE = (_S.READY, _S.BEGIN_SENT, _S.SENDING, _S.COMMIT_SENT)

SENDER_TRANSITIONS: Mapping[tuple[SenderState, SenderEvent], SenderState] = {
    (_S.IDLE, _E.SEND_HELLO): _S.HELLO_SENT,
    (_S.HELLO_SENT, _E.RECV_HELLO): _S.READY,
    (_S.READY, _E.SEND_BEGIN): _S.BEGIN_SENT,
    (_S.BEGIN_SENT, _E.RECV_ACK_BEGIN): _S.SENDING,
    (_S.BEGIN_SENT, _E.RECV_ACK_COMMIT): _S.DONE,
    (_S.SENDING, _E.SEND_CHUNK): _S.SENDING,
    (_S.SENDING, _E.SEND_COMMIT): _S.COMMIT_SENT,
    (_S.COMMIT_SENT, _E.RECV_ACK_COMMIT): _S.DONE,
    **{(s, _E.SEND_RENEW): s for s in _RENEWABLE},
    **{(s, _E.RECV_ACK_RENEW): s for s in _RENEWABLE},
    **{(s, _E.RECV_NACK): _S.FAILED for s in _OPEN},
    **{(s, _E.FAIL): _S.FAILED for s in _OPEN},
    **{(s, _E.RECV_ABORT): _S.ABORTED for s in _OPEN},
    **{(s, _E.SEND_ABORT): _S.ABORTED for s in (_S.IDLE, *_OPEN, _S.FAILED)},
    **{(s, _E.RESTART): _S.IDLE for s in (*_OPEN, _S.FAILED)},
}

_REPLY_EVENTS = {
    messages.AckOf.BEGIN: _E.RECV_ACK_BEGIN,
    messages.AckOf.COMMIT: _E.RECV_ACK_COMMIT,
    messages.AckOf.RENEW: _E.RECV_ACK_RENEW,
}


class SenderSession:
    """One transfer from the sending side; `attempt` grows by one on every `restart`."""

    def __init__(
        self,
        transfer_id: bytes,
        fingerprint: session.FingerprintMap,
        *,
        role: messages.Role = messages.Role.PREFILL,
        attempt: int = 1,
        compare: session.FingerprintCompare = session.fingerprint_diff,
        cluster_key: bytes | None = None,
        peer_instance: bytes = b"",
    ) -> None:
        """`peer_instance`: the receiving process's life the transfer was reserved with (b"":
        any); a receiver restarted since refuses the Hello (STALE_INSTANCE)."""
        self.transfer_id = transfer_id
        self._role = role
        self._fingerprint = dict(fingerprint)
        self._key = cluster_key
        self._peer_instance = peer_instance
        self._compare = compare
        self.state = SenderState.IDLE
        self.attempt = attempt
        self._send_seq = 0
        self._recv_seq = 0
        self._ledger: session.ChunkLedger | None = None

    # ---- outgoing: each returns what to frame and send -------------------------------------

    def send_hello(self) -> session.Outbound:
        """Open the attempt with this side's fingerprint (and MAC, with a cluster key)."""
        own = handshake.own_hello(
            self._key,
            self._role,
            self.transfer_id,
            self.attempt,
            self._fingerprint,
            self._peer_instance,
        )
        return self._send(_E.SEND_HELLO, own)

    def send_begin(self, begin: messages.Begin) -> session.Outbound:
        """Announce the transfer (its layout bounds every later chunk)."""
        self._check(_E.SEND_BEGIN)
        if begin.transfer_id != self.transfer_id:
            raise ValueError("Begin.transfer_id differs from the session's")
        self._ledger = session.ChunkLedger(begin.layout)
        return self._send(_E.SEND_BEGIN, begin)

    def send_chunk(self, chunk: messages.Chunk) -> session.Outbound:
        """Send blocks `[chunk.first_block, +num_blocks)`; ValueError if out of range/overlapping."""
        self._check(_E.SEND_CHUNK)
        ledger = self._require_ledger()
        problem = ledger.problem(chunk)
        if problem is not None:
            raise ValueError(problem[1])
        ledger.add(chunk)
        return self._send(_E.SEND_CHUNK, chunk)

    def send_commit(self, value_digest: bytes = b"") -> session.Outbound:
        """Close the data (with the KV's value digest, if any); ValueError unless every byte
        of the transfer was sent."""
        self._check(_E.SEND_COMMIT)
        ledger = self._require_ledger()
        if not ledger.complete:
            raise ValueError(f"commit before every byte was sent ({ledger.num_bytes} bytes)")
        commit = messages.Commit(ledger.digest(), ledger.num_chunks, ledger.num_bytes, value_digest)
        return self._send(_E.SEND_COMMIT, commit)

    def send_renew(self, lease_id: int, epoch: int, ttl: float) -> session.Outbound:
        """Ask the receiver to extend its reservation lease by `ttl` seconds."""
        return self._send(_E.SEND_RENEW, messages.Renew(lease_id, epoch, ttl))

    def send_abort(self, reason: str) -> session.Outbound:
        """Give the transfer up for good."""
        return self._send(_E.SEND_ABORT, messages.Abort(reason))

    def restart(self) -> None:
        """Start a new attempt (after a failure or a timeout): attempt + 1, back to IDLE."""
        self.state = session.transition(SENDER_TRANSITIONS, self.state, _E.RESTART, self._who)
        self.attempt += 1
        self._send_seq = self._recv_seq = 0
        self._ledger = None

    # ---- incoming ----------------------------------------------------------------------------

    def receive(self, header: FrameHeader, message: messages.Message) -> SenderAction:
        """Apply one reply from the receiver; raises on Nack and on a reply that fails a check."""
        if header.transfer_id != self.transfer_id:
            raise ProtocolError(f"{self._who}: frame for another transfer")
        if header.attempt < self.attempt:
            raise StaleAttempt(f"{self._who}: reply from attempt {header.attempt}")
        if header.attempt > self.attempt:
            raise ProtocolError(f"{self._who}: reply from future attempt {header.attempt}")
        event = self._classify(message)
        next_state = session.transition(SENDER_TRANSITIONS, self.state, event, self._who)
        if header.seq != self._recv_seq:
            self._fail(
                ProtocolError(f"{self._who}: reply seq {header.seq}, expected {self._recv_seq}")
            )
        self._recv_seq += 1
        if isinstance(message, messages.Hello):
            self._verify_hello(header, message)
        elif isinstance(message, messages.Nack):
            self.state = next_state
            raise TransferRefused(f"{message.code.name}: {message.text}", message.retryable)
        self.state = next_state
        return _ACTIONS.get(event, SenderAction.NONE)

    @property
    def lease_releasable(self) -> bool:
        """True only after the receiver acknowledged the commit."""
        return self.state is SenderState.DONE

    # ---- internals ---------------------------------------------------------------------------

    @property
    def _who(self) -> str:
        return f"sender {self.transfer_id.hex()} attempt {self.attempt}"

    def _check(self, event: SenderEvent) -> None:
        session.transition(SENDER_TRANSITIONS, self.state, event, self._who)

    def _require_ledger(self) -> session.ChunkLedger:
        # SENDING is reachable only through send_begin, which creates the ledger.
        if self._ledger is None:
            raise IllegalTransition(f"{self._who}: no Begin was sent in this attempt")
        return self._ledger

    def _send(self, event: SenderEvent, message: messages.Message) -> session.Outbound:
        self.state = session.transition(SENDER_TRANSITIONS, self.state, event, self._who)
        envelope = Envelope(self.transfer_id, self.attempt, self._send_seq)
        self._send_seq += 1
        return session.Outbound(envelope, message)

    def _classify(self, message: messages.Message) -> SenderEvent:
        if isinstance(message, messages.Hello):
            return _E.RECV_HELLO
        if isinstance(message, messages.Ack):
            return _REPLY_EVENTS[message.of]
        if isinstance(message, messages.Nack):
            return _E.RECV_NACK
        if isinstance(message, messages.Abort):
            return _E.RECV_ABORT
        return _E.RECV_UNEXPECTED

    def _verify_hello(self, header: FrameHeader, hello: messages.Hello) -> None:
        # The receiver is the one that refuses; checking here too keeps a buggy or old receiver
        # from ever being sent KV.
        want = handshake.peer_mac(self._key, header, hello)
        problem = handshake.problem(hello, want, self._fingerprint, self._compare, self._who)
        if problem is not None:
            self._fail(problem[1])

    def _fail(self, error: Exception) -> NoReturn:
        self.state = session.transition(SENDER_TRANSITIONS, self.state, _E.FAIL, self._who)
        raise error


_ACTIONS = {
    _E.RECV_HELLO: SenderAction.SEND_BEGIN,
    _E.RECV_ACK_BEGIN: SenderAction.SEND_CHUNKS,
    _E.RECV_ACK_COMMIT: SenderAction.RELEASE_LEASE,
    _E.RECV_ABORT: SenderAction.STOP,
}
