"""`RadixCache.continuation`: the tokens the tree holds after a key (a speculative decoder's
draft source), against a naive oracle of the stored keys, and read-only."""

from __future__ import annotations

import random
from array import array

import pytest

from radixlm.cache import RadixCache


def stored(key: list[int], page: int) -> tuple[int, ...]:
    """What an insert of `key` keeps: its page-aligned part."""
    return tuple(key[: len(key) - len(key) % page])


@pytest.mark.parametrize("page", [1, 2, 4])
def test_continuations_agree_with_the_stored_keys(page: int) -> None:
    rng = random.Random(page)
    for _trial in range(40):
        cache = RadixCache(page_size=page)
        keys: list[tuple[int, ...]] = []
        slot = 0
        for _ in range(rng.randrange(1, 8)):
            base = list(rng.choice(keys)) if keys and rng.random() < 0.6 else []
            key = base[: rng.randrange(len(base) + 1)] + [rng.randrange(3) for _ in range(9)]
            cache.insert(key, list(range(slot, slot + len(key))))
            slot += len(key)
            keys.append(stored(key, page))
        for _ in range(30):
            source = rng.choice(keys)
            query = list(source[: rng.randrange(len(source) + 1)])
            if rng.random() < 0.3 and query:
                query[rng.randrange(len(query))] = rng.randrange(4)
            for form in (list, tuple, lambda k: array("q", k)):
                got = cache.continuation(form(query), 6)
                longer = [k for k in keys if len(k) > len(query) and list(k[: len(query)]) == query]
                if not query or not longer:
                    assert got == []
                    continue
                # What it returns is how some stored key goes on, as far as asked or the key.
                assert got, (query, keys)
                assert any(list(k[len(query) : len(query) + len(got)]) == got for k in longer)
                full = [k for k in longer if list(k[len(query) : len(query) + len(got)]) == got]
                assert len(got) == 6 or any(len(k) == len(query) + len(got) for k in full)


def test_at_a_branch_the_most_recently_used_child_wins() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5], [0, 1, 2, 3, 4])
    cache.insert([1, 2, 3, 9, 9, 9], [10, 11, 12, 13, 14, 15])
    assert cache.continuation([1, 2], 10) == [3, 9, 9, 9]
    cache.match_prefix([1, 2, 3, 4, 5])  # the older branch is used again
    assert cache.continuation([1, 2, 3], 10) == [4, 5]
    assert cache.continuation([1, 2, 3, 4, 5], 10) == []  # nothing after a whole key
    assert cache.continuation([1, 2, 3, 4], 1) == [5]


def test_namespaces_are_kept_apart() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2], extra_key="a")
    cache.insert([1, 2, 7], [3, 4, 5], extra_key="b")
    assert cache.continuation([1, 2], 4, extra_key="a") == [3]
    assert cache.continuation([1, 2], 4, extra_key="b") == [7]
    assert cache.continuation([1, 2], 4) == []


def test_a_partial_last_page_matches_inside_a_child() -> None:
    cache = RadixCache(page_size=4)
    cache.insert(list(range(12)), list(range(12)))
    assert cache.continuation([0, 1, 2, 3, 4, 5], 3) == [6, 7, 8]
    assert cache.continuation([0, 1, 2, 3, 4, 6], 3) == []


def test_it_changes_nothing() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5, 6], list(range(6)))
    cache.insert([1, 2, 8], [10, 11, 12])
    before = (cache.format_tree(), cache.stats, cache.node_count, cache.evictable_size)
    for query in ([1], [1, 2], [1, 2, 3, 4], [5], [1, 2, 8]):
        cache.continuation(query, 3)
    assert (cache.format_tree(), cache.stats, cache.node_count, cache.evictable_size) == before
    cache.check_invariants()
    assert RadixCache(disable=True).continuation([1, 2], 3) == []
