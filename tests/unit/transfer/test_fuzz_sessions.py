"""Fuzz: both transfer session state machines (`ReceiverSession`, `SenderSession`) driven by
damaged and hostile frames, through the real codec.

What is fuzzed:
- The receiver gets the frames of one or two attempts of a valid sender script after
  frame-level and structure-aware edits (`wire_fuzz.damaged_frames`: frames dropped,
  duplicated, swapped, spliced, foreign frames inserted, header fields, bodies and Chunk data
  rewritten with valid checksums), interleaved with its lease lapsing, local aborts, landed data
  that differs from what the frame carried, and stray data reports.
- A sender and a receiver talk through a network that drops, duplicates, reorders and
  corrupts frames (honest faults), or that also rewrites and injects valid frames (hostile).

Properties: every call with peer input returns or raises a `PdserveError`, and the sender's
next legal call in its state never raises; a receiver's refusal either changes nothing or
fails the attempt with exactly one Nack, a sender's changes nothing or fails the attempt;
`verified` never goes back, and it is reached only when the bytes landed in the attempt are
exactly the sender's payload; every reply a session produces encodes and decodes; over an
honest network a sender is done (its KV releasable) only after the receiver verified the
commit. (Over a hostile one it may not be: Acks carry no MAC, so a rewritten Ack(COMMIT) ends
a sender early; the receiver still never schedules unverified KV.)

Budget: 150 + 100 examples, fixed seed (`fuzz_support`): about 2.5 s of CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from frame_decoder import FrameDecoder
from fuzz_support import fuzz_settings, note, one_in
from hypothesis import given
from hypothesis import strategies as st
from wire_fuzz import FP, KEY, SPEC, damaged_frames, foreign_frames, frame, script

from pdserve.errors import (
    IllegalTransition,
    LeaseExpired,
    PdserveError,
    ProtocolError,
    StaleLease,
)
from pdserve.transfer.byte_ranges import split_payload
from pdserve.transfer.codec import Frame, data_checksum
from pdserve.transfer.messages import Ack, AckOf, Chunk, Commit, Nack, Renew
from pdserve.transfer.receiver_session import ReceivePlan, ReceiverSession, ReceiverState
from pdserve.transfer.sender_session import SenderSession, SenderState
from pdserve.transfer.session import Outbound

PLAN = ReceivePlan(
    SPEC.transfer_id,
    SPEC.token,
    SPEC.layout,
    SPEC.request_id,
    SPEC.num_tokens,
    SPEC.token_digest,
    epoch=SPEC.epoch,
)
_LEDGER_STATES = (ReceiverState.RECEIVING, ReceiverState.CHUNK_PENDING)


def decode_one(raw: bytes) -> Frame | None:
    """The frame in `raw` if it is exactly one valid frame (else None: the codec's fuzz covers
    what cannot be decoded; only decodable frames reach a session)."""
    try:
        frames = FrameDecoder().feed(raw)
    except ProtocolError:
        return None
    return frames[0] if len(frames) == 1 else None


def wire(out: Outbound, data: bytes = b"") -> bytes:
    """An outbound message framed by the real encoder: every reply must encode."""
    return frame(out.message, data, out.envelope)


@dataclass
class LeaseStub:
    """The reservation's lease as the receiver sees it: live until the fuzz lets it lapse."""

    lapsed: bool = False

    def guard(self) -> None:
        if self.lapsed:
            raise LeaseExpired("reservation lease lapsed")

    def renew(self, renew: Renew) -> None:
        self.guard()
        if renew.epoch != SPEC.epoch:
            raise StaleLease(f"renew names epoch {renew.epoch}, lease has {SPEC.epoch}")


@dataclass
class ReceiverHarness:
    """A receiver session with the test's record of what landed in its current ledger."""

    lease: LeaseStub = field(default_factory=LeaseStub)
    session: ReceiverSession = field(init=False)
    # (chunk, bytes that landed) accepted since the current ledger was opened.
    landed: list[tuple[Chunk, bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.session = ReceiverSession(
            PLAN, FP, guard=self.lease.guard, renew=self.lease.renew, cluster_key=KEY
        )

    def apply(
        self, call: Callable[[], list[Outbound]], commit: Commit | None = None
    ) -> tuple[bool, list[Outbound]]:
        """Run one session call and check the properties around it: (succeeded, replies)."""
        session = self.session
        before = (session.state, session.attempt, session.verified)
        try:
            replies = call()
        except PdserveError as exc:
            note(f"receiver refused: {type(exc).__name__}")
            replies = session.take_outgoing()
            if replies:  # a failed check: one Nack, the attempt is over
                assert [type(r.message) for r in replies] == [Nack]
                want = ReceiverState.COMMITTED if before[2] else ReceiverState.FAILED
                assert session.state is want
            else:  # refused before anything changed
                assert (session.state, session.attempt, session.verified) == before
            ok = False
        else:
            ok = True
        for reply in replies:
            assert decode_one(wire(reply)) is not None
        if before[2]:
            assert session.verified  # verified is for good
        elif session.verified:
            self.check_verified(commit)
        if session.state not in _LEDGER_STATES or session.attempt != before[1]:
            self.landed.clear()
        return ok, replies

    def check_verified(self, commit: Commit | None) -> None:
        """Only the sender's exact payload, all of it, in one attempt, ever verifies."""
        note("receiver verified")
        assert commit is not None and self.session.value_digest == commit.value_digest
        covered = bytearray(len(SPEC.payload))
        for chunk, data in self.landed:
            assert data == SPEC.payload[chunk.offset : chunk.offset + chunk.num_bytes]
            covered[chunk.offset : chunk.offset + chunk.num_bytes] = data
        assert bytes(covered) == SPEC.payload
        assert sum(chunk.num_bytes for chunk, _ in self.landed) == len(SPEC.payload)

    def deliver(self, received: Frame, corrupt_landing: bool) -> list[Outbound]:
        """A frame from the sender (a Chunk's data lands, possibly not as sent); the replies."""
        session = self.session
        message = received.message
        commit = message if isinstance(message, Commit) else None
        ok, replies = self.apply(lambda: session.receive(received.header, message), commit)
        if ok and isinstance(message, Chunk) and session.state is ReceiverState.CHUNK_PENDING:
            data = received.data
            if corrupt_landing:
                data = bytes([data[0] ^ 0x01]) + data[1:]
            landed, more = self.apply(lambda: session.data_received(data_checksum([data])))
            if landed:
                self.landed.append((message, data))
            replies += more
        return replies


Step = tuple[str, bytes, bool]  # (what, frame bytes, whether its data lands damaged)


@st.composite
def receiver_inputs(draw: st.DrawFn) -> list[Step]:
    """A damaged script of one or two attempts, with other events interleaved."""
    frames = script(SPEC, attempt=1)
    if draw(st.booleans()):
        frames += script(SPEC, attempt=draw(st.sampled_from([1, 2, 3])))
    steps: list[Step] = []
    for raw in draw(damaged_frames(frames, max_edits=4)):
        while draw(one_in(10)):
            steps.append((draw(st.sampled_from(["lapse", "abort", "stray_data"])), b"", False))
        steps.append(("frame", raw, draw(one_in(20))))
    return steps


@fuzz_settings(150)
@given(receiver_inputs())
def test_the_receiver_session_types_every_refusal_and_verifies_only_the_payload(
    steps: list[Step],
) -> None:
    harness = ReceiverHarness()
    session = harness.session
    for kind, raw, corrupt_landing in steps:
        if kind == "frame":
            received = decode_one(raw)
            if received is not None:
                harness.deliver(received, corrupt_landing)
        elif kind == "lapse":
            harness.lease.lapsed = True
        elif kind == "abort":
            harness.apply(lambda: [session.abort("deadline passed")])
        else:
            harness.apply(lambda: session.data_received(0))
    note(f"final state {session.state.name}")


# ---- sender and receiver through a faulty network ------------------------------------------


@dataclass
class Network:
    """The frames in flight in each direction of one transfer."""

    to_receiver: list[bytes] = field(default_factory=list)
    to_sender: list[bytes] = field(default_factory=list)


def next_step(sender: SenderSession, sent: list[Chunk]) -> Callable[[], Outbound] | None:
    """The sender's legal next call in its state (None while it waits for a reply)."""
    state = sender.state
    if state is SenderState.IDLE:
        return sender.send_hello
    if state is SenderState.READY:
        sent.clear()
        return lambda: sender.send_begin(SPEC.begin())
    if state is SenderState.SENDING:
        pieces = list(split_payload(len(SPEC.payload), 80))
        if len(sent) < len(pieces):
            offset, num = pieces[len(sent)]
            data = SPEC.payload[offset : offset + num]
            chunk = Chunk(offset, num, data_checksum([data]))
            sent.append(chunk)
            return lambda: sender.send_chunk(chunk)
        return lambda: sender.send_commit(SPEC.value_digest)
    if state is SenderState.FAILED:
        return lambda: (sender.restart(), sender.send_hello())[1]
    return None


FAULTS = ["deliver"] * 24 + ["drop", "duplicate", "reorder", "flip", "rewrite", "rewrite"]


@st.composite
def network_faults(draw: st.DrawFn, frames: list[bytes], hostile: bool) -> list[bytes]:
    """What the network does to the frames queued in one direction before delivering the
    first: usually nothing; honest faults (drop, duplicate, reorder, flip a bit); and, on a
    hostile network, rewrites that keep the checksums valid."""
    kind = draw(st.sampled_from(FAULTS))
    if kind == "drop":
        return frames[1:]
    if kind == "duplicate":
        return [frames[0], *frames]
    if kind == "reorder":
        return [*frames[1:], frames[0]]
    if kind == "flip":
        raw = bytearray(frames[0])
        bit = draw(st.integers(0, len(raw) * 8 - 1))
        raw[bit // 8] ^= 1 << (bit % 8)
        return [bytes(raw), *frames[1:]]
    if kind == "rewrite" and hostile:
        return [*draw(damaged_frames(frames[:1], max_edits=1)), *frames[1:]]
    return frames


def payload_of(chunk: Chunk) -> bytes:
    return SPEC.payload[chunk.offset : chunk.offset + chunk.num_bytes]


WAITING = (SenderState.HELLO_SENT, SenderState.BEGIN_SENT, SenderState.COMMIT_SENT)


@fuzz_settings(100)
@given(st.booleans(), st.data())
def test_sender_and_receiver_over_a_faulty_network(hostile: bool, data: st.DataObject) -> None:
    """Rounds of: the sender sends what it can, the network delivers each direction (with
    faults), a sender whose reply is lost times out and retries; a hostile network also
    injects frames."""
    sender = SenderSession(SPEC.transfer_id, FP, cluster_key=KEY)
    receiver = ReceiverHarness()
    net = Network()
    sent: list[Chunk] = []
    for _ in range(data.draw(st.integers(1, 12))):
        while (call := next_step(sender, sent)) is not None:
            out = call()  # the sender's legal API in its state never raises
            chunk = out.message if isinstance(out.message, Chunk) else None
            net.to_receiver.append(wire(out, payload_of(chunk) if chunk else b""))
        while net.to_receiver:
            net.to_receiver = data.draw(network_faults(net.to_receiver, hostile))
            received = decode_one(net.to_receiver.pop(0)) if net.to_receiver else None
            if received is not None:
                replies = receiver.deliver(received, corrupt_landing=False)
                net.to_sender += [wire(r) for r in replies]
        while net.to_sender:
            net.to_sender = data.draw(network_faults(net.to_sender, hostile))
            if net.to_sender:
                deliver_to_sender(sender, net.to_sender.pop(0), receiver.session, hostile)
        if hostile and data.draw(one_in(4)):
            deliver_to_sender(sender, data.draw(foreign_frames()), receiver.session, hostile)
        if sender.state in WAITING:
            sender.restart()  # its reply was lost: a new attempt, as its retry loop does
    note(f"sender {sender.state.name}, receiver {receiver.session.state.name}")


def deliver_to_sender(
    sender: SenderSession, raw: bytes, receiver: ReceiverSession, hostile: bool
) -> None:
    """One frame to the sender; it either acts on it or refuses it with a typed error."""
    received = decode_one(raw)
    if received is None:
        return
    before = (sender.state, sender.attempt)
    try:
        sender.receive(received.header, received.message)
    except PdserveError as exc:
        # Refused before anything changed, or (a Nack, a reply failing a check) the attempt
        # failed; an illegal event always changes nothing.
        note(f"sender refused: {type(exc).__name__}")
        unchanged = (sender.state, sender.attempt) == before
        assert unchanged or sender.state is SenderState.FAILED
        assert unchanged or not isinstance(exc, IllegalTransition)
    if sender.lease_releasable and before[0] is not SenderState.DONE:
        message = received.message
        assert isinstance(message, Ack) and message.of is AckOf.COMMIT
        if not hostile:  # honest faults never make a sender release unverified KV
            assert receiver.verified
        note("sender done")


def test_the_fuzz_reaches_verification_on_an_undamaged_script() -> None:
    """The harness itself: an undamaged script verifies (so the properties above bite)."""
    harness = ReceiverHarness()
    for raw in script(SPEC):
        received = decode_one(raw)
        assert received is not None
        harness.deliver(received, corrupt_landing=False)
    assert harness.session.verified
    with pytest.raises(PdserveError):
        harness.session.receive(received.header, received.message)  # a repeat: refused
