"""One worker's life cycle: build the parts in order, serve, and stop them in reverse.

Start: the engine thread (loads the model), the lease reaper, the KV endpoint (decode/both),
the outbox (prefill/both), then the HTTP server; only once it listens is the ready file
written, atomically, with the real URL (port 0 picks a free one), so a launcher never reads a
half-written file or a URL nobody answers. With `discovery` set the worker registers (etcd
lease) once both endpoints listen, before the ready file. Stop: the registration first (routers
drop the worker), HTTP (no new work), then sends and reservations (their KV is released into
the engine), the reaper, and last the engine thread.

It knows how the parts fit together; the parts themselves live in their own modules.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time

import aiohttp
from aiohttp import web

from pdserve.auth.signing import CallVerifier, call_target
from pdserve.auth.tls import client_context, http_connector, server_context
from pdserve.child.ready_file import write_ready_file
from pdserve.engine.engine import Engine
from pdserve.engine.kv_events import KVEventLog
from pdserve.faults import FaultInjector, parse_rules
from pdserve.membership import Member, Registration, open_registration
from pdserve.observability.timeline_log import EventRing
from pdserve.transfer.receiver import ReceiverLimits
from pdserve.transfer.sender import SendPolicy
from pdserve.worker.checkpoint.prefix_source import PrefixCacheSource
from pdserve.worker.checkpoint.routes import CheckpointService
from pdserve.worker.config import WorkerConfig
from pdserve.worker.drain import (
    SEEN_GRACE_S,
    SEEN_WAIT_S,
    DrainReport,
    wait_until_idle,
)
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.http.app import WorkerAPI
from pdserve.worker.kv import transports as kv_transports
from pdserve.worker.kv.events import KVEventStreams
from pdserve.worker.kv.give_up_notice import http_give_up_notice
from pdserve.worker.kv.inbox import KVInbox
from pdserve.worker.kv.outbox import KVOutbox
from pdserve.worker.kv.transport_stats import TransportStats
from pdserve.worker.lease_keeper import LeaseKeeper

log = logging.getLogger(__name__)

# Seconds in-flight HTTP handlers get to finish when the worker stops.
SHUTDOWN_TIMEOUT_S = 2.0


class Worker:
    """An engine, its transfer endpoints and its HTTP API, started and stopped as one."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.url: str | None = None
        engine_config = config.engine
        # The prefix cache's stored/evicted hashes, streamed to routers (POST /kv_events).
        self.kv_events = KVEventLog()
        # Fault injection exists only when asked for; None keeps every site a no-op.
        self.faults: FaultInjector | None = None
        if config.faults or config.enable_fault_admin:
            self.faults = FaultInjector(parse_rules(config.faults), config.fault_seed)
        self.engine = EngineLoop(
            lambda: Engine.from_config(engine_config, kv_events=self.kv_events),
            name="engine",
            faults=self.faults,
        )
        self.kv_streams = KVEventStreams(self.kv_events, self.engine)
        self.leases = LeaseKeeper(config.reap_interval_s)
        self.inbox: KVInbox | None = None
        self.outbox: KVOutbox | None = None
        self.checkpoints: CheckpointService | None = None
        self.cache_source: PrefixCacheSource | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.registration: Registration | None = None
        self.events = EventRing(config.worker_id, config.timeline_ring)
        # This life of the worker: a restart at the same address draws another (issue 30).
        self.instance_id = secrets.token_hex(8)
        self.api: WorkerAPI | None = None
        # Set by SIGTERM or POST /admin/drain: the process drains, then stops (`worker/main`).
        self.stop_requested = asyncio.Event()

    async def start(self) -> str:
        """Bring every part up; returns the HTTP URL once it listens."""
        c = self.config
        tls_server, tls_client = server_context(c.tls), client_context(c.tls)
        kv_transports.configure_tls(tls_server, tls_client)
        # An explicit transport that cannot work here fails the start, naming why.
        transports = kv_transports.local_transports(c.kv_transport)
        kv_transports.prewarm(transports)  # in a thread, while the engine loads
        info = await self.engine.start()
        self.kv_streams.bind(asyncio.get_running_loop())
        self.leases.start()
        stats = TransportStats()
        if c.serves_decode:
            self.inbox = KVInbox(
                self.engine,
                info,
                self.leases,
                faults=self.faults,
                events=self.events,
                cluster_key=c.kv_key,
                limits=ReceiverLimits(
                    handshake_timeout_s=c.kv_handshake_timeout_s,
                    frame_timeout_s=max(c.transfer_chunk_timeout_s, 1.0) * 5,
                ),
                transports=transports,
                max_connections=c.kv_max_connections,
                stats=stats,
                instance_id=self.instance_id,
            )
            await self.inbox.start(c.host, c.kv_port, c.advertise_host)
            self.checkpoints = CheckpointService(c, info, self.engine, self.inbox, transports)
            self.checkpoints.start()
        if c.serves_prefill:
            policy = SendPolicy(
                chunk_timeout_s=c.transfer_chunk_timeout_s, frame_bytes=c.kv_frame_bytes
            )
            # For the give-up notices to decode workers (the only calls a worker makes).
            self._session = aiohttp.ClientSession(connector=http_connector(tls_client))
            self.outbox = KVOutbox(
                self.engine,
                info,
                self.leases,
                policy,
                faults=self.faults,
                events=self.events,
                give_up=http_give_up_notice(self._session, c.http_key),
                cluster_key=c.kv_key,
                stats=stats,
            )
        if c.engine.enable_prefix_caching:
            # Any worker's cached prefix can spare a resuming peer its recomputation.
            self.cache_source = PrefixCacheSource(c, info, self.engine, transports)
        http_key = c.http_key
        # The worker id its /health reports: the router signs its calls for that and the instance.
        target = call_target(c.worker_id, self.instance_id)
        api = WorkerAPI(
            c,
            info,
            self.engine,
            self.leases,
            self.inbox,
            self.outbox,
            faults=self.faults,
            events=self.events,
            verifier=None if http_key is None else CallVerifier(http_key, time.time, target=target),
            local_transports=transports,
            kv_streams=self.kv_streams,
            checkpoints=self.checkpoints,
            cache_source=self.cache_source,
            instance_id=self.instance_id,
        )
        self.api = api
        # POST /admin/drain asks the process to drain and exit, as SIGTERM does.
        api.on_drain = self.stop_requested.set
        # handler_cancellation: a client that disconnects cancels its handler, whose cleanup
        # aborts the request in the engine.
        self._runner = web.AppRunner(
            api.app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, c.host, c.port, ssl_context=tls_server)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"{c.tls.scheme}://{host}:{port}"
        if c.discovery is not None:
            # Only now can routers reach both endpoints; the ready file follows, so a
            # launcher that sees it also finds the worker registered.
            self.registration = open_registration(
                c.discovery,
                self._member(info.fingerprint_digest, port),
                c.membership_ttl_s,
                key=c.membership_key,
            )
            await self.registration.start()
        if c.ready_file is not None:
            write_ready_file(c.ready_file, self.url)
        return self.url

    def _member(self, fingerprint_digest: str, port: int) -> Member:
        c = self.config
        host = c.advertised_host
        host = f"[{host}]" if ":" in host else host
        transfer = None
        if self.inbox is not None:
            transfer = f"{host}:{self.inbox.address.rpartition(':')[2]}"
        return Member(
            url=f"{c.tls.scheme}://{host}:{port}",
            worker_id=c.worker_id or f"{c.role}-{os.getpid()}",
            instance_id=self.instance_id,
            role=c.role,
            fingerprint_digest=fingerprint_digest,
            transfer_address=transfer,
        )

    async def drain(self, timeout_s: float) -> DrainReport:
        """Take nothing new, leave the membership once a router knows, and wait (up to
        `timeout_s`) until nothing is held (`worker/drain.py`); then call `stop`."""
        api = self.api
        if api is None:
            return DrainReport(True, 0.0, {})
        api.draining = True
        log.info("worker %s draining (up to %.1f s)", api.worker_id, timeout_s)
        # Routers learn it from /health before anything is refused (a refusal or a closed port
        # costs a router a retry), then the membership record goes. An idle worker waits too:
        # a router may have chosen it a moment ago and be sending the call now.
        try:
            await asyncio.wait_for(api.drain_seen.wait(), SEEN_WAIT_S)
            await asyncio.sleep(SEEN_GRACE_S)
        except TimeoutError:
            pass
        api.refusing = True
        if self.registration is not None:
            await self.registration.stop()
            self.registration = None
        report = await wait_until_idle(self._held, timeout_s)
        log.info(
            "worker %s %s after %.2f s%s",
            api.worker_id,
            "drained" if report.drained else "drain timed out",
            report.waited_s,
            "" if report.drained else f"; still held: {dict(report.left)}",
        )
        return report

    async def _held(self) -> dict[str, int]:
        assert self.api is not None
        stats = await self.engine.stats()
        return {
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "pinned_blocks": stats.num_held_blocks,
            "admitted": self.api.num_admitted,
            "leases": self.leases.num_active,
        }

    async def stop(self) -> None:
        """Stop in reverse order; every held block goes back to the engine first."""
        if self.registration is not None:
            # Leave the routers' pools before refusing their calls.
            await self.registration.stop()
            self.registration = None
        # Long-lived event streams end now instead of holding up the HTTP shutdown.
        self.kv_streams.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.outbox is not None:
            await self.outbox.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.checkpoints is not None:
            await self.checkpoints.aclose()
        if self.cache_source is not None:
            await self.cache_source.aclose()
        if self.inbox is not None:
            await self.inbox.aclose()
        await self.leases.aclose()
        await asyncio.to_thread(self.engine.stop)
