"""Token-slot allocator: hands out and takes back the ids of KV-cache slots."""

from __future__ import annotations

from collections.abc import Iterable


class InvalidSlotError(ValueError):
    """Raised by `TokenSlotAllocator.free` for a double free or a slot it never handed out."""


class TokenSlotAllocator:
    """A pool of `size` KV slots with ids `0 .. size - 1`.

    The allocator owns every slot that is not handed out. `alloc` gives slots to a caller, who
    owns them until it passes them back with `free` (directly, or after a `RadixCache` returned
    them from `evict`). All work is done by C-level list and set operations, never a Python
    loop per slot.
    """

    __slots__ = ("_free", "_size", "_used")

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be a non-negative int, got {size!r}")
        self._size = size
        # A stack whose end is handed out first; reversed so that a fresh pool gives 0, 1, 2...
        self._free: list[int] = list(range(size - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def size(self) -> int:
        """Number of slots in the pool."""
        return self._size

    @property
    def available(self) -> int:
        """Number of free slots right now."""
        return len(self._free)

    @property
    def in_use(self) -> int:
        """Number of slots handed out and not freed yet."""
        return len(self._used)

    def alloc(self, n: int) -> list[int] | None:
        """Hand out `n` free slots, or return None (and change nothing) if fewer are free.

        Mutates the pool. The returned list is a new list owned by the caller.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"alloc needs a non-negative int, got {n!r}")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        self._used.update(out)
        return out

    def free(self, indices: Iterable[int]) -> None:
        """Give slots back to the pool.

        Raises `InvalidSlotError` and changes nothing if any index is not currently handed out
        (a double free, or an id this allocator never gave: out of range, wrong type) or if an
        index appears twice in `indices`.
        """
        idx = indices if isinstance(indices, list) else list(indices)
        if not idx:
            return
        wanted = set(idx)
        if len(wanted) != len(idx):
            raise InvalidSlotError("free() got the same slot twice in one call")
        if not wanted <= self._used:
            raise InvalidSlotError(self._describe_bad(wanted - self._used))
        self._used -= wanted
        self._free.extend(idx)

    def reset(self) -> None:
        """Take every slot back, as after construction (for a full cache flush)."""
        self._free = list(range(self._size - 1, -1, -1))
        self._used = set()

    def _describe_bad(self, bad: set[int]) -> str:
        sample = sorted(bad, key=repr)[0]
        if isinstance(sample, int) and not isinstance(sample, bool) and 0 <= sample < self._size:
            return f"slot {sample} is not allocated (double free?); {len(bad)} bad slot(s)"
        return (
            f"slot {sample!r} does not belong to this allocator (ids are 0..{self._size - 1}); "
            f"{len(bad)} bad slot(s)"
        )

    def __repr__(self) -> str:
        return f"TokenSlotAllocator(size={self._size}, available={self.available})"
