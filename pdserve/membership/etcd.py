"""Membership in etcd (3.4+): workers register under a lease, routers watch the prefix.

Worker side (`EtcdRegistration`): grant a lease of `ttl_s`, then put
`<prefix>/workers/<worker_id>` (see `codec`) attached to it, only if the key is absent or
already holds this very worker (same value: a registration whose answer was lost, or a
restart on the same address); another live worker with the same id is refused and retried
until its lease lapses. A keep-alive refreshes the lease every `ttl_s / 3`. If the worker
dies, nothing refreshes it and etcd deletes the key within `ttl_s`; if etcd was unreachable
long enough for the lease to lapse, the worker registers again. `stop()` revokes the lease,
so a graceful stop leaves at once.

Router side (`EtcdMembership`): list the prefix, hand the listener the set, then watch from
the revision after the listing, so no change between the two is missed. A lost watch (etcd
restarted, connection reset, revision compacted) is followed by a fresh listing and a new
watch: the listing is the truth, the watch only keeps it current. While etcd is unreachable
the router keeps the last set it had; health polls still take dead workers out of selection.

Life cycle: one background task each, started by `start()`, which waits up to
`start_timeout_s` for the first success and otherwise keeps trying in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import aetcd

from pdserve.membership.base import Member, MembershipError, MembersListener
from pdserve.membership.codec import encode_member, worker_key, workers_prefix
from pdserve.membership.table import MemberTable, Row
from pdserve.membership.uri import EtcdEndpoint
from pdserve.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# Seconds one unary etcd call (grant, put, get, revoke) may take.
CALL_TIMEOUT_S = 5
# gRPC keep-alive pings: a watch on a silently dead connection errors out instead of hanging.
# etcd refuses pings more often than every 5 s (its --grpc-keepalive-min-time).
_CHANNEL_OPTIONS = {
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 1,
}


def _client(endpoint: EtcdEndpoint) -> Any:
    host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
    return aetcd.Client(host, endpoint.port, timeout=CALL_TIMEOUT_S, options=_CHANNEL_OPTIONS)


async def _close(client: Any) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.close(), CALL_TIMEOUT_S)


class _EtcdLoop:
    """A background task that retries one etcd attempt forever, each on a fresh client.

    `_start` waits up to `start_timeout_s` for the attempt's first success (`_ready`).
    """

    def __init__(
        self, endpoint: EtcdEndpoint, retry_interval_s: float, start_timeout_s: float
    ) -> None:
        self.endpoint = endpoint
        self._retry_interval_s = retry_interval_s
        self._start_timeout_s = start_timeout_s
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _start(self, loop: Coroutine[Any, Any, None], name: str, not_ready: str) -> None:
        """Run `loop` in the background; log `not_ready` if it has no success in time."""
        self._task = asyncio.create_task(loop, name=name)
        try:
            await asyncio.wait_for(self._ready.wait(), self._start_timeout_s)
        except TimeoutError:
            log.warning(not_ready, self.endpoint, self._start_timeout_s)

    async def _retry_forever(
        self,
        attempt: Callable[[Any], Awaitable[bool]],
        *,
        retried: tuple[type[Exception], ...],
        again: str,
        failed: str,
    ) -> None:
        """Run `attempt` again and again; it returns whether to go again without a pause.

        `retried` errors (etcd away) are logged as warnings; any other is a bug, logged with
        its traceback, and must not silently end the loop either.
        """
        while True:
            client = _client(self.endpoint)
            try:
                if await attempt(client):
                    continue
            except retried as exc:
                log.warning(
                    "membership: %s: %s; %s in %.1f s",
                    self.endpoint,
                    exc,
                    again,
                    self._retry_interval_s,
                )
            except Exception:
                log.exception(failed, self.endpoint)
            finally:
                await _close(client)
            await asyncio.sleep(self._retry_interval_s)


class EtcdMembership(_EtcdLoop):
    """The workers registered under one prefix, kept current by a watch."""

    def __init__(
        self,
        endpoint: EtcdEndpoint,
        retry_interval_s: float = 1.0,
        start_timeout_s: float = 5.0,
        key: bytes | None = None,
    ) -> None:
        """`key`: the cluster's membership key; registrations without its MAC are ignored."""
        super().__init__(endpoint, retry_interval_s, start_timeout_s)
        self._range = workers_prefix(endpoint.prefix).encode()
        self._table = MemberTable(key)
        self._listener: MembersListener | None = None

    async def start(self, listener: MembersListener) -> None:
        """List and watch in the background; wait up to start_timeout_s for the first list."""
        self._listener = listener
        await self._start(
            self._run(),
            "etcd-membership",
            "membership: %s not reachable in %.0f s; starting with no workers, still trying",
        )

    def members(self) -> list[Member]:
        """The registered workers, in join order."""
        return self._table.members()

    @property
    def num_refused(self) -> int:
        """Registrations ignored: unreadable, or not signed with the cluster's key."""
        return self._table.num_refused

    async def stop(self) -> None:
        """Stop watching and close the connection."""
        self._listener = None
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        await self._retry_forever(
            self._watch,
            retried=(aetcd.ClientError,),
            again="listing again",
            failed="membership: watching %s failed",
        )

    async def _watch(self, client: Any) -> bool:
        revision = await self._list(client)
        watch = await client.watch_prefix(self._range, start_revision=revision + 1)
        async for event in watch:
            self._apply(event)
        log.warning("membership: watch on %s ended; listing again", self.endpoint)
        return False

    async def _list(self, client: Any) -> int:
        listing = await client.get_prefix(self._range)
        rows = [Row(kv.key, kv.value, kv.create_revision) for kv in listing]
        before = self._table.members()
        for error in self._table.replace(rows):
            log.warning("membership: ignoring %s", error)
        if not self._ready.is_set() or self._table.members() != before:
            self._notify()
        self._ready.set()
        log.info("membership: %d workers under %s", len(rows), self.endpoint)
        return int(listing.header.revision)

    def _apply(self, event: Any) -> None:
        kv = event.kv
        if event.kind == aetcd.EventKind.DELETE:
            changed = self._table.delete(kv.key)
        else:
            try:
                changed = self._table.put(Row(kv.key, kv.value, kv.create_revision))
            except MembershipError as exc:
                log.warning("membership: ignoring %s", exc)
                changed = True
        if changed:
            self._notify()

    def _notify(self) -> None:
        if self._listener is not None:
            self._listener(self._table.members())


class EtcdRegistration(_EtcdLoop):
    """One worker's key under a kept-alive lease."""

    def __init__(
        self,
        endpoint: EtcdEndpoint,
        member: Member,
        ttl_s: int,
        retry_interval_s: float = 1.0,
        start_timeout_s: float = 5.0,
        key: bytes | None = None,
    ) -> None:
        if member.worker_id is None:
            raise MembershipError(f"member {member.url}: a registration needs a worker id")
        super().__init__(endpoint, retry_interval_s, start_timeout_s)
        self.member = member
        self.key = worker_key(endpoint.prefix, member.worker_id).encode()
        self._value = encode_member(member, key)
        self._ttl_s = ttl_s
        self._lease_id: int | None = None

    @property
    def registered(self) -> bool:
        """Whether the key has been put at least once."""
        return self._ready.is_set()

    async def start(self) -> None:
        """Register in the background; wait up to start_timeout_s for the first success."""
        await self._start(
            self._run(),
            "etcd-registration",
            "membership: not registered in %s after %.0f s; still trying",
        )

    async def stop(self) -> None:
        """Stop the keep-alive and revoke the lease, which deletes the key at once."""
        await cancel_and_wait(self._task)
        self._task = None
        if self._lease_id is not None:
            client = _client(self.endpoint)
            try:
                await asyncio.wait_for(client.revoke_lease(self._lease_id), CALL_TIMEOUT_S)
                log.info("membership: left %s (lease %x revoked)", self.endpoint, self._lease_id)
            except (aetcd.ClientError, TimeoutError) as exc:
                log.warning("membership: revoking the lease failed (%s); it lapses in TTL", exc)
            finally:
                self._lease_id = None
                await _close(client)

    async def _run(self) -> None:
        await self._retry_forever(
            self._hold,
            retried=(aetcd.ClientError, MembershipError),
            again="retrying",
            failed="membership: registering in %s failed",
        )

    async def _hold(self, client: Any) -> bool:
        if self._lease_id is None:
            self._lease_id = await self._register(client)
            self._ready.set()
        await self._keep_alive(client, self._lease_id)
        # The lease lapsed (etcd unreachable past the TTL): the key is gone with it.
        self._lease_id = None
        return True

    async def _register(self, client: Any) -> int:
        lease = await client.lease(self._ttl_s)
        try:
            await self._put(client, lease.id)
        except BaseException:
            with contextlib.suppress(Exception):
                await client.revoke_lease(lease.id)
            raise
        log.info(
            "membership: registered %s as %s in %s (lease %x, ttl %d s)",
            self.member.url,
            self.member.worker_id,
            self.endpoint,
            lease.id,
            lease.ttl,
        )
        return int(lease.id)

    async def _put(self, client: Any, lease_id: int) -> None:
        tx = client.transactions
        put = tx.put(self.key, self._value, lease_id)
        created, _ = await client.transaction(
            compare=[tx.create(self.key) == 0], success=[put], failure=[]
        )
        if created:
            return
        existing = await client.get(self.key)
        if existing is None:
            raise MembershipError(f"key {self.key.decode()} changed while registering")
        if existing.value != self._value:
            raise MembershipError(
                f"worker id {self.member.worker_id!r} is registered by another live worker"
                f" ({existing.value.decode(errors='replace')}); waiting for its lease to lapse"
            )
        # The same worker at the same address: take the key over, unless it moved meanwhile.
        same = tx.mod(self.key) == existing.mod_revision
        taken, _ = await client.transaction(compare=[same], success=[put], failure=[])
        if not taken:
            raise MembershipError(f"key {self.key.decode()} changed while registering")
        with contextlib.suppress(Exception):
            await client.revoke_lease(existing.lease)

    async def _keep_alive(self, client: Any, lease_id: int) -> None:
        while True:
            reply = await client.refresh_lease(lease_id)
            if reply is None or reply.TTL <= 0:
                log.warning("membership: lease %x lapsed; registering again", lease_id)
                return
            await asyncio.sleep(self._ttl_s / 3)
