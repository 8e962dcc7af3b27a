"""ResponseStore: the latest stored Responses API responses, in memory, least recently used
dropped first (what `previous_response_id` and `GET /v1/responses/{id}` read)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A finished response: its body as sent, and the conversation that continues from it
    (every earlier turn's items, this request's input items, then this response's output
    items, as input items)."""

    body: dict[str, Any]
    conversation: tuple[Any, ...]


class ResponseStore:
    """At most `capacity` responses by id (0 keeps none). Not thread-safe: used from the event
    loop only."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0; got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Keep `entry` under `response_id`, dropping the least recently used beyond capacity."""
        if self.capacity == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (marked most recently used), or None when unknown or already dropped."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Drop one entry; whether it was there."""
        return self._entries.pop(response_id, None) is not None

    def check_invariants(self) -> None:
        assert len(self._entries) <= max(self.capacity, 0)
