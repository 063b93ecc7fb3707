"""`ByteStream` over NIXL (UCX backend, DRAM): bulk bytes by one-sided WRITE into the peer.

Each end creates a NIXL agent and a registered, pre-touched inbox of `num_slots` slots, and
swaps agent metadata (which names the inbox registration) over a TCP control stream. A bulk send
registers the caller's views for the duration of a slot write, issues one NIXL WRITE from them
(gathered, no Python copy) into a free slot of the peer's inbox, waits for completion and
announces the slot with a DATA frame; the receiver copies the slot into the caller's view and
returns the credit (`slot_stream` holds that protocol, and sends small messages INLINE on the
control stream, never through NIXL).

Progress: on one host UCX writes through cma (process_vm_writev), which the *initiator* runs
inside the WRITE call: the write is complete on return and the target does nothing (measured:
8 MiB in ~1.4 ms, no completion polls, with the target not progressing at all once wired up).
Where UCX must emulate the WRITE over TCP (no cma, no RDMA), the target has to drive it: such a
write is not complete on return, so the sender then sends a WRITING frame, and the receiver's
progress task spins (yielding to the loop) while announced writes are outstanding, capped at
`_FAST_WINDOW_S` per announcement; otherwise it wakes every `_IDLE_POLL_S` for UCX
housekeeping (connection wireup, keepalive). The UCX progress thread would spin a core per
agent, so it is off; an idle stream costs one wake-up per `_IDLE_POLL_S` and no spinning. The
sender polls its own incomplete write likewise (spinning `_SPIN_S`, then sleeping).

`nixl` is imported lazily: `nixl_available()` says whether this build can use it.
This module knows agents, registrations and the handshake, not the KV codec or sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.errors import BadMagic, PeerClosed, ProtocolError, TransferError, UnsupportedVersion
from pdserve.transfer.slot_stream import SlotStream, SlotWrite
from pdserve.transfer.stream import ByteStream
from pdserve.transfer.tcp import Upgraded

_HELLO = struct.Struct("<4sHHIQQI")  # magic, version, 0, num_slots, slot_bytes, address, md len
# A NIXL agent's metadata is a few KiB; more is refused before it is read.
MAX_METADATA_BYTES = 1 << 20
_MAGIC = b"PDNX"
_VERSION = 1
_ATTACHED = b"A"
# Python's epoll rounds sleeps up to 1 ms, so short waits spin on sleep(0) instead.
_SPIN_S = 5e-3
_SLOW_POLL_S = 1e-3
_IDLE_POLL_S = 0.05
_FAST_WINDOW_S = 1.0
# How long a cancelled send waits for an in-flight WRITE to finish before giving up on it.
_DRAIN_S = 2.0


@functools.cache
def nixl_available() -> bool:
    """True when the nixl package and its UCX plugin import in this environment."""
    try:
        import nixl._api  # noqa: F401
    except Exception:
        return False
    return True


@dataclass(frozen=True, slots=True)
class NixlConfig:
    """Inbox geometry and progress settings of each end."""

    num_slots: int = 8
    slot_bytes: int = 8 << 20
    # A UCX progress thread costs a spinning core; the polling task is the default.
    progress_thread: bool = False


def _address(view: memoryview) -> int:
    """The address of a byte view's first byte (read-only views included)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _transfer_error(where: str, exc: Exception) -> TransferError:
    if "Disconnect" in type(exc).__name__:
        return PeerClosed(f"nixl {where}: peer disconnected: {exc}")
    return TransferError(f"nixl {where}: {type(exc).__name__}: {exc}")


class _Endpoint:
    """One agent with its registered inbox; lives as long as one stream."""

    def __init__(self, config: NixlConfig) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)  # it logs INFO to stdout
        self.name = f"pdserve-{os.getpid()}-{secrets.token_hex(6)}"
        agent_config = nixl_agent_config(
            enable_prog_thread=config.progress_thread, backends=["UCX"]
        )
        self.agent: Any = nixl_agent(self.name, agent_config)
        self.inbox = np.empty(config.num_slots * config.slot_bytes, dtype=np.uint8)
        self.inbox.fill(0)  # pre-touch: a first touch during a transfer costs ~10x
        self.inbox_reg = self.agent.register_memory(
            [(int(self.inbox.ctypes.data), self.inbox.nbytes, 0, "")], "DRAM"
        )
        self.peer_name: str | None = None
        # Writes the peer announced (WRITING) and not yet completed (DATA), for the poller.
        self.num_peer_writes = 0
        self.fast_until = 0.0
        self.wake = asyncio.Event()

    def peer_writing(self, started: bool) -> None:
        """Count the peer's announced writes; wake the progress task on a new one."""
        if started:
            self.num_peer_writes += 1
            self.fast_until = time.monotonic() + _FAST_WINDOW_S
            self.wake.set()
        else:
            self.num_peer_writes = max(0, self.num_peer_writes - 1)

    def progress(self) -> None:
        """Drive the UCX worker once (we use no notifications; this is what polls it)."""
        with contextlib.suppress(Exception):  # a torn-down agent: the stream is closing
            self.agent.get_new_notifs()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.peer_name is not None:
                self.agent.remove_remote_agent(self.peer_name)
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self.inbox_reg)


class _NixlWriter:
    """WRITEs a slot's worth of the caller's views into the peer's inbox."""

    def __init__(self, endpoint: _Endpoint, peer_inbox: int, peer_slot_bytes: int) -> None:
        self._endpoint = endpoint
        self._peer_inbox = peer_inbox
        self._peer_slot_bytes = peer_slot_bytes

    async def write(self, job: SlotWrite) -> None:
        agent = self._endpoint.agent
        assert self._endpoint.peer_name is not None
        spans = [(_address(v), v.nbytes) for v in job.views]
        try:
            reg = agent.register_memory([(a, n, 0, "") for a, n in spans], "DRAM")
        except Exception as exc:
            raise _transfer_error("register", exc) from exc
        try:
            remote, offset = [], self._peer_inbox + job.slot * self._peer_slot_bytes
            for _, n in spans:
                remote.append((offset, n, 0))
                offset += n
            local_descs = agent.get_xfer_descs([(a, n, 0) for a, n in spans], "DRAM")
            remote_descs = agent.get_xfer_descs(remote, "DRAM")
            handle = agent.initialize_xfer(
                "WRITE", local_descs, remote_descs, self._endpoint.peer_name
            )
            try:
                await self._wait_done(handle, agent.transfer(handle), job)
            finally:
                with contextlib.suppress(Exception):  # an aborted WRITE may refuse release
                    handle.release()
        except TransferError:
            raise
        except Exception as exc:
            raise _transfer_error("write", exc) from exc
        finally:
            with contextlib.suppress(Exception):
                agent.deregister_memory(reg)

    async def _wait_done(self, handle: Any, state: str, job: SlotWrite) -> None:
        agent = self._endpoint.agent
        spin_until = time.monotonic() + _SPIN_S
        try:
            if state == "PROC":
                # Not complete on return (UCX emulating RMA over TCP needs the target to drive
                # it): ask the peer to progress until our DATA. A cma or RDMA write is done
                # here already, and the peer is never woken for it.
                await job.announce()
            while state == "PROC":
                if job.peer_gone():
                    # Nobody will complete it (the peer's worker may be the one to progress).
                    raise PeerClosed(f"nixl write to {self._endpoint.peer_name}: peer closed")
                await asyncio.sleep(0 if time.monotonic() < spin_until else _SLOW_POLL_S)
                state = agent.check_xfer_state(handle)
        except asyncio.CancelledError:
            # The WRITE reads the caller's memory: it must be over before the caller regains
            # it, so wait (bounded, still yielding: the target may be in this event loop).
            deadline = time.monotonic() + _DRAIN_S
            while state == "PROC" and not job.peer_gone() and time.monotonic() < deadline:
                await asyncio.sleep(_SLOW_POLL_S)
                state = agent.check_xfer_state(handle)
            raise
        if state != "DONE":
            raise TransferError(f"nixl write to {self._endpoint.peer_name} failed ({state})")

    def close(self) -> None:
        pass


class _Spares:
    """Endpoints built ahead of need, one per inbox geometry by default.

    An agent with its pre-touched inbox costs ~0.2 s to build (the process's first, which also
    starts UCX, ~1.7 s: measured here); a connection would wait that long on both ends, and
    its first handoff with it. Taking a spare and building its replacement in a thread keeps
    that off the path of a request."""

    def __init__(self, keep: int = 1) -> None:
        self._keep = keep
        self._ready: dict[NixlConfig, list[_Endpoint]] = {}
        self._building: dict[NixlConfig, asyncio.Task[None]] = {}

    async def take(self, config: NixlConfig) -> _Endpoint:
        """A built endpoint: a spare if one is ready, else built now; then refill."""
        building = self._building.get(config)
        if not self._ready.get(config) and building is not None and not building.done():
            # Half built already (the start-up's prewarm, say): wait for it, not start over.
            await asyncio.wait([building])
        ready = self._ready.get(config)
        endpoint = ready.pop() if ready else await asyncio.to_thread(_Endpoint, config)
        self.refill(config)
        return endpoint

    def refill(self, config: NixlConfig) -> None:
        """Start building spares (in a thread) up to `keep`, unless already building."""
        task = self._building.get(config)
        if task is not None and not task.done():
            return
        if len(self._ready.get(config, ())) >= self._keep:
            return

        async def build() -> None:
            endpoint = await asyncio.to_thread(_Endpoint, config)
            self._ready.setdefault(config, []).append(endpoint)

        task = asyncio.get_running_loop().create_task(build())
        # A failed build is retried by the next `take`, which builds inline and says why.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._building[config] = task

    async def settled(self) -> None:
        """Return once no spare is being built (a build allocates a whole inbox)."""
        pending = [t for t in self._building.values() if not t.done()]
        if pending:
            await asyncio.wait(pending)


_SPARES = _Spares()


def prewarm_nixl(config: NixlConfig | None = None) -> None:
    """Start building a spare endpoint (UCX's start-up included) in a thread, so that the
    first connection of this process does not pay for it. Call from the event loop."""
    if nixl_available():
        _SPARES.refill(config or NixlConfig())


async def nixl_spares_settled() -> None:
    """Wait for background spare builds to finish (for measurements that count memory)."""
    await _SPARES.settled()


async def _progress_loop(endpoint: _Endpoint) -> None:
    """Drive the worker: spin while the peer announced writes, else wake every idle period."""
    while True:
        if endpoint.num_peer_writes and time.monotonic() < endpoint.fast_until:
            endpoint.progress()
            await asyncio.sleep(0)
            continue
        endpoint.wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_IDLE_POLL_S):
                await endpoint.wake.wait()
        endpoint.progress()


async def connect_nixl(control: ByteStream, config: NixlConfig | None = None) -> SlotStream:
    """Run the NIXL handshake over an open control stream (symmetric; both ends call it)."""
    if not nixl_available():
        raise TransferError("nixl transport: the nixl package is not importable")
    config = config or NixlConfig()
    endpoint = await _SPARES.take(config)
    progress: asyncio.Task[None] | None = None
    try:
        metadata = endpoint.agent.get_agent_metadata()
        address = int(endpoint.inbox.ctypes.data)
        hello = _HELLO.pack(
            _MAGIC, _VERSION, 0, config.num_slots, config.slot_bytes, address, len(metadata)
        )
        await control.send([hello, metadata])
        header = bytearray(_HELLO.size)
        await control.receive_into(memoryview(header))
        magic, version, _, peer_num_slots, peer_slot_bytes, peer_inbox, md_len = _HELLO.unpack(
            header
        )
        if magic != _MAGIC:
            raise BadMagic(f"nixl handshake: magic {magic!r}, expected {_MAGIC!r}")
        if version != _VERSION:
            raise UnsupportedVersion(f"nixl handshake: version {version}, this build speaks 1")
        if md_len > MAX_METADATA_BYTES:
            # Checked before anything is allocated or read: the handshake runs before any
            # cluster MAC, and the length field alone could ask for 4 GiB.
            raise ProtocolError(
                f"nixl handshake: agent metadata of {md_len} bytes, at most {MAX_METADATA_BYTES}"
            )
        peer_metadata = bytearray(md_len)
        await control.receive_into(memoryview(peer_metadata))
        try:
            peer_name = endpoint.agent.add_remote_agent(bytes(peer_metadata))
        except Exception as exc:
            raise ProtocolError(f"nixl handshake: bad peer metadata: {exc}") from exc
        endpoint.peer_name = peer_name.decode() if isinstance(peer_name, bytes) else peer_name
        await control.send([_ATTACHED])
        ack = bytearray(1)
        await control.receive_into(memoryview(ack))
        if ack != _ATTACHED:
            raise ProtocolError(f"nixl handshake: expected ATTACHED, got {bytes(ack)!r}")
        if not config.progress_thread:
            progress = asyncio.get_running_loop().create_task(_progress_loop(endpoint))
    except BaseException:
        endpoint.close()
        raise

    def on_close() -> None:
        if progress is not None:
            progress.cancel()
        endpoint.close()

    return SlotStream(
        control,
        inbox=endpoint.inbox.data,
        inbox_slot_bytes=config.slot_bytes,
        writer=_NixlWriter(endpoint, peer_inbox, peer_slot_bytes),
        peer_num_slots=peer_num_slots,
        peer_slot_bytes=peer_slot_bytes,
        on_close=on_close,
        name=f"nixl {endpoint.name}",
        on_peer_writing=endpoint.peer_writing,
    )


# Over a TCP control stream that `connect_nixl` sets the transport up on.
_NIXL = Upgraded(connect_nixl)
open_nixl_stream = _NIXL.open
serve_nixl = _NIXL.serve
