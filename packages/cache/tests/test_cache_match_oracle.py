"""Lookups on deep trees against a naive oracle: many edges per path, keys that differ inside
an edge after sharing its first token (or page), limits that end inside an edge.

The stateful tests interleave every operation on small trees; these build trees whose paths
have tens of edges, where a lookup walks by first tokens and then has to find which edge on
the way differs, and check every answer against the oracle's longest cached prefix.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable, Sequence

import pytest

from radixlm.cache import RadixCache, RadixNode

Key = tuple[int, ...]
FORMS: dict[str, Callable[[Key], Sequence[int]]] = {
    "list": list,
    "tuple": tuple,
    "array": lambda key: array("q", key),
}
# Wide token ids (negative, beyond 32 bits) beside a small alphabet that makes keys collide.
WIDE = (-(2**40), -7, 2**33 + 5, 2**63 - 1)


class Oracle:
    """Every cached page-aligned prefix and the slots of its last page (first insert wins)."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.pages: dict[Key, list[int]] = {}

    def longest(self, key: Key, limit: int) -> int:
        length = 0
        for end in range(self.page, limit - limit % self.page + 1, self.page):
            if key[:end] not in self.pages:
                break
            length = end
        return length

    def slots(self, key: Key, length: int) -> list[int]:
        return [s for end in range(self.page, length + 1, self.page) for s in self.pages[key[:end]]]

    def insert(self, key: Key, indices: list[int]) -> None:
        for end in range(self.page, len(key) - len(key) % self.page + 1, self.page):
            self.pages.setdefault(key[:end], indices[end - self.page : end])


def token(rng: random.Random) -> int:
    return rng.choice(WIDE) if rng.random() < 0.05 else rng.randrange(3)


def variant(rng: random.Random, keys: list[Key], page: int) -> Key:
    """A key near the cached ones: a prefix of one, with a token changed, cut or extended."""
    key = list(rng.choice(keys))
    if rng.random() < 0.6 and key:
        # Change a token that is not the first of its page, so the walk still finds the edge
        # by its first page and the difference is inside it (unless it starts the edge).
        at = rng.randrange(len(key))
        if page > 1 and at % page == 0:
            at = min(at + 1, len(key) - 1)
        key[at] = rng.choice([t for t in (0, 1, 2, *WIDE) if t != key[at]])
    cut = rng.randrange(len(key) + 1)
    tail = [token(rng) for _ in range(rng.randrange(0, 3 * page))]
    return tuple(key[:cut] + tail if rng.random() < 0.5 else key[:cut])


def build(rng: random.Random, page: int) -> tuple[RadixCache, Oracle, list[Key]]:
    """Keys that branch off each other at random points: paths of tens of edges."""
    cache, oracle = RadixCache(page_size=page), Oracle(page)
    keys: list[Key] = [tuple(token(rng) for _ in range(rng.randrange(40, 120)))]
    slot = 0
    for _ in range(120):
        base = rng.choice(keys)
        cut = rng.randrange(len(base) + 1)
        key = base[:cut] + tuple(token(rng) for _ in range(rng.randrange(1, 30)))
        indices = list(range(slot, slot + len(key)))
        slot += len(key)
        result = cache.insert(key, indices)
        stored = len(key) - len(key) % page
        assert result.prefix_len == oracle.longest(key, len(key))
        oracle.insert(key, indices)
        assert result.indices == oracle.slots(key, stored)
        keys.append(key)
    cache.check_invariants()
    return cache, oracle, keys


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("page", [1, 4])
def test_match_finds_the_oracles_longest_prefix_on_deep_paths(page: int, form: str) -> None:
    rng = random.Random(f"{page}-{form}")
    cache, oracle, keys = build(rng, page)
    deepest = max(edges_on_path(cache, key) for key in keys)
    assert deepest >= 10, "the tree should have paths of many edges"
    for i in range(400):
        key = variant(rng, keys, page)
        expected = oracle.longest(key, len(key))
        result = cache.match_prefix(FORMS[form](key))
        assert (result.length, result.indices) == (expected, oracle.slots(key, expected))
        prompt = oracle.longest(key, len(key) - 1)
        assert cache.match_prompt(FORMS[form](key)).length == prompt
        if i % 20 == 0:
            cache.check_invariants()  # the splits made on the way keep the tree consistent
    cache.check_invariants()


@pytest.mark.parametrize("page", [1, 4])
def test_insert_after_a_diverging_match_stores_only_the_new_part(page: int) -> None:
    rng = random.Random(page)
    cache, oracle, keys = build(rng, page)
    slot = 10**6
    for _ in range(200):
        key = variant(rng, keys, page)
        indices = list(range(slot, slot + len(key)))
        slot += len(key)
        result = cache.insert(FORMS["list"](key), indices)
        assert result.prefix_len == oracle.longest(key, len(key))
        oracle.insert(key, indices)
        assert result.indices == oracle.slots(key, len(key) - len(key) % page)
        keys.append(key)
    cache.check_invariants()
    assert cache.total_size == page * len(oracle.pages)


def edges_on_path(cache: RadixCache, key: Key) -> int:
    """How many edges the path of `key`'s longest match has (test-only introspection)."""
    node: RadixNode | None = cache.match_prefix(key).node
    count = 0
    while node is not None and node.parent is not None:
        count += 1
        node = node.parent
    return count
