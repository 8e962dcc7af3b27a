"""Which LoRA adapter sits in which slot of the pool (rank 0's scheduler owns this table).

A running request holds its adapter's slot; an adapter that no running request uses keeps its
slot until another adapter needs one (least recently used first), so a popular adapter is
not copied in again at every admission. The scheduler admits a request only when its adapter
is in a slot or can get one: one step never needs more adapters than the pool holds.
"""

from __future__ import annotations

from collections import Counter


class AdapterSlots:
    """The slot table: adapter uid -> slot, with the running requests using each."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"max_loras_per_batch must be >= 1; got {num_slots}")
        self.num_slots = num_slots
        #: Per slot: (uid, adapter directory) or None.
        self.table: list[tuple[str, str] | None] = [None] * num_slots
        self.users: Counter[str] = Counter()
        self._slot: dict[str, int] = {}
        self._clock = 0
        self._last_used: dict[str, int] = {}

    def slot_of(self, uid: str) -> int:
        return self._slot[uid]

    def resident(self, uid: str) -> bool:
        return uid in self._slot

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used slot no running request uses."""
        for slot, entry in enumerate(self.table):
            if entry is None:
                return slot
        idle = [uid for uid in self._slot if self.users[uid] == 0]
        if not idle:
            return None
        return self._slot[min(idle, key=lambda uid: self._last_used.get(uid, 0))]

    def can_place(self, uid: str) -> bool:
        return uid in self._slot or self._free_slot() is not None

    def acquire(self, uid: str, path: str) -> int:
        """Put `uid` in a slot if it is not in one (evicting an idle adapter) and count one
        more running user. The caller checked `can_place`."""
        slot = self._slot.get(uid)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                raise RuntimeError("no LoRA slot is free; check can_place before acquire")
            evicted = self.table[slot]
            if evicted is not None:
                del self._slot[evicted[0]]
            self.table[slot] = (uid, path)
            self._slot[uid] = slot
        self.users[uid] += 1
        self._clock += 1
        self._last_used[uid] = self._clock
        return slot

    def release(self, uid: str) -> None:
        """One running user of `uid` ended (finished, aborted or retracted)."""
        self.users[uid] -= 1
        if self.users[uid] <= 0:
            del self.users[uid]

    def drop(self, uid: str) -> None:
        """Forget an unloaded adapter that no request uses any more (its slot empties)."""
        if self.users[uid] > 0:
            raise RuntimeError(f"LoRA adapter {uid} still has running requests")
        slot = self._slot.pop(uid, None)
        if slot is not None:
            self.table[slot] = None
        self._last_used.pop(uid, None)

    def snapshot(self) -> tuple[tuple[str, str] | None, ...]:
        return tuple(self.table)
