"""`StaticMembership`: a fixed list of worker URLs (`--worker`, and what `pdserve up` passes).

The set never changes after start, so the listener is called once. A worker of a static list
that dies stays a member; the pool's health polls keep it out of selection until it answers.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.membership.base import Member, MembersListener, normalize_url


class StaticMembership:
    """The configured URLs, in the configured order."""

    def __init__(self, urls: Sequence[str]) -> None:
        self._members = [Member(url=normalize_url(url)) for url in urls]

    async def start(self, listener: MembersListener) -> None:
        """Hand the listener the whole list, once."""
        listener(list(self._members))

    def members(self) -> list[Member]:
        """The configured workers."""
        return list(self._members)

    @property
    def num_refused(self) -> int:
        """A static list refuses nothing."""
        return 0

    async def stop(self) -> None:
        """Nothing runs in the background."""
