"""Behaviour of RadixCache: matching, inserting, splitting, locks, eviction, namespaces."""

from __future__ import annotations

from array import array

import pytest

from radixlm.cache import CacheStats, InsertResult, MatchResult, RadixCache, RadixNode

Tree = dict[tuple[int, ...], "Tree"]


def edges(cache: RadixCache) -> Tree:
    """The tree as nested dicts keyed by each edge's token ids (test-only introspection)."""

    def walk(node: RadixNode) -> Tree:
        return {tuple(child.tokens()): walk(child) for child in node.children.values()}

    return walk(cache._root)


def slots(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_empty_cache_matches_nothing() -> None:
    cache = RadixCache()
    result = cache.match_prefix([1, 2, 3])
    assert result == MatchResult([], result.node, 0)
    assert cache.total_size == 0


def test_insert_stores_a_sequence_as_one_edge() -> None:
    cache = RadixCache()
    assert cache.insert([1, 2, 3, 4], slots(10, 4)).prefix_len == 0
    assert edges(cache) == {(1, 2, 3, 4): {}}
    assert cache.total_size == cache.evictable_size == 4


def test_insert_returns_the_already_cached_length() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots(10, 4))
    assert cache.insert([1, 2, 3, 9, 9], slots(20, 5)).prefix_len == 3
    assert cache.insert([1, 2], slots(30, 2)).prefix_len == 2
    assert cache.total_size == 6


def test_insert_keeps_the_cached_slots_for_the_shared_part() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 2, 3, 4], [20, 21, 22, 23])
    assert cache.match_prefix([1, 2, 3, 4]).indices == [10, 11, 12, 23]


def test_match_returns_the_slots_of_the_longest_cached_prefix() -> None:
    cache = RadixCache()
    cache.insert([5, 6, 7, 8], [50, 60, 70, 80])
    result = cache.match_prefix([5, 6, 7, 8, 9])
    assert (result.indices, result.length) == ([50, 60, 70, 80], 4)


def test_match_ending_inside_an_edge_splits_it() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5], slots(0, 5))
    result = cache.match_prefix([1, 2, 3, 7])
    assert result.length == 3
    assert edges(cache) == {(1, 2, 3): {(4, 5): {}}}
    assert result.node.tokens() == [1, 2, 3]
    cache.check_invariants()


def test_insert_diverging_inside_an_edge_splits_it_and_adds_a_leaf() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5], slots(0, 5))
    cache.insert([1, 2, 9], slots(10, 3))
    assert edges(cache) == {(1, 2): {(3, 4, 5): {}, (9,): {}}}
    cache.check_invariants()


def test_insert_of_a_cached_prefix_splits_the_edge_where_the_key_ends() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5], slots(0, 5))
    result = cache.insert([1, 2, 3], slots(10, 3))
    assert result == InsertResult(3, result.node, [0, 1, 2])
    assert edges(cache) == {(1, 2, 3): {(4, 5): {}}}
    assert result.node.tokens() == [1, 2, 3]
    cache.check_invariants()


def test_insert_returns_the_node_ending_the_key_and_the_cache_slots_for_it() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], [10, 11, 12])
    result = cache.insert([1, 2, 3, 4, 5], [20, 21, 22, 23, 24])
    assert (result.prefix_len, result.indices) == (3, [10, 11, 12, 23, 24])
    assert result.node.tokens() == [4, 5]


def insert_then_match(
    cache: RadixCache, key: list[int], start: int, extra_key: str | None = None
) -> tuple[InsertResult, MatchResult]:
    inserted = cache.insert(key, slots(start, len(key)), extra_key)
    return inserted, cache.match_prefix(key, extra_key)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("extra_key", [None, "lora-a"])
def test_insert_result_is_what_a_match_right_after_returns(
    page_size: int, extra_key: str | None
) -> None:
    cache = RadixCache(page_size=page_size)
    cache.insert(list(range(12)), slots(100, 12))  # in the default namespace
    keys = [
        list(range(10)),  # a prefix of that edge (split where it ends), or new with extra_key
        list(range(6)),  # a shorter prefix: another split, at a page boundary
        [*range(8), 50, 51, 52, 53, 54],  # diverges after 8 tokens: a split and a new leaf
        [*range(8), 50, 51, 52, 53, 54],  # all cached already: the same node, no new leaf
        [7, 7, 7],  # new; with pages of 4 shorter than a page: nothing stored, the root handle
    ]
    for i, key in enumerate(keys):
        inserted, match = insert_then_match(cache, key, 1000 * (i + 1), extra_key)
        stored = len(key) - len(key) % page_size
        assert match.length == stored
        assert inserted.node is match.node
        assert inserted.indices == match.indices
        cache.check_invariants()


def test_insert_result_node_can_be_locked_in_place_of_a_second_match() -> None:
    cache = RadixCache()
    result = cache.insert([1, 2, 3], slots(0, 3))
    cache.lock(result.node)
    assert (cache.protected_size, cache.evict(10)) == (3, [])
    cache.unlock(result.node)
    assert cache.evict(10) == [0, 1, 2]


def test_match_checks_every_edge_on_the_path_not_only_its_first_token() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(0, 3))
    cache.insert([1, 2, 3, 4, 5, 6], slots(10, 6))
    result = cache.match_prefix([1, 9, 3, 4, 5, 6])  # the first edge differs inside
    assert (result.length, result.indices) == (1, [0])
    assert edges(cache) == {(1,): {(2, 3): {(4, 5, 6): {}}}}
    cache.check_invariants()


def test_a_handle_stays_valid_when_its_edge_is_split_later() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots(0, 4))
    result = cache.match_prefix([1, 2, 3, 4])
    cache.insert([1, 2, 7], slots(10, 3))  # splits the matched edge above the handle
    cache.lock(result.node)
    assert cache.protected_size == 4
    assert cache.evict(100) == [12]
    cache.check_invariants()


def test_keys_may_be_tuples_or_int64_arrays() -> None:
    cache = RadixCache()
    cache.insert((1, 2, 3), (10, 11, 12))
    cache.insert(array("q", [1, 2, 4]), array("q", [20, 21, 22]))
    assert cache.match_prefix(array("q", [1, 2, 3])).indices == [10, 11, 12]
    assert cache.match_prefix((1, 2, 4)).indices == [10, 11, 22]
    cache.check_invariants()


def test_token_ids_outside_int64_are_rejected() -> None:
    cache = RadixCache()
    with pytest.raises(ValueError, match="int64"):
        cache.insert([1, 2**70], [0, 1])


def test_insert_needs_one_slot_per_token() -> None:
    with pytest.raises(ValueError, match="one slot id per token"):
        RadixCache().insert([1, 2, 3], [0, 1])


def test_match_prompt_never_reports_a_full_prompt_hit() -> None:
    cache = RadixCache()
    prompt = [1, 2, 3, 4]
    cache.insert(prompt, slots(0, 4))
    result = cache.match_prompt(prompt)
    assert result.length == 3
    assert result.indices == [0, 1, 2]


def test_match_prompt_with_pages_leaves_the_last_token_to_compute() -> None:
    cache = RadixCache(page_size=4)
    prompt = list(range(8))
    cache.insert(prompt, slots(0, 8))
    assert cache.match_prompt(prompt).length == 4
    assert cache.match_prompt([*prompt, 99]).length == 8


def test_match_prompt_of_one_token_matches_nothing() -> None:
    cache = RadixCache()
    cache.insert([7], [0])
    assert cache.match_prompt([7]).length == 0


# ---------------------------------------------------------------------------------- pages


def test_pages_store_only_whole_pages() -> None:
    cache = RadixCache(page_size=4)
    assert cache.insert(list(range(10)), slots(0, 10)).prefix_len == 0
    assert cache.total_size == 8
    assert cache.match_prefix(list(range(10))).length == 8


def test_pages_match_is_rounded_down_to_a_page() -> None:
    cache = RadixCache(page_size=4)
    cache.insert(list(range(8)), slots(0, 8))
    result = cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 99])
    assert result.length == 4
    assert edges(cache) == {(0, 1, 2, 3): {(4, 5, 6, 7): {}}}


def test_pages_children_are_found_by_their_first_page() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], slots(0, 4))
    cache.insert([1, 5, 3, 4], slots(10, 4))
    assert edges(cache) == {(1, 2, 3, 4): {}, (1, 5, 3, 4): {}}
    assert cache.match_prefix([1, 5, 3, 4]).indices == slots(10, 4)
    cache.check_invariants()


def test_pages_insert_returns_a_page_aligned_cached_length() -> None:
    cache = RadixCache(page_size=4)
    cache.insert(list(range(8)), slots(0, 8))
    assert cache.insert([0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11], slots(20, 12)).prefix_len == 4


def test_a_key_shorter_than_a_page_is_not_stored() -> None:
    cache = RadixCache(page_size=4)
    assert cache.insert([1, 2, 3], [0, 1, 2]).prefix_len == 0
    assert cache.total_size == 0


# ----------------------------------------------------------------------------- namespaces


def test_namespaces_never_share_nodes() -> None:
    cache = RadixCache()
    key = [1, 2, 3]
    assert cache.insert(key, slots(0, 3)).prefix_len == 0
    assert cache.insert(key, slots(10, 3), extra_key="lora-a").prefix_len == 0
    assert cache.match_prefix(key, extra_key="lora-b").length == 0
    assert cache.match_prefix(key, extra_key="lora-a").indices == slots(10, 3)
    assert cache.match_prefix(key).indices == slots(0, 3)
    assert cache.total_size == 6
    cache.check_invariants()


def test_namespaces_with_pages_never_share_nodes() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], slots(0, 4), extra_key=("salt", 1))
    cache.insert([1, 2, 3, 4], slots(10, 4))
    assert cache.match_prefix([1, 2, 3, 4], extra_key=("salt", 1)).indices == slots(0, 4)
    assert cache.match_prefix([1, 2, 3, 4], extra_key=("salt", 2)).length == 0
    cache.check_invariants()


# ---------------------------------------------------------------------------------- locks


def test_lock_moves_the_path_to_protected() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots(0, 4))
    cache.insert([1, 2, 5], slots(10, 3))
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    assert (cache.protected_size, cache.evictable_size) == (4, 1)
    cache.unlock(node)
    assert (cache.protected_size, cache.evictable_size) == (0, 5)


def test_locks_are_reference_counted() -> None:
    cache = RadixCache()
    cache.insert([1, 2], slots(0, 2))
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    cache.lock(node)
    cache.unlock(node)
    assert cache.evict(10) == []
    cache.unlock(node)
    assert cache.evict(10) == [0, 1]


def test_unlock_without_lock_raises() -> None:
    cache = RadixCache()
    cache.insert([1], [0])
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(cache.match_prefix([1]).node)


def test_locking_an_evicted_handle_raises() -> None:
    cache = RadixCache()
    cache.insert([1, 2], slots(0, 2))
    node = cache.match_prefix([1, 2]).node
    cache.evict(2)
    with pytest.raises(ValueError, match="not in this cache"):
        cache.lock(node)


def test_locking_a_handle_of_another_cache_raises() -> None:
    other = RadixCache()
    other.insert([1], [0])
    with pytest.raises(ValueError, match="not in this cache"):
        RadixCache().lock(other.match_prefix([1]).node)


def test_locking_the_root_of_an_empty_match_is_a_no_op() -> None:
    cache = RadixCache()
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    cache.unlock(node)
    assert cache.protected_size == 0


# ------------------------------------------------------------------------------- eviction


def test_evict_frees_least_recently_used_leaves_first() -> None:
    cache = RadixCache()
    cache.insert([1, 1], [0, 1])
    cache.insert([2, 2], [2, 3])
    cache.insert([3, 3], [4, 5])
    cache.match_prefix([1, 1])
    assert cache.evict(2) == [2, 3]
    assert cache.evict(2) == [4, 5]


def test_evict_cascades_to_parents_that_become_leaves() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(0, 3))
    cache.insert([1, 2, 4], slots(10, 3))
    cache.insert([9], [20])
    cache.match_prefix([9])
    assert sorted(cache.evict(4)) == [0, 1, 2, 12]
    assert edges(cache) == {(9,): {}}


def test_evict_never_touches_a_locked_path() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(0, 3))
    cache.insert([1, 2, 4], slots(10, 3))
    cache.lock(cache.match_prefix([1, 2, 3]).node)
    assert cache.evict(100) == [12]
    assert cache.total_size == cache.protected_size == 3


def test_evict_removes_whole_leaves() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots(0, 4))
    assert cache.evict(1) == [0, 1, 2, 3]


def test_lfu_evicts_the_least_used_leaf_even_if_more_recent() -> None:
    cache = RadixCache(eviction_policy="lfu")
    cache.insert([1], [0])
    cache.insert([2], [1])
    for _ in range(3):
        cache.match_prefix([1])
    cache.insert([3], [2])
    cache.match_prefix([3])
    assert cache.evict(1) == [1]
    assert cache.evict(1) == [2]


def test_lfu_breaks_ties_by_least_recent_use() -> None:
    cache = RadixCache(eviction_policy="lfu")
    cache.insert([1], [0])
    cache.insert([2], [1])
    assert cache.evict(1) == [0]


def test_evict_of_zero_tokens_frees_nothing() -> None:
    cache = RadixCache()
    cache.insert([1], [0])
    assert cache.evict(0) == []


def test_many_touches_keep_the_candidate_heap_small() -> None:
    cache = RadixCache()
    cache.insert([1, 2], [0, 1])
    for _ in range(5000):
        cache.match_prefix([1, 2])
    assert len(cache._heap) <= 2048
    assert cache.evict(1) == [0, 1]


# ------------------------------------------------------------------------ whole-tree calls


def test_reset_empties_the_tree_and_returns_every_slot() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], slots(0, 3))
    cache.insert([1, 5], slots(10, 2))
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    assert sorted(cache.reset()) == [0, 1, 2, 11]
    assert (cache.total_size, cache.protected_size, cache.node_count) == (0, 0, 0)
    assert cache.stats == CacheStats(0, 0, 0, 0, 0)
    with pytest.raises(ValueError):
        cache.unlock(node)
    cache.check_invariants()


def test_stats_count_queries_matches_inserts_and_evictions() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots(0, 4))
    cache.match_prefix([1, 2, 9, 9])
    cache.match_prefix([7, 7, 7, 7])
    cache.evict(100)
    assert cache.stats == CacheStats(
        queries=2, query_tokens=8, matched_tokens=2, inserted_tokens=4, evicted_tokens=4
    )
    assert cache.stats.hit_rate == 0.25


def test_check_invariants_detects_a_slot_held_twice() -> None:
    cache = RadixCache()
    cache.insert([1, 2], [5, 5])
    with pytest.raises(AssertionError, match="more than one token"):
        cache.check_invariants()


def test_check_invariants_detects_drifted_sizes() -> None:
    cache = RadixCache()
    cache.insert([1, 2], [0, 1])
    cache._evictable += 1
    with pytest.raises(AssertionError, match="sizes drifted"):
        cache.check_invariants()


def test_check_invariants_detects_a_node_that_misplaces_its_end() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 9], [3, 4, 5])  # splits [1 2 3] after two tokens
    cache.check_invariants()
    lower = cache.match_prefix([1, 2, 3]).node
    lower.end += 1
    with pytest.raises(AssertionError, match="ends at token 4, not 3"):
        cache.check_invariants()


def test_format_tree_shows_edges_locks_and_namespaces() -> None:
    cache = RadixCache()
    cache.insert(list(range(20)), slots(0, 20))
    cache.insert([0, 1, 99], slots(100, 3), extra_key="lora")
    cache.lock(cache.match_prefix([0, 1, 2]).node)
    text = cache.format_tree(max_tokens=3)
    assert "[0 1 2] (3) lock=1" in text
    assert "[3 4 5 …+14] (17)" in text
    assert "ns='lora'" in text
    assert text.splitlines()[0].startswith("RadixCache page_size=1 policy=lru: 23 tokens")


def test_pretty_print_prints_the_tree(capsys: pytest.CaptureFixture[str]) -> None:
    cache = RadixCache()
    cache.insert([4, 2], [0, 1])
    cache.pretty_print()
    assert "└── [4 2] (2)" in capsys.readouterr().out


# ------------------------------------------------------------------------------- disabled


def test_disabled_cache_matches_nothing_and_stores_nothing() -> None:
    cache = RadixCache(disable=True)
    inserted = cache.insert([1, 2, 3], slots(0, 3))
    assert (inserted.prefix_len, inserted.indices) == (3, [])
    result = cache.match_prefix([1, 2, 3])
    assert (result.indices, result.length) == ([], 0)
    cache.lock(result.node)
    cache.unlock(result.node)
    assert (cache.total_size, cache.evict(10), cache.reset()) == (0, [], [])
    cache.check_invariants()


def test_disabled_cache_insert_lets_the_caller_free_all_its_slots() -> None:
    cache = RadixCache(page_size=4, disable=True)
    indices = slots(0, 10)
    stored = cache.insert(list(range(10)), indices).prefix_len
    assert indices[:stored] + indices[8:] == indices


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("page_size", [0, -1, 1.5, True])
def test_bad_page_size_is_rejected(page_size: object) -> None:
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(page_size=page_size)  # type: ignore[arg-type]


def test_unknown_eviction_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="eviction_policy"):
        RadixCache(eviction_policy="fifo")  # type: ignore[arg-type]


def test_splitting_a_locked_edge_keeps_the_whole_path_locked() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], slots(0, 4))
    cache.lock(cache.match_prefix([1, 2, 3, 4]).node)
    cache.match_prefix([1, 2, 9])
    assert (cache.protected_size, cache.evict(100)) == (4, [])
    cache.check_invariants()


def test_the_handle_of_an_empty_match_survives_a_reset() -> None:
    cache = RadixCache()
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    cache.reset()
    cache.unlock(node)
    assert cache.protected_size == 0
