"""Behaviour of TokenSlotAllocator: alloc, free and the errors a caller can cause."""

from __future__ import annotations

import pytest

from radixlm.cache import InvalidSlotError, TokenSlotAllocator


def test_a_fresh_pool_hands_out_ascending_slots() -> None:
    pool = TokenSlotAllocator(8)
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.alloc(2) == [3, 4]
    assert (pool.available, pool.in_use, pool.size) == (3, 5, 8)


def test_alloc_beyond_what_is_free_returns_none_and_changes_nothing() -> None:
    pool = TokenSlotAllocator(4)
    pool.alloc(3)
    assert pool.alloc(2) is None
    assert pool.available == 1


def test_alloc_of_zero_returns_an_empty_list() -> None:
    assert TokenSlotAllocator(2).alloc(0) == []


def test_alloc_of_a_negative_count_raises() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        TokenSlotAllocator(2).alloc(-1)


def test_freed_slots_can_be_allocated_again() -> None:
    pool = TokenSlotAllocator(4)
    slots = pool.alloc(4)
    assert slots is not None
    pool.free(slots[1:3])
    assert sorted(pool.alloc(2) or []) == [1, 2]
    assert pool.available == 0


def test_double_free_raises_and_changes_nothing() -> None:
    pool = TokenSlotAllocator(4)
    slots = pool.alloc(2)
    assert slots is not None
    pool.free(slots)
    with pytest.raises(InvalidSlotError, match="not allocated"):
        pool.free([slots[0]])
    assert pool.available == 4


def test_a_slot_twice_in_one_free_raises() -> None:
    pool = TokenSlotAllocator(4)
    pool.alloc(2)
    with pytest.raises(InvalidSlotError, match="twice"):
        pool.free([0, 0])
    assert pool.in_use == 2


@pytest.mark.parametrize("foreign", [4, -1, 100, "0"])
def test_a_foreign_index_raises(foreign: object) -> None:
    pool = TokenSlotAllocator(4)
    pool.alloc(4)
    with pytest.raises(InvalidSlotError, match="does not belong"):
        pool.free([0, foreign])  # type: ignore[list-item]
    assert pool.in_use == 4


def test_free_of_a_never_allocated_slot_in_range_raises() -> None:
    pool = TokenSlotAllocator(4)
    with pytest.raises(InvalidSlotError, match="not allocated"):
        pool.free([2])


def test_free_accepts_any_iterable() -> None:
    pool = TokenSlotAllocator(4)
    pool.alloc(3)
    pool.free(range(3))
    assert pool.available == 4


def test_reset_takes_every_slot_back() -> None:
    pool = TokenSlotAllocator(3)
    pool.alloc(3)
    pool.reset()
    assert (pool.available, pool.alloc(3)) == (3, [0, 1, 2])


@pytest.mark.parametrize("size", [-1, 2.0, True])
def test_bad_size_is_rejected(size: object) -> None:
    with pytest.raises(ValueError, match="size"):
        TokenSlotAllocator(size)  # type: ignore[arg-type]
