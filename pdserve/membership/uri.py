"""`--discovery` values: `etcd://HOST[:PORT][/PREFIX]` parsed into an `EtcdEndpoint`. Pure.

The prefix scopes one cluster's keys, so several clusters can share one etcd: workers
register under `<prefix>/workers/` and routers watch that range. Every malformed value is a
ConfigError that names the value and shows the expected form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from pdserve.errors import ConfigError
from pdserve.settings import Flag

DEFAULT_PORT = 2379
DEFAULT_PREFIX = "/pdserve"
_FORM = "etcd://HOST[:PORT][/PREFIX]"
# Key segments: what etcdctl users type without quoting, and never an empty segment.
_PREFIX_RE = re.compile(r"(/[A-Za-z0-9._-]+)+")


@dataclass(frozen=True, slots=True)
class EtcdEndpoint:
    """One etcd endpoint and the key prefix of this cluster."""

    host: str
    port: int
    # Starts with "/", no trailing "/".
    prefix: str = DEFAULT_PREFIX

    @property
    def target(self) -> str:
        """ "host:port" for a gRPC channel (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"etcd://{self.target}{self.prefix}"


# `--discovery URI`, declared once for the router, the worker and `pdserve up` (each says in
# its help what it does with the etcd there); checked by `parse_discovery` in their configs.
DISCOVERY = Flag(type=str, metavar=_FORM)


def parse_discovery(value: str) -> EtcdEndpoint:
    """`value` as an etcd endpoint; ConfigError naming what is wrong otherwise."""

    def bad(why: str) -> ConfigError:
        return ConfigError(f"discovery: {value!r}: {why}; expected {_FORM}")

    if "://" not in value:
        raise bad("no scheme")
    parts = urlsplit(value)
    if parts.scheme != "etcd":
        raise bad(f"scheme {parts.scheme!r} is not supported")
    if parts.query or parts.fragment:
        raise bad("query strings and fragments are not supported")
    if "@" in parts.netloc:
        raise bad("credentials in the URI are not supported")
    host = parts.hostname
    if not host:
        raise bad("no host")
    try:
        port = parts.port
    except ValueError:
        raise bad("the port is not a number in 1..65535") from None
    if port == 0:
        raise bad("the port is not a number in 1..65535")
    prefix = parts.path.rstrip("/")
    if prefix and not _PREFIX_RE.fullmatch(prefix):
        raise bad(f"prefix {parts.path!r} must be /-separated segments of [A-Za-z0-9._-]")
    return EtcdEndpoint(host, DEFAULT_PORT if port is None else port, prefix or DEFAULT_PREFIX)
