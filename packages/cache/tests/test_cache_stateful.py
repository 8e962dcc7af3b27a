"""RadixCache against a naive oracle under random interleavings (hypothesis state machines).

The oracle remembers every cached prefix as a dict {(namespace, prefix tuple): slots of its last
page}. The cache's eviction order is its own business, so the oracle learns what was evicted
from the slot ids `evict` returns and checks that the result is still a consistent cache:
prefix-closed, with locked paths untouched and no slot returned twice. Slots come from a real
TokenSlotAllocator, so any slot leaked or returned twice also fails the run.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Sequence

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from radixlm.cache import RadixCache, RadixNode, TokenSlotAllocator

CAPACITY = 40
NAMESPACES: list[Hashable | None] = [None, "lora-a"]

Prefix = tuple[Hashable | None, tuple[int, ...]]
# The key types a caller may pass: a list (packed inside), an int64 array (used as is), a tuple.
FORMS = st.sampled_from([list, tuple, lambda key: array("q", key)])


def make_machine(page_size: int, alphabet: int, max_len: int) -> type[RuleBasedStateMachine]:
    keys = st.lists(st.integers(0, alphabet - 1), max_size=max_len).map(tuple)
    namespaces = st.sampled_from(NAMESPACES)

    class CacheMachine(RuleBasedStateMachine):
        locks = Bundle("locks")
        seen = Bundle("seen")  # keys inserted so far: queries reuse, cut and extend them
        queries = st.one_of(
            keys,
            seen,
            st.tuples(seen, st.integers(0, max_len)).map(lambda t: t[0][: t[1]]),
            st.tuples(seen, keys).map(lambda t: t[0] + t[1]),
        )

        def __init__(self) -> None:
            super().__init__()
            self.cache = RadixCache(page_size=page_size)
            self.pool = TokenSlotAllocator(CAPACITY)
            self.cached: dict[Prefix, list[int]] = {}  # prefixes end on a page boundary
            self.held: list[tuple[RadixNode, Prefix]] = []

        @initialize(policy=st.sampled_from(["lru", "lfu"]))
        def choose_policy(self, policy: str) -> None:
            self.cache = RadixCache(page_size=page_size, eviction_policy=policy)  # type: ignore[arg-type]

        # ----------------------------------------------------------------------------- oracle

        def aligned(self, n: int) -> int:
            return n - n % page_size

        def cached_length(self, ns: Hashable | None, key: tuple[int, ...], limit: int) -> int:
            length = 0
            for end in range(page_size, self.aligned(limit) + 1, page_size):
                if (ns, key[:end]) not in self.cached:
                    break
                length = end
            return length

        def slots_of(self, ns: Hashable | None, key: tuple[int, ...], length: int) -> list[int]:
            return [
                s
                for end in range(page_size, length + 1, page_size)
                for s in self.cached[(ns, key[:end])]
            ]

        def protected(self) -> set[Prefix]:
            return {
                (ns, key[:end])
                for _, (ns, key) in self.held
                for end in range(page_size, len(key) + 1, page_size)
            }

        def alloc(self, n: int) -> list[int] | None:
            if self.pool.available < n:
                self.release(self.cache.evict(n - self.pool.available), n - self.pool.available)
            return self.pool.alloc(n)

        def release(self, freed: list[int], wanted: int) -> None:
            assert len(set(freed)) == len(freed), "evict returned a slot twice"
            locked_slots = {s for p in self.protected() for s in self.cached[p]}
            assert not locked_slots & set(freed), "evict returned a slot of a locked path"
            by_slot = {s: prefix for prefix, page in self.cached.items() for s in page}
            assert all(s in by_slot for s in freed), "evict returned a slot it did not hold"
            gone = {by_slot[s] for s in freed}
            assert sum(len(self.cached[p]) for p in gone) == len(freed), "evicted part of a page"
            for prefix in gone:
                del self.cached[prefix]
            for ns, key in self.cached:
                assert len(key) <= page_size or (ns, key[:-page_size]) in self.cached
            if len(freed) < wanted:
                assert self.cache.evictable_size == 0
            self.pool.free(freed)

        def store(
            self, ns: Hashable | None, key: tuple[int, ...], indices: list[int], start: int
        ) -> None:
            for end in range(start + page_size, self.aligned(len(key)) + 1, page_size):
                self.cached[(ns, key[:end])] = indices[end - page_size : end]

        # ------------------------------------------------------------------------------ rules

        @rule(key=queries, ns=namespaces, form=FORMS)
        def match(
            self,
            key: tuple[int, ...],
            ns: Hashable | None,
            form: Callable[[tuple[int, ...]], Sequence[int]],
        ) -> None:
            result = self.cache.match_prefix(form(key), extra_key=ns)
            expected = self.cached_length(ns, key, len(key))
            assert result.length == expected == len(result.indices)
            assert result.indices == self.slots_of(ns, key, expected)

        @rule(key=queries, ns=namespaces)
        def match_prompt(self, key: tuple[int, ...], ns: Hashable | None) -> None:
            result = self.cache.match_prompt(key, extra_key=ns)
            assert result.length == self.cached_length(ns, key, len(key) - 1)
            assert result.length < max(len(key), 1)

        @rule(target=locks, key=queries, ns=namespaces)
        def match_and_lock(
            self, key: tuple[int, ...], ns: Hashable | None
        ) -> tuple[RadixNode, Prefix]:
            result = self.cache.match_prefix(list(key), extra_key=ns)
            self.cache.lock(result.node)
            entry = (result.node, (ns, key[: result.length]))
            self.held.append(entry)
            return entry

        @rule(entry=consumes(locks))
        def unlock(self, entry: tuple[RadixNode, Prefix]) -> None:
            if entry not in self.held:  # dropped by a reset
                return
            self.cache.unlock(entry[0])
            self.held.remove(entry)

        @rule(target=seen, key=queries, ns=namespaces)
        def serve_request(self, key: tuple[int, ...], ns: Hashable | None) -> tuple[int, ...]:
            """The runtime's flow: match, lock, allocate the rest, insert, free duplicates, unlock."""
            result = self.cache.match_prefix(key, extra_key=ns)
            self.cache.lock(result.node)
            entry = (result.node, (ns, key[: result.length]))
            self.held.append(entry)
            slots = self.alloc(len(key) - result.length)
            if slots is not None:
                indices = result.indices + slots
                inserted = self.cache.insert(key, indices, extra_key=ns)
                cached = inserted.prefix_len
                assert cached == result.length
                stored = self.aligned(len(key))
                self.pool.free(indices[result.length : cached] + indices[stored:])
                self.store(ns, key, indices, cached)
                assert inserted.indices == self.slots_of(ns, key, stored)
            self.cache.unlock(result.node)
            self.held.remove(entry)
            return key

        @rule(target=seen, key=queries, ns=namespaces, form=FORMS)
        def insert_blind(
            self,
            key: tuple[int, ...],
            ns: Hashable | None,
            form: Callable[[tuple[int, ...]], Sequence[int]],
        ) -> tuple[int, ...]:
            """Insert with the caller's own slots for every token: the cache keeps its own."""
            indices = self.alloc(len(key))
            if indices is None:
                return key
            expected = self.cached_length(ns, key, len(key))  # the alloc may have evicted
            inserted = self.cache.insert(form(key), indices, extra_key=ns)
            cached = inserted.prefix_len
            assert cached == expected
            stored = self.aligned(len(key))
            self.pool.free(indices[:cached] + indices[stored:])
            self.store(ns, key, indices, cached)
            assert inserted.indices == self.slots_of(ns, key, stored)
            return key

        @rule(num_tokens=st.integers(0, 2 * CAPACITY))
        def evict(self, num_tokens: int) -> None:
            self.release(self.cache.evict(num_tokens), num_tokens)

        @rule()
        def reset(self) -> None:
            self.pool.free(self.cache.reset())
            self.cached.clear()
            self.held.clear()

        # ------------------------------------------------------------------------- invariants

        @invariant()
        def consistent(self) -> None:
            self.cache.check_invariants()
            assert self.cache.total_size == page_size * len(self.cached)
            assert self.cache.protected_size == page_size * len(self.protected())
            assert self.pool.available + self.cache.total_size == CAPACITY

    return CacheMachine


# No deadline and no speed health check: the suite runs on shared, sometimes loaded machines.
STATEFUL = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestCacheAgainstOracle = make_machine(page_size=1, alphabet=3, max_len=12).TestCase
TestCacheAgainstOracle.settings = STATEFUL
TestPagedCacheAgainstOracle = make_machine(page_size=4, alphabet=2, max_len=14).TestCase
TestPagedCacheAgainstOracle.settings = STATEFUL
