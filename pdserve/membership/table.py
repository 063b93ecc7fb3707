"""`MemberTable`: the router's copy of the registrations under one prefix. Pure.

It is fed what etcd says, in order: a whole listing (`replace`, at start and after a watch
was lost) and then single puts and deletes from the watch. `members()` lists them in join
order (the key's create revision), which is the order the pool numbers new workers in. A value
that does not decode drops its key from the table: a registration the router cannot read is
not a worker it may use.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.membership.base import Member, MembershipError
from pdserve.membership.codec import decode_member


@dataclass(frozen=True, slots=True)
class Row:
    """One key as etcd reports it."""

    key: bytes
    value: bytes
    create_revision: int


class MemberTable:
    """Registration keys → members, with the join order etcd gives them."""

    def __init__(self, key: bytes | None = None) -> None:
        """`key`: the cluster's membership key (values must carry its MAC); None: unsigned."""
        self._rows: dict[bytes, tuple[int, Member]] = {}
        self._key = key
        # Values refused so far (unreadable, or unsigned when a key is set).
        self.num_refused = 0

    def replace(self, rows: Iterable[Row]) -> list[MembershipError]:
        """Forget everything and load a whole listing; returns the values that did not decode."""
        self._rows = {}
        errors: list[MembershipError] = []
        for row in rows:
            try:
                self.put(row)
            except MembershipError as exc:
                errors.append(exc)
        return errors

    def put(self, row: Row) -> bool:
        """Apply a put; True if the member set changed. MembershipError if it did not decode
        (the key is dropped then)."""
        try:
            member = decode_member(row.value, self._key)
        except MembershipError as exc:
            self.num_refused += 1
            self.delete(row.key)
            raise MembershipError(f"key {row.key.decode(errors='replace')}: {exc}") from None
        previous = self._rows.get(row.key)
        self._rows[row.key] = (row.create_revision, member)
        return previous is None or previous[1] != member

    def delete(self, key: bytes) -> bool:
        """Apply a delete (or a lapsed lease); True if the member set changed."""
        return self._rows.pop(key, None) is not None

    def members(self) -> list[Member]:
        """Every member, in join order."""
        ordered = sorted(self._rows.items(), key=lambda item: (item[1][0], item[0]))
        return [member for _, (_, member) in ordered]
