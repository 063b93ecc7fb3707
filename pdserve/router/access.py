"""Who may use which of the router's planes: the decision is pure, the request only feeds it.

| plane     | paths                 | no key configured          | key configured         |
|-----------|-----------------------|----------------------------|------------------------|
| inference | `/v1/*`               | open                       | the API key            |
| admin     | `/admin/*`, `/debug/*`| loopback connections only  | the admin key (only)   |
| metrics   | `/metrics`            | open                       | the metrics key        |
| open      | `/health`, `/ready`, `/tokenize`, `/detokenize`, ... | open | open        |

"Loopback only" is judged by the address a connection *arrived at* (the socket's own end), not
by the peer's: a router listening on 0.0.0.0 answers admin calls made to 127.0.0.1 on its
machine and refuses the same calls made to its public address. A proxy on the same machine
that forwards to 127.0.0.1 would be let through: behind one, set an admin key.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass

from pdserve.auth.keys import BearerKey


class Plane(enum.Enum):
    """A group of routes that share one credential."""

    INFERENCE = "inference"
    ADMIN = "admin"
    METRICS = "metrics"
    OPEN = "open"


def plane_of(path: str) -> Plane:
    """The plane a request path belongs to."""
    if path.startswith("/v1/"):
        return Plane.INFERENCE
    if path.startswith(("/admin/", "/debug/")):
        return Plane.ADMIN
    if path == "/metrics":
        return Plane.METRICS
    return Plane.OPEN


@dataclass(frozen=True, slots=True)
class AccessKeys:
    """The router's keys, each None when not configured."""

    api: BearerKey | None = None
    admin: BearerKey | None = None
    metrics: BearerKey | None = None


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is refused, as the client will read it."""

    status: int
    message: str


def check_access(
    plane: Plane, keys: AccessKeys, authorization: str | None, on_loopback: bool
) -> Refusal | None:
    """None when the request may go on, else the refusal (401 wrong key, 403 not loopback)."""
    if plane is Plane.ADMIN:
        if keys.admin is not None:
            return None if keys.admin.matches(authorization) else _wrong("admin")
        if on_loopback:
            return None
        return Refusal(
            403,
            "admin and debug routes answer loopback connections only when no admin key is set"
            " (give the router --admin-key-file PATH or $PDSERVE_ADMIN_KEY to reach them from"
            " elsewhere)",
        )
    key = {Plane.INFERENCE: keys.api, Plane.METRICS: keys.metrics}.get(plane)
    if key is None or key.matches(authorization):
        return None
    return _wrong(plane.value)


def _wrong(plane: str) -> Refusal:
    return Refusal(401, f"missing or wrong {plane} key (Authorization: Bearer <key>)")


def is_loopback(address: object) -> bool:
    """True for a loopback IP (v4, v6 or v4-mapped v6); False for anything else."""
    if not isinstance(address, str):
        return False
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


def exposed_warnings(host: str, keys: AccessKeys) -> list[str]:
    """What the router warns about at start for a non-loopback listen address."""
    if is_loopback(host) or host == "localhost":
        return []
    found = []
    if keys.api is None:
        found.append(
            f"listening on {host} with no API key: anyone who reaches it can run requests"
            " (set --api-key-file PATH or $PDSERVE_API_KEY)"
        )
    if keys.admin is None:
        found.append(
            "no admin key: /admin and /debug answer loopback connections only"
            " (set --admin-key-file PATH or $PDSERVE_ADMIN_KEY to administer it remotely)"
        )
    return found
