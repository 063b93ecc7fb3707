"""Stored responses (the router's --enable-store): the newest `capacity` kept in memory, each
with the conversation that `previous_response_id` continues. One router's store: a
conversation continued through another router is a 400 naming the id, never another's."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as it was answered, and its conversation (input and output as chat
    messages, without instructions)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore:
    """The newest responses by id, oldest evicted first."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (never stored, or evicted)."""
        return self._items.get(response_id)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep `stored`; evict the oldest past capacity."""
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
