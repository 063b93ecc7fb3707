"""`FaultyStream`: a `ByteStream` wrapper that injects seeded faults into sends.

The faults really change what the peer receives, so the receiver's checks (checksums, counts,
deadlines) are what detect them:

    DELAY     sleep `delay_s`, then send normally; with a byte offset, send that many bytes
              first and sleep in the middle of the send (a process paused mid-frame)
    DROP      swallow the whole send (the caller sees success)
    CORRUPT   flip one bit at a byte offset; only that byte is copied (the view is split around
              it), the caller's memory (KV blocks) is never written
    TRUNCATE  send a prefix of `byte_offset` bytes, then close (the caller sees success, as
              when a kernel accepted bytes that never arrive)
    CLOSE     close before sending anything; the send raises `PeerClosed`
    STALL     block until cancelled (the caller's deadline), sending nothing

A `FaultPlan` lists faults by send index, or draws them with a probability. Every draw comes
from an RNG seeded by (plan seed, send index), so a plan gives the same faults at the same
places in every run and process. Receives and `aclose` pass straight through.

`InjectorStream` applies the same actions (`apply_send_fault`) as decided by a process's
`pdserve.faults.FaultInjector` at the `transfer.send` site, plus crash (the process dies).

This module knows bytes and send counts only: no frames, no sessions.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from pdserve.errors import PeerClosed
from pdserve.faults import FaultInjector, FaultKind, FaultSite, crash
from pdserve.transfer.stream import DEFAULT_RECEIVE_BYTES, Buffer, ByteStream, byte_views

# One vocabulary with the process-wide fault sites (`pdserve.faults`); a send can suffer every
# kind but crash, which belongs to a process, not to a send.
FaultAction = FaultKind
SEND_ACTIONS: tuple[FaultAction, ...] = tuple(k for k in FaultKind if k is not FaultKind.CRASH)


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault on send number `send_index` (0-based, counting every send call)."""

    action: FaultAction
    send_index: int
    # CORRUPT: the byte to damage; TRUNCATE: the prefix length. None: drawn from the seed.
    byte_offset: int | None = None


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Which sends fail, and how: listed `faults`, plus random ones with `probability`."""

    faults: tuple[Fault, ...] = ()
    # Chance that a send not listed in `faults` gets a fault drawn from `actions`.
    probability: float = 0.0
    actions: tuple[FaultAction, ...] = SEND_ACTIONS
    seed: int = 0
    delay_s: float = 0.01

    def __post_init__(self) -> None:
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"FaultPlan: probability must be in [0, 1], got {self.probability}")
        if self.probability and not self.actions:
            raise ValueError("FaultPlan: probability > 0 needs at least one action")
        bad = [
            a for a in (*self.actions, *(f.action for f in self.faults)) if a not in SEND_ACTIONS
        ]
        if bad:
            raise ValueError(f"FaultPlan: {bad[0].value} is not an action on a send")

    def fault_for(self, send_index: int, num_bytes: int) -> InjectedFault | None:
        """The fault for this send, with its byte offset resolved (deterministic per seed)."""
        rng = random.Random(f"pdserve-fault:{self.seed}:{send_index}")
        listed = [f for f in self.faults if f.send_index == send_index]
        if listed:
            action, offset = listed[0].action, listed[0].byte_offset
        elif self.probability and rng.random() < self.probability:
            action, offset = rng.choice(self.actions), None
        else:
            return None
        if offset is None:
            offset = rng.randrange(num_bytes) if num_bytes else 0
        # A corrupted byte must exist; a truncation may keep the whole send (then just close).
        limit = num_bytes - 1 if action is FaultAction.CORRUPT else num_bytes
        return InjectedFault(send_index, action, max(0, min(offset, limit)), rng.randrange(8))


@dataclass(frozen=True, slots=True)
class InjectedFault:
    """A fault as applied: tests compare these lists across runs of the same seed."""

    send_index: int
    action: FaultAction
    byte_offset: int
    bit: int


class _SendFaultStream(ByteStream):
    """A stream whose sends may be damaged; receives and closing pass through to `inner`."""

    inner: ByteStream

    async def receive_into(self, view: memoryview) -> None:
        """Pass through to `inner`."""
        await self.inner.receive_into(view)

    async def receive_some(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        """Pass through to `inner`."""
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        """Pass through to `inner`."""
        await self.inner.aclose()


class FaultyStream(_SendFaultStream):
    """Wraps `inner`, applying `plan` to each send; `injected` records what was done."""

    def __init__(
        self,
        inner: ByteStream,
        plan: FaultPlan,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.inner = inner
        self.plan = plan
        self.injected: list[InjectedFault] = []
        self._sleep = sleep
        self._num_sends = 0

    async def send(self, buffers: Sequence[Buffer]) -> None:
        """Send through `inner`, unless the plan puts a fault on this send."""
        views = byte_views(buffers)
        fault = self.plan.fault_for(self._num_sends, sum(v.nbytes for v in views))
        self._num_sends += 1
        if fault is None:
            await self.inner.send(views)
            return
        self.injected.append(fault)
        await apply_send_fault(
            self.inner,
            views,
            fault.action,
            fault.byte_offset,
            fault.bit,
            self.plan.delay_s,
            self._sleep,
            f"send {fault.send_index}",
        )


async def apply_send_fault(
    inner: ByteStream,
    views: list[memoryview],
    action: FaultAction,
    byte_offset: int,
    bit: int,
    delay_s: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    where: str = "",
) -> None:
    """Do `action` to one send of `views` on `inner` (the table above).

    `byte_offset` is the corrupted byte or the truncated prefix's length, already in range.
    """
    match action:
        case FaultAction.DELAY:
            if byte_offset:
                await inner.send(_prefix(views, byte_offset))
                await sleep(delay_s)
                await inner.send(_suffix(views, byte_offset))
            else:
                await sleep(delay_s)
                await inner.send(views)
        case FaultAction.DROP:
            pass
        case FaultAction.CORRUPT:
            await inner.send(_flip_bit(views, byte_offset, bit))
        case FaultAction.TRUNCATE:
            await inner.send(_prefix(views, byte_offset))
            await inner.aclose()
        case FaultAction.CLOSE:
            await inner.aclose()
            raise PeerClosed(f"faulty stream: closed at {where}")
        case FaultAction.STALL:
            await asyncio.Event().wait()


class InjectorStream(_SendFaultStream):
    """Wraps `inner`, asking a process's `FaultInjector` at `transfer.send` on each send.

    The rule's bytes-level actions are applied as `FaultyStream` applies a plan's; crash kills
    the process. Unlike a `FaultyStream`, the hit count is the injector's, shared by every
    stream of the process, so `after=N` means after N sends of any transfer.
    `fired` says whether any rule acted on this stream (a pool must then not reuse it).
    """

    def __init__(self, inner: ByteStream, faults: FaultInjector) -> None:
        self.inner = inner
        self._faults = faults
        self.fired = False

    async def send(self, buffers: Sequence[Buffer]) -> None:
        """Send through `inner`, unless the injector fires a rule on this send."""
        views = byte_views(buffers)
        num_bytes = sum(v.nbytes for v in views)
        rule = self._faults.fire(FaultSite.TRANSFER_SEND, num_bytes)
        if rule is None:
            await self.inner.send(views)
            return
        self.fired = True
        if rule.action is FaultKind.CRASH:
            crash(rule)
        action = rule.action
        offset = rule.offset or 0
        # As FaultPlan: a corrupted byte must exist, a truncation may keep the whole send.
        limit = num_bytes - 1 if action is FaultAction.CORRUPT else num_bytes
        offset = max(0, min(offset, limit))
        # The flipped bit follows from the offset, so a spec with an offset fixes the damage.
        await apply_send_fault(
            self.inner, views, action, offset, offset % 8, rule.delay_s, where=rule.spec()
        )


def _flip_bit(views: list[memoryview], offset: int, bit: int) -> list[memoryview]:
    """`views` with one bit flipped at `offset`.

    The affected view is split around a one-byte copy, so nothing large is copied and the
    caller's memory is never written.
    """
    out: list[memoryview] = []
    for i, view in enumerate(views):
        if 0 <= offset < view.nbytes:
            damaged = memoryview(bytes([view[offset] ^ (1 << bit)]))
            out += [view[:offset], damaged, view[offset + 1 :], *views[i + 1 :]]
            return out
        out.append(view)
        offset -= view.nbytes
    return out


def _suffix(views: list[memoryview], num_bytes: int) -> list[memoryview]:
    """`views` without their first `num_bytes`, as view slices."""
    out: list[memoryview] = []
    for view in views:
        if num_bytes >= view.nbytes:
            num_bytes -= view.nbytes
            continue
        out.append(view[num_bytes:])
        num_bytes = 0
    return out


def _prefix(views: list[memoryview], num_bytes: int) -> list[memoryview]:
    """The first `num_bytes` of `views`, as view slices."""
    out: list[memoryview] = []
    for view in views:
        if num_bytes <= 0:
            break
        out.append(view[:num_bytes])
        num_bytes -= view.nbytes
    return out
