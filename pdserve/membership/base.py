"""What membership is: the workers a router may use, and how a worker announces itself.

A `Membership` is the router's source of workers. `start(listener)` calls the listener with
the whole current member set (possibly empty) and again after every change, always with the
whole set, so a listener never has to replay deltas; `diff_members` turns two sets into what
was added, removed and updated. A `Registration` is the worker's half: it makes the worker a
member while the process lives and stops being one on `stop()` (or, when the process dies
without stopping, when its lease lapses).

Members are keyed by URL: the router talks to URLs, so a worker that restarts on another port
is one member leaving and another joining, even with the same worker id.

It knows no transport (etcd lives in `etcd.py`) and nothing about health or load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from pdserve.errors import PdserveError


class MembershipError(PdserveError):
    """A registration cannot be made or read (duplicate worker id, malformed value)."""


class UnsignedMember(MembershipError):
    """A registration without a valid MAC under the cluster secret: not a cluster member
    (anyone who can write to the store could have put it there)."""


@dataclass(frozen=True, slots=True)
class Member:
    """One worker as its membership source describes it.

    A static list knows only the URL; the other fields are None there and come from the
    worker's /health. A registered worker fills them in itself.
    """

    # Base URL of the worker's HTTP control API, without a trailing slash.
    url: str
    worker_id: str | None = None
    role: str | None = None
    fingerprint_digest: str | None = None
    # "host:port" of the KV endpoint of a decode/both worker.
    transfer_address: str | None = None
    # The worker process's life (drawn at start): a restart at the same URL changes it, so the
    # membership reports the record as updated and the router trusts nothing from before.
    instance_id: str | None = None


# Called with every member, in join order, on start and after each change.
MembersListener = Callable[[Sequence[Member]], None]


@dataclass(frozen=True, slots=True)
class MemberDiff:
    """How a member set changed, each part in the new set's order (removed: the old one's)."""

    added: tuple[Member, ...] = ()
    removed: tuple[Member, ...] = ()
    # Same URL, other fields changed (e.g. a worker restarted on the same address).
    updated: tuple[Member, ...] = ()

    @property
    def empty(self) -> bool:
        """Whether nothing changed."""
        return not (self.added or self.removed or self.updated)


def normalize_url(url: str) -> str:
    """`url` as the pool keys it: no trailing slash."""
    return url.rstrip("/")


def diff_members(old: Sequence[Member], new: Sequence[Member]) -> MemberDiff:
    """Compare two member sets by URL (no trailing slash in what it returns); a URL listed
    twice counts once (its first listing)."""
    before = _by_url(old)
    after = _by_url(new)
    return MemberDiff(
        added=tuple(m for url, m in after.items() if url not in before),
        removed=tuple(m for url, m in before.items() if url not in after),
        updated=tuple(m for url, m in after.items() if url in before and before[url] != m),
    )


def _by_url(members: Sequence[Member]) -> dict[str, Member]:
    found: dict[str, Member] = {}
    for member in members:
        url = normalize_url(member.url)
        found.setdefault(url, replace(member, url=url))
    return found


class Membership(Protocol):
    """The router's source of workers.

    `start` must call the listener once with the initial set before it returns when that set
    can be had (a static list always; etcd within its start timeout), so the pool's first
    poll already sees the workers. The listener runs on the event loop and must not block.
    """

    async def start(self, listener: MembersListener) -> None:
        """Begin delivering member sets to `listener`."""
        ...

    def members(self) -> list[Member]:
        """The current member set, in join order."""
        ...

    @property
    def num_refused(self) -> int:
        """Registrations ignored so far: unreadable, or not signed by the cluster."""
        ...

    async def stop(self) -> None:
        """Stop delivering; the listener is not called after this returns."""
        ...


class Registration(Protocol):
    """A worker's membership: it is a member from `start` until `stop` or its death."""

    async def start(self) -> None:
        """Register (retrying in the background if the first attempt fails)."""
        ...

    async def stop(self) -> None:
        """Leave at once (not after a lease lapses) and release the connection."""
        ...
