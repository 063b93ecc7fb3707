"""Which KV transport a pair of workers uses, and how each is served and dialled.

The decode side serves every transport it has (`serve_endpoints`) and lists them in each
reservation, best first. The prefill side takes the best one it also has (`choose`, pure):

    nixl   when both ends have NIXL (UCX: shared memory / cma on one host, RDMA across hosts)
    shm    when both ends run on the same host (same machine id and boot) and have shm
    tcp    always

With `--kv-transport auto` a worker has every transport that works here (NIXL only when the
package imports) and a fallback is allowed but never silent: `choose` says what was given up
and why, and the outbox logs and counts it. With an explicit transport a worker has that one
only; if the peer cannot meet it, that is an error naming why (at start when the transport
itself is missing, at reservation when the peer lacks it), never a quiet downgrade.

With TLS (`auth/tls.py`) the KV path is TCP wrapped in mutual TLS and nothing else:
`configure_tls` is called once at worker start, and every KV connection this process serves or
dials from then on (handoffs, probes, checkpoint links, resume pulls) goes through it.

It knows transports, addresses and host identity; not sessions, leases or engines.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import ConfigError, TransportUnavailable
from pdserve.protocol.worker_api import KVEndpoint, Transport
from pdserve.transfer.nixl_transport import (
    NixlConfig,
    nixl_available,
    open_nixl_stream,
    prewarm_nixl,
    serve_nixl,
)
from pdserve.transfer.shm import SHM_DIR, ShmConfig, open_shm_stream, serve_shm
from pdserve.transfer.stream import Address, ByteStream, StreamHandler
from pdserve.transfer.tcp import TcpServer, open_tcp_stream, serve_tcp
from pdserve.transfer.tls_stream import TlsServer, open_tls_stream, serve_tls

# Best first: what `auto` prefers when both ends have it.
PREFERENCE: tuple[Transport, ...] = ("nixl", "shm", "tcp")

# Slot pools of the shm / NIXL streams: 8 MiB slots, so one 4 MiB frame (the default) and its
# successor are in flight at once.
SHM_CONFIG = ShmConfig(num_slots=8, slot_bytes=8 << 20)
NIXL_CONFIG = NixlConfig(num_slots=8, slot_bytes=8 << 20)


@functools.cache
def host_id() -> str:
    """Equal on two workers exactly when they can share memory: the same machine and boot, and
    the same /dev/shm mount (containers on one node each have their own, so they differ)."""
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            parts.append(Path(path).read_text().strip())
        except OSError:
            parts.append("")
    if not any(parts):
        parts.append(socket.gethostname())
    try:
        shm = os.stat(SHM_DIR)
        parts.append(f"{shm.st_dev}:{shm.st_ino}")
    except OSError:
        parts.append("no-shm")
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:16]


@dataclass(slots=True)
class _Tls:
    server: ssl.SSLContext | None = None
    client: ssl.SSLContext | None = None


# Set once per worker process (`configure_tls`); None contexts: plaintext.
_TLS = _Tls()


def configure_tls(server: ssl.SSLContext | None, client: ssl.SSLContext | None) -> None:
    """Serve and dial every KV connection of this process with these contexts (None: plain)."""
    _TLS.server, _TLS.client = server, client


def local_transports(setting: str) -> tuple[Transport, ...]:
    """The transports this worker has for `--kv-transport setting`, best first; ConfigError
    when an explicit one cannot work here (under TLS: anything but TCP)."""
    if _TLS.server is not None:
        if setting not in ("auto", "tcp"):
            raise ConfigError(
                f"kv-transport: {setting} carries no TLS; with --tls-cert the KV path is tcp"
            )
        return ("tcp",)
    if setting == "auto":
        return tuple(t for t in PREFERENCE if t != "nixl" or nixl_available())
    if setting == "nixl" and not nixl_available():
        raise ConfigError(
            "kv-transport: nixl asked for, but the nixl package does not import here"
            " (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)"
        )
    if setting not in PREFERENCE:
        raise ConfigError(f"kv-transport: {setting!r} is not one of auto, {', '.join(PREFERENCE)}")
    return tuple(t for t in PREFERENCE if t == setting)


# Why a better transport was passed over: bounded labels for the downgrade metric.
NOT_ON_SENDER = "not_on_sender"
DIFFERENT_HOSTS = "different_hosts"


@dataclass(frozen=True, slots=True)
class Choice:
    """The transport a send uses, and what was given up to get it (None: the best one)."""

    endpoint: KVEndpoint
    # The better transport passed over, and why (a label, and a sentence): a downgrade,
    # logged and counted.
    downgraded_from: Transport | None = None
    reason: str | None = None
    detail: str | None = None


def choose(
    offered: Sequence[KVEndpoint], local: Sequence[Transport], local_host: str, explicit: bool
) -> Choice:
    """The best transport both sides have; TransportUnavailable naming why when none."""
    offered_by = {e.transport: e for e in offered}
    best_offered = next((t for t in PREFERENCE if t in offered_by), None)
    skipped: list[str] = []
    first_reason: str | None = None
    for transport in PREFERENCE:
        endpoint = offered_by.get(transport)
        if endpoint is None:
            continue
        if transport not in local:
            skipped.append(f"{transport}: not available on the sending worker")
            first_reason = first_reason or NOT_ON_SENDER
            continue
        if transport == "shm" and endpoint.host_id != local_host:
            skipped.append("shm: the workers are on different hosts")
            first_reason = first_reason or DIFFERENT_HOSTS
            continue
        if transport == best_offered or not skipped:
            return Choice(endpoint)
        return Choice(endpoint, best_offered, first_reason, "; ".join(skipped))
    wanted = ", ".join(local)
    have = ", ".join(e.transport for e in offered) or "none"
    why = "; ".join(skipped) or "no transport in common"
    kind = "asked for" if explicit else "available"
    raise TransportUnavailable(
        f"KV transport {wanted} ({kind} here) cannot reach the decode worker, which offers"
        f" {have}: {why}"
    )


def prewarm(transports: Sequence[Transport]) -> None:
    """Start setting up what a transport's first connection would otherwise wait for (NIXL:
    UCX's start-up, an agent and its inbox; ~1.7 s measured here). Non-blocking."""
    if "nixl" in transports:
        prewarm_nixl(NIXL_CONFIG)


async def serve(
    transport: Transport,
    handler: StreamHandler,
    host: str,
    port: int,
    *,
    handshake_timeout_s: float,
    max_connections: int | None,
) -> TcpServer | TlsServer:
    """Listen for KV connections over `transport` (its control socket on host:port), at most
    `max_connections` at once, each given `handshake_timeout_s` to set up its stream."""
    if transport == "nixl":
        return await serve_nixl(
            handler,
            host,
            port,
            NIXL_CONFIG,
            handshake_timeout_s=handshake_timeout_s,
            max_connections=max_connections,
        )
    if transport == "shm":
        return await serve_shm(
            handler,
            host,
            port,
            SHM_CONFIG,
            handshake_timeout_s=handshake_timeout_s,
            max_connections=max_connections,
        )
    if _TLS.server is not None:
        return await serve_tls(handler, host, port, _TLS.server, max_connections=max_connections)
    return await serve_tcp(handler, host, port, max_connections=max_connections)


async def connect(transport: Transport, address: Address) -> ByteStream:
    """Open one KV stream to an endpoint served by `serve`."""
    if transport == "nixl":
        return await open_nixl_stream(address, NIXL_CONFIG)
    if transport == "shm":
        return await open_shm_stream(address, SHM_CONFIG)
    if _TLS.client is not None:
        return await open_tls_stream(address, _TLS.client)
    return await open_tcp_stream(address)


def parse_address(text: str, field: str) -> Address:
    """ "host:port" (IPv6 host in brackets) as an Address; ConfigError naming `field`."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{field}: {text!r} is not host:port")
    return host, int(port)
