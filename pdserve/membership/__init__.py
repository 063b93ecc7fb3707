"""How a router knows its workers: a static list (the embedded default) or etcd leases.

    router  ── Membership.start(listener) ──► StaticMembership(urls)      `--worker URL ...`
                                          └─► EtcdMembership(endpoint)   `--discovery etcd://…`
    worker  ── Registration.start/stop ─────► EtcdRegistration           `--discovery etcd://…`

`open_membership` and `open_registration` pick the implementation from the `--discovery`
value; the etcd client (`aetcd`, the `etcd` extra) is imported only when etcd is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from pdserve.errors import ConfigError
from pdserve.membership.base import (
    Member,
    MemberDiff,
    Membership,
    MembershipError,
    MembersListener,
    Registration,
    diff_members,
)
from pdserve.membership.static import StaticMembership
from pdserve.membership.uri import EtcdEndpoint, parse_discovery

__all__ = [
    "EtcdEndpoint",
    "Member",
    "MemberDiff",
    "MembersListener",
    "Membership",
    "MembershipError",
    "Registration",
    "StaticMembership",
    "diff_members",
    "open_membership",
    "open_registration",
    "parse_discovery",
]


def _etcd_module() -> ModuleType:
    try:
        from pdserve.membership import etcd
    except ImportError as exc:
        raise ConfigError(
            f"discovery: etcd needs the aetcd package ({exc}); install pdserve[etcd]"
        ) from None
    return etcd


def open_membership(
    discovery: str | None, urls: Sequence[str], key: bytes | None = None
) -> Membership:
    """The router's membership: etcd when `discovery` is given, else the static `urls`;
    `key` (the cluster secret's "membership" key) makes etcd records need its MAC."""
    if discovery is None:
        return StaticMembership(urls)
    endpoint = parse_discovery(discovery)
    membership: Membership = _etcd_module().EtcdMembership(endpoint, key=key)
    return membership


def open_registration(
    discovery: str, member: Member, ttl_s: int, key: bytes | None = None
) -> Registration:
    """The worker's registration in the store `discovery` names, signed with `key`."""
    endpoint = parse_discovery(discovery)
    registration: Registration = _etcd_module().EtcdRegistration(endpoint, member, ttl_s, key=key)
    return registration
