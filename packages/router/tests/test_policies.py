"""Every routing policy against simulated replicas: prefix affinity, the load-balance
thresholds, bounded trees, replicas that leave and come back."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from radixlm.router import (
    CacheAware,
    NoReplicaAvailable,
    PowerOfTwo,
    RandomChoice,
    Replica,
    RoundRobin,
    Router,
    ShortestQueue,
    make_policy,
    prompt_key,
    text_key,
)


def _prefix(seed: int, length: int = 64) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(length)]


def _workload(prefixes: int, per_prefix: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    """(prefix index, key) of `per_prefix` requests per shared prefix, interleaved: rounds of
    one request per prefix, each round in a random order (a fixed order would let round robin
    over an even number of replicas keep every prefix in place by accident)."""
    rng = random.Random(seed)
    heads = [_prefix(100 + p) for p in range(prefixes)]
    out = []
    for _ in range(per_prefix):
        order = list(range(prefixes))
        rng.shuffle(order)
        out += [(p, heads[p] + [rng.randrange(1000) for _ in range(8)]) for p in order]
    return out


def test_cache_aware_keeps_each_prefix_on_one_replica() -> None:
    router = Router("cache_aware", ["a", "b"])
    placed: dict[int, set[str]] = {}
    for prefix, key in _workload(4, 8):
        replica = router.choose(key)
        placed.setdefault(prefix, set()).add(replica.id)
    assert all(len(ids) == 1 for ids in placed.values()), placed
    # New prefixes go to the replica with the smaller tree: the four spread over both.
    assert Counter(next(iter(ids)) for ids in placed.values()) == {"a": 2, "b": 2}


def test_round_robin_scatters_the_same_prefixes() -> None:
    router = Router("round_robin", ["a", "b"])
    placed: dict[int, set[str]] = {}
    for prefix, key in _workload(4, 8):
        placed.setdefault(prefix, set()).add(router.choose(key).id)
    assert all(ids == {"a", "b"} for ids in placed.values())


def test_a_new_prefix_goes_to_the_smallest_tree() -> None:
    policy = CacheAware()
    router = Router(policy, ["a", "b"])
    router.choose(_prefix(1, 200))  # a holds 200 tokens now
    assert router.choose(_prefix(2, 10)).id == "b"
    assert policy.last is not None and policy.last.reason == "smallest_tree"
    again = router.choose([*_prefix(1, 200)[:150], 7, 7])
    assert again.id == "a" and policy.last.reason == "prefix" and policy.last.matched == 150


def test_a_short_match_below_the_threshold_does_not_attract() -> None:
    policy = CacheAware(cache_threshold=0.5)
    router = Router(policy, ["a", "b"])
    router.choose(_prefix(1, 20))  # a (both empty)
    router.choose(_prefix(2, 40))  # b (the smaller tree)
    router.choose(_prefix(1, 20) + _prefix(3, 60))  # 20 of 80 shared with a: 25%; a has less
    assert policy.tree_tokens("a") == 80 and policy.tree_tokens("b") == 40
    # 10 of 40 tokens shared with a (25% < 50%): not enough; b's tree is the smaller one.
    key = _prefix(1, 20)[:10] + _prefix(4, 30)
    assert router.choose(key).id == "b"
    assert policy.last is not None and policy.last.reason == "smallest_tree"
    assert policy.last.matched == 10


def test_imbalance_past_both_thresholds_sends_to_the_least_loaded() -> None:
    policy = CacheAware(balance_abs_threshold=4, balance_rel_threshold=2.0)
    router = Router(policy, ["a", "b"])
    key = _prefix(1)
    first = router.choose(key)
    for _ in range(5):
        router.begin(first.id)  # 5 in flight on it, 0 on the other
    other = router.choose(key)
    assert other.id != first.id and policy.last is not None and policy.last.reason == "balance"


def test_imbalance_below_either_threshold_keeps_the_prefix() -> None:
    policy = CacheAware(balance_abs_threshold=4, balance_rel_threshold=2.0)
    router = Router(policy, ["a", "b"])
    key = _prefix(1)
    first = router.choose(key).id
    second = "b" if first == "a" else "a"
    for _ in range(4):
        router.begin(second)  # 4 in flight on the other one
    for _ in range(7):
        router.begin(first)  # 7 vs 4: above 4 + 0 by 3 (< 4 absolute), and 7 < 2 * 4
    assert router.choose(key).id == first
    assert policy.last is not None and policy.last.reason == "prefix"
    # Reported load counts too: the other replica says it has 0 running, 0 queued; ours 20.
    router.report(first, running=20, queued=0)
    assert router.choose(key).id == second
    assert policy.last.reason == "balance"


def test_trees_are_bounded_and_evict_least_recently_used_keys() -> None:
    policy = CacheAware(max_tree_tokens=100)
    router = Router(policy, ["a"])
    old, recent = _prefix(1, 60), _prefix(2, 60)
    router.choose(old)
    router.choose(recent)
    assert policy.tree_tokens("a") <= 100
    assert policy.tree("a").match_prefix(recent).length == 60
    assert policy.tree("a").match_prefix(old).length == 0


def test_namespaces_never_share_a_prefix() -> None:
    policy = CacheAware()
    router = Router(policy, ["a", "b"])
    key = _prefix(1)
    first = router.choose(key, namespace="adapter-1").id
    router.choose(key, namespace="adapter-2")
    assert policy.last is not None and policy.last.matched == 0
    assert router.choose(key, namespace="adapter-1").id == first


def test_a_replica_that_goes_down_leaves_routing_and_comes_back_empty() -> None:
    policy = CacheAware()
    router = Router(policy, ["a", "b"])
    key = _prefix(1)
    home = router.choose(key).id
    router.mark_down(home)
    for _ in range(5):
        assert router.choose(key).id != home
    router.mark_up(home)
    assert policy.tree_tokens(home) == 0  # what it cached died with it
    other = "b" if home == "a" else "a"
    assert router.choose(key).id == other  # the prefix now lives on the other one
    router.mark_down("a")
    router.mark_down("b")
    with pytest.raises(NoReplicaAvailable, match="retry"):
        router.choose(key)


def test_power_of_two_prefers_the_less_loaded_of_two() -> None:
    router = Router(PowerOfTwo(seed=1), ["a", "b", "c"])
    for _ in range(10):
        router.begin("a")
    counts = Counter(router.choose([1, 2]).id for _ in range(300))
    assert counts["a"] == 0  # whenever it is drawn, the other one drawn is idle
    assert counts["b"] > 100 and counts["c"] > 100


def test_power_of_two_with_one_replica() -> None:
    assert Router(PowerOfTwo(), ["solo"]).choose([1]).id == "solo"


def test_random_and_round_robin_use_every_replica() -> None:
    rr = Router(RoundRobin(), ["a", "b", "c"])
    assert [rr.choose([1]).id for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    rnd = Router(RandomChoice(seed=0), ["a", "b"])
    assert set(rnd.choose([1]).id for _ in range(50)) == {"a", "b"}


def test_shortest_queue_takes_the_least_loaded_and_ties_take_turns() -> None:
    router = Router(ShortestQueue(), ["a", "b", "c"])
    assert [router.choose([1]).id for _ in range(4)] == ["a", "b", "c", "a"]  # all idle
    router.begin("a")
    router.begin("b")
    router.report("c", running=2)
    assert router.choose([1]).id in ("a", "b")
    router.begin("a")
    assert {router.choose([1]).id for _ in range(4)} == {"b"}
    assert make_policy("shortest_queue").name == "shortest_queue"


def test_policies_by_name_and_bad_options() -> None:
    assert make_policy("cache_aware", cache_threshold=0.5).name == "cache_aware"
    with pytest.raises(ValueError, match="must be one of cache_aware, round_robin"):
        make_policy("least_loaded")
    with pytest.raises(ValueError, match="cache_threshold must be in"):
        make_policy("cache_aware", cache_threshold=2)
    with pytest.raises(ValueError, match="unexpected keyword"):
        make_policy("round_robin", cache_threshold=0.5)


def test_replica_load_is_the_larger_of_in_flight_and_reported() -> None:
    replica = Replica("a", in_flight=3, running=1, queued=1)
    assert replica.load == 3
    replica.running = 6
    assert replica.load == 7


def test_keys_are_tokens_when_a_tokenizer_is_at_hand_else_bytes() -> None:
    class Tokenizer:
        def encode(self, text: str) -> list[int]:
            return [len(word) for word in text.split()]

    assert prompt_key([5, 6]) == [5, 6]
    assert prompt_key(text="ab cde", tokenizer=Tokenizer()) == [2, 3]
    assert prompt_key(text="ab") == text_key("ab") == [97, 98]
    assert prompt_key(text="é") == [0xC3, 0xA9]
    assert prompt_key() == []


def test_rank_puts_the_policys_choice_first_then_the_least_loaded() -> None:
    # The form a Ray Serve request router answers in (radixlm.router.ray uses it).
    router = Router("cache_aware")
    key = _prefix(1)
    first = router.rank(["x", "y", "z"], key, {"x": 0, "y": 0, "z": 0})
    home = first[0][0]
    assert sorted(first[1] + [home]) == ["x", "y", "z"]
    others = [c for c in ("x", "y", "z") if c != home]
    lens = {home: 1, others[0]: 5, others[1]: 2}
    assert router.rank(["x", "y", "z"], key, lens) == [[home], [others[1], others[0]]]
    # A candidate Ray no longer offers is not chosen; an unknown one is learnt.
    assert router.rank([others[0], "new"], key, {})[0][0] in (others[0], "new")
    assert router.rank([], key) == []


def test_with_shared_storage_a_prefix_no_replica_holds_goes_to_the_least_loaded() -> None:
    """Replicas whose hierarchical caches share one storage tier: a prefix the replica that
    computed it has forgotten (it restarted) is still in storage, so any replica hits it and
    the least loaded one gets it; without shared storage it is a new prefix."""
    for shared in (True, False):
        policy = CacheAware(shared_storage=shared)
        router = Router(policy, ["a", "b", "c"])
        head = _prefix(5, 200)
        owner = router.choose([*head, 1])
        router.forget(owner.id)  # its own tree is empty again (a restart)
        router.choose(_prefix(6, 300))  # some other replica now has the biggest tree
        busy = router.choose(_prefix(7, 10)).id
        for _ in range(2):
            router.begin(busy)
        chosen = router.choose([*head, 2])
        assert policy.last is not None
        if shared:
            assert policy.last.reason == "storage" and policy.last.matched == 200
            assert chosen.id != busy
        else:
            assert policy.last.reason == "smallest_tree" and policy.last.matched == 0
