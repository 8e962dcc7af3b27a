"""The tiers below the KV pool (a hierarchical cache, SGLang's HiCache): pages of KV named by
the hash of everything before and in them.

The radix tree (`RadixCache`) holds what is in the KV pool (L1). What it evicts can move to
host memory (L2) and to storage (L3) instead of being dropped: there a page of `page_size`
tokens is found by its *prefix hash*, a chain over the pages from the start of the sequence
(and its namespace), so that a page's hash names its whole prefix. A lookup walks a prompt's
page hashes from where the tree's match ends and stops at the first page no tier holds; the
same hashes name L3's files, so a restarted server or another replica finds them again.

`PageIndex` is a tier's bookkeeping: which page hashes it holds, in which of its page slots,
least recently used first out, pages pinned while a copy reads them. Like the tree it holds
no bytes: the runtime owns the memory and moves them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from radixlm.cache._node import pack_tokens

#: Bytes of a page hash (BLAKE2b's digest, cut: 2^-128 collisions are never met).
HASH_BYTES = 16


def namespace_hash(*parts: Hashable) -> bytes:
    """The hash a chain starts from: the model (its fingerprint), the namespace (LoRA
    adapter, cache salt ...): sequences of different namespaces never share a page."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=HASH_BYTES).digest()


def page_hashes(
    tokens: Sequence[int],
    page_size: int,
    start: bytes,
    first_page: int = 0,
    count: int | None = None,
) -> list[bytes]:
    """The prefix hashes of the whole pages of `tokens` (pages `first_page` .. on, at most
    `count` of them): page i's is BLAKE2b(page i - 1's hash + page i's int64 token ids), page
    -1's `start` (`namespace_hash`). Pages before `first_page` are hashed too (the chain needs
    them) but not returned."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    pages = len(tokens) // page_size
    if count is not None:
        pages = min(pages, first_page + count)
    packed = pack_tokens(tokens, 0, pages * page_size)
    width = 8 * page_size
    out: list[bytes] = []
    previous = start
    for page in range(pages):
        digest = hashlib.blake2b(previous, digest_size=HASH_BYTES)
        digest.update(packed[page * width : (page + 1) * width])
        previous = digest.digest()
        if page >= first_page:
            out.append(previous)
    return out


@dataclass(frozen=True, slots=True)
class TierStats:
    """A tier's counters: pages looked up and found, stored, and evicted out of it."""

    lookups: int
    hits: int
    stored: int
    evicted: int


class PageIndex:
    """Which pages one tier holds: page hash -> one of `capacity` page slots (0 ..
    capacity - 1), least recently used first out.

    `store` takes a free slot for a page, or the least recently used unpinned page's (the
    evicted hash is returned, so the caller can write its bytes further down first); `pin` /
    `unpin` keep a page in place while a copy reads or writes it. Not thread-safe: one thread
    (the scheduler's) calls it.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 pages, got {capacity}")
        self.capacity = capacity
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # oldest use first
        self._free = list(range(capacity - 1, -1, -1))
        self._pins: dict[bytes, int] = {}
        self._lookups = self._hits = self._stored = self._evicted = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, page: bytes) -> bool:
        return page in self._slots

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def stats(self) -> TierStats:
        return TierStats(self._lookups, self._hits, self._stored, self._evicted)

    def slot(self, page: bytes) -> int | None:
        """The page's slot (no change to its age), or None."""
        return self._slots.get(page)

    def match(self, pages: Sequence[bytes]) -> list[int]:
        """The slots of the leading run of `pages` this tier holds (they become the most
        recently used, the later pages of a run younger: a run is evicted from its end)."""
        found: list[int] = []
        self._lookups += len(pages)
        for page in pages:
            slot = self._slots.get(page)
            if slot is None:
                break
            self._slots.move_to_end(page)
            found.append(slot)
        self._hits += len(found)
        return found

    def store(self, page: bytes) -> tuple[int, bytes | None] | None:
        """A slot for `page` and the page it pushed out (None: a free slot was left), or None
        when the tier is full of pinned pages. A page already held keeps its slot (and is
        made the most recently used; nothing is pushed out)."""
        held = self._slots.get(page)
        if held is not None:
            self._slots.move_to_end(page)
            return held, None
        evicted: bytes | None = None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((p for p in self._slots if p not in self._pins), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
            evicted = victim
            self._evicted += 1
        self._slots[page] = slot
        self._stored += 1
        return slot, evicted

    def discard(self, page: bytes) -> None:
        """Forget `page` (its slot is free again); nothing when it is not held or pinned."""
        if page in self._pins:
            return
        slot = self._slots.pop(page, None)
        if slot is not None:
            self._free.append(slot)

    def pin(self, page: bytes) -> None:
        if page not in self._slots:
            raise KeyError("pin: the page is not in this tier")
        self._pins[page] = self._pins.get(page, 0) + 1

    def unpin(self, page: bytes) -> None:
        count = self._pins.get(page, 0)
        if count <= 0:
            raise ValueError("unpin: the page is not pinned")
        if count == 1:
            del self._pins[page]
        else:
            self._pins[page] = count - 1

    def clear(self) -> None:
        """Forget every page (pinned ones too: only when no copy is in flight)."""
        self._slots.clear()
        self._pins.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    def check_invariants(self) -> None:
        """Raise AssertionError if slots leak or repeat (every slot held once or free once,
        pins only on held pages). O(capacity); for tests."""
        held = list(self._slots.values())
        everything = held + self._free
        assert len(everything) == self.capacity, (
            f"page slots: {len(held)} held + {len(self._free)} free != {self.capacity}"
        )
        assert sorted(everything) == list(range(self.capacity)), "a page slot is lost or repeated"
        assert all(page in self._slots and count > 0 for page, count in self._pins.items()), (
            "a pin on a page the tier does not hold"
        )
