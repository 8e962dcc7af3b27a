"""The lower tiers' bookkeeping (a hierarchical cache): prefix hashes of pages, the page
index against a naive LRU oracle, and the tree's demotion events against what it held."""

from __future__ import annotations

import random

import pytest

from radixlm.cache import Demoted, PageIndex, RadixCache, namespace_hash, page_hashes


def test_a_page_hash_names_its_whole_prefix_and_namespace() -> None:
    start = namespace_hash("model", None)
    a = page_hashes(list(range(40)), 8, start)
    assert len(a) == 5 and len(set(a)) == 5
    # Same prefix, same hashes; a change in page 2 changes pages 2.. and not 0, 1.
    changed = list(range(40))
    changed[17] = 999
    b = page_hashes(changed, 8, start)
    assert b[:2] == a[:2] and all(x != y for x, y in zip(a[2:], b[2:], strict=True))
    # Another namespace (a LoRA adapter, a model) shares no page.
    other = page_hashes(list(range(40)), 8, namespace_hash("model", "adapter"))
    assert not set(other) & set(a)
    # A partial last page has no hash; a window of pages is the full list's window.
    assert page_hashes(list(range(47)), 8, start) == a
    assert page_hashes(list(range(40)), 8, start, first_page=2, count=2) == a[2:4]
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1], 0, start)


def test_the_page_index_is_an_lru_of_its_slots_against_an_oracle() -> None:
    """Random stores, matches, pins and discards against a list kept in use order."""
    rng = random.Random(0)
    index = PageIndex(6)
    order: list[bytes] = []  # oldest use first
    slots: dict[bytes, int] = {}
    pins: dict[bytes, int] = {}
    pages = [bytes([i]) * 4 for i in range(14)]
    for _ in range(3000):
        action = rng.random()
        page = rng.choice(pages)
        if action < 0.45:
            got = index.store(page)
            if page in slots:
                assert got == (slots[page], None)
                order.remove(page)
                order.append(page)
            elif len(slots) < 6:
                assert got is not None and got[1] is None
                slots[page] = got[0]
                order.append(page)
            else:
                victim = next((p for p in order if p not in pins), None)
                if victim is None:
                    assert got is None
                    continue
                assert got == (slots[victim], victim)
                order.remove(victim)
                slots[page] = slots.pop(victim)
                order.append(page)
        elif action < 0.7:
            run = rng.sample(pages, 3)
            want = []
            for p in run:
                if p not in slots:
                    break
                want.append(slots[p])
                order.remove(p)
                order.append(p)
            assert index.match(run) == want
        elif action < 0.85:
            if page in slots:
                index.pin(page)
                pins[page] = pins.get(page, 0) + 1
            else:
                with pytest.raises(KeyError):
                    index.pin(page)
        elif action < 0.95:
            if pins.get(page):
                index.unpin(page)
                pins[page] -= 1
                if not pins[page]:
                    del pins[page]
            else:
                with pytest.raises(ValueError):
                    index.unpin(page)
        else:
            index.discard(page)
            if page in slots and page not in pins:
                del slots[page]
                order.remove(page)
        index.check_invariants()
        assert len(index) == len(slots) and index.free_pages == 6 - len(slots)
        assert all(index.slot(p) == s for p, s in slots.items())


def test_the_page_index_counts_and_clears() -> None:
    index = PageIndex(2)
    a, b, c = b"a", b"b", b"c"
    index.store(a)
    index.store(b)
    assert index.match([a, b, c]) == [index.slot(a), index.slot(b)]
    assert index.store(c) is not None  # pushes a out (b was used after it)
    stats = index.stats
    assert (stats.lookups, stats.hits, stats.stored, stats.evicted) == (3, 2, 3, 1)
    index.pin(b)
    index.clear()
    assert len(index) == 0 and index.free_pages == 2
    index.check_invariants()
    with pytest.raises(ValueError, match="capacity"):
        PageIndex(-1)


@pytest.mark.parametrize("page_size", [1, 4])
def test_evict_tells_demote_each_leaf_with_its_whole_sequence(page_size: int) -> None:
    """Every evicted leaf is reported with the tokens and slots from the root to its end,
    while those slots are still the tree's: exactly what the tree held for that sequence."""
    rng = random.Random(page_size)
    cache = RadixCache(page_size=page_size)
    held: dict[tuple[int, ...], list[int]] = {}
    next_slot = 0
    for _ in range(40):
        base = rng.choice([[], [1, 2, 3, 4, 5, 6, 7, 8], [9] * 12])
        key = base + [rng.randrange(20) for _ in range(rng.randrange(1, 16))]
        key = key[: len(key) - len(key) % page_size] or [7] * page_size
        slots = list(range(next_slot, next_slot + len(key)))
        next_slot += len(key)
        result = cache.insert(key, slots)
        held[tuple(key)] = result.indices
    seen: list[Demoted] = []
    freed = cache.evict(cache.total_size, seen.append)
    assert cache.total_size == 0 and seen
    assert sorted(freed) == sorted({s for d in seen for s in d.slots[d.start :]})
    for leaf in seen:
        assert leaf.namespace is None and 0 <= leaf.start < len(leaf.tokens)
        assert len(leaf.slots) == len(leaf.tokens)
        # Some inserted key goes through this sequence, with these slots.
        assert any(
            tuple(key[: len(leaf.tokens)]) == tuple(leaf.tokens)
            and slots[: len(leaf.tokens)] == leaf.slots
            for key, slots in held.items()
        )
    # Without demote, evict behaves as before.
    cache.insert([1] * page_size, list(range(page_size)))
    assert cache.evict(1) == list(range(page_size))
