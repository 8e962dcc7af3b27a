"""Routing policies: which replica gets a request.

A policy sees the request's key (its prompt as token ids, or its text as UTF-8 bytes: see
`radixlm.router.keys`) and the replicas that can take it, each with the load the router knows
(`Replica.load`), and picks one. They share one small interface, `Policy`:

- `cache_aware` (SGLang's router policy): each replica has an approximate prefix tree of the
  keys sent to it — `radixlm.cache.RadixCache`, holding no KV slots, bounded in tokens and
  evicted least-recently-used. A request goes to the replica whose tree shares the longest
  prefix with its key, when that covers at least `cache_threshold` of the key; otherwise to the
  replica with the smallest tree (the one with the most room, which spreads new prefixes). When
  the load is out of balance — the busiest replica's load exceeds the idlest one's by more than
  `balance_abs_threshold` *and* by more than `balance_rel_threshold` times — the idlest one
  gets it, whatever the trees say. With `shared_storage` (the replicas' hierarchical caches
  share one storage tier, `--hicache-storage-backend file` on a shared directory), a key
  sent to any replica is also recorded in a tree of what that storage holds: a request that
  no replica's own tree covers but the storage's does goes to the least loaded replica
  (every replica can read those pages), reason `storage`.
- `round_robin`: each replica in turn.
- `power_of_two`: two replicas at random, the less loaded one.
- `shortest_queue`: the least loaded replica (ties in turn): what a pool of decode workers
  wants, where the prompt's prefix does not matter.
- `random`: one at random.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from radixlm.cache import RadixCache


@dataclass
class Replica:
    """What the router knows of one replica: requests it sent there and has not seen finish,
    and what the replica last reported (`/get_server_info`: running, queued, token usage)."""

    id: str
    in_flight: int = 0
    running: int = 0
    queued: int = 0
    token_usage: float = 0.0
    healthy: bool = True

    @property
    def load(self) -> int:
        """Requests on the replica: the router's own count, or what the replica reported when
        that is more (other routers, or requests sent around this one)."""
        return max(self.in_flight, self.running + self.queued)


class Policy(Protocol):
    """Picks a replica for a request."""

    name: str

    def choose(
        self, key: Sequence[int], replicas: Sequence[Replica], namespace: Hashable | None = None
    ) -> Replica:
        """One of `replicas` (never empty: healthy ones only) for a request whose prompt is
        `key`; `namespace` separates keys that must never share a prefix (another adapter)."""
        ...

    def forget(self, replica_id: str) -> None:
        """The replica lost what it held (it died and restarted, or it left)."""
        ...


class RoundRobin:
    """Each replica in turn (the order of their ids)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(
        self, key: Sequence[int], replicas: Sequence[Replica], namespace: Hashable | None = None
    ) -> Replica:
        ordered = sorted(replicas, key=lambda r: r.id)
        return ordered[next(self._turn) % len(ordered)]

    def forget(self, replica_id: str) -> None:
        pass


class RandomChoice:
    """One replica at random."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(
        self, key: Sequence[int], replicas: Sequence[Replica], namespace: Hashable | None = None
    ) -> Replica:
        return self._rng.choice(list(replicas))

    def forget(self, replica_id: str) -> None:
        pass


class PowerOfTwo:
    """Two replicas at random; the less loaded one (ties: either)."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(
        self, key: Sequence[int], replicas: Sequence[Replica], namespace: Hashable | None = None
    ) -> Replica:
        if len(replicas) == 1:
            return replicas[0]
        first, second = self._rng.sample(list(replicas), 2)
        return second if second.load < first.load else first

    def forget(self, replica_id: str) -> None:
        pass


class ShortestQueue:
    """The least loaded replica; replicas equally loaded take turns (so that requests that
    each finish before the next arrives still spread)."""

    name = "shortest_queue"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(
        self, key: Sequence[int], replicas: Sequence[Replica], namespace: Hashable | None = None
    ) -> Replica:
        least = min(r.load for r in replicas)
        idlest = sorted((r for r in replicas if r.load == least), key=lambda r: r.id)
        return idlest[next(self._turn) % len(idlest)]

    def forget(self, replica_id: str) -> None:
        pass


@dataclass(frozen=True)
class CacheAwareDecision:
    """Why `CacheAware` picked its last replica (for tests, logs and metrics)."""

    replica: str
    reason: str  # "prefix" | "storage" | "smallest_tree" | "balance"
    matched: int


class CacheAware:
    """Longest prefix match over per-replica approximate trees, within load-balance thresholds
    (see the module docstring)."""

    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: int = 1 << 22,
        shared_storage: bool = False,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1]; got {cache_threshold}")
        if balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0; got {balance_abs_threshold}")
        if balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1; got {balance_rel_threshold}")
        if max_tree_tokens < 1:
            raise ValueError(f"max_tree_tokens must be >= 1; got {max_tree_tokens}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_tokens = max_tree_tokens
        self._trees: dict[str, RadixCache] = {}
        #: What the replicas' shared storage tier holds (None: they share none).
        self._storage: RadixCache | None = RadixCache() if shared_storage else None
        self.last: CacheAwareDecision | None = None

    def tree(self, replica_id: str) -> RadixCache:
        """The approximate record of what `replica_id` has seen (created empty)."""
        tree = self._trees.get(replica_id)
        if tree is None:
            tree = self._trees[replica_id] = RadixCache()
        return tree

    def tree_tokens(self, replica_id: str) -> int:
        return self.tree(replica_id).total_size

    def imbalanced(self, replicas: Sequence[Replica]) -> bool:
        loads = [r.load for r in replicas]
        low, high = min(loads), max(loads)
        return high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold

    def choose(
        self, key: Sequence[int], replicas: Sequence[Replica], namespace: Hashable | None = None
    ) -> Replica:
        matched = 0
        if self.imbalanced(replicas):
            chosen = min(replicas, key=lambda r: (r.load, r.id))
            reason = "balance"
        else:
            best: Replica | None = None
            for replica in sorted(replicas, key=lambda r: (r.load, r.id)):
                length = self._match(replica.id, key, namespace)
                if length > matched:
                    best, matched = replica, length
            stored = 0
            if self._storage is not None and key:
                stored = self._storage.match_prefix(key, namespace).length
            if best is not None and matched >= self.cache_threshold * len(key):
                chosen, reason = best, "prefix"
            elif stored > matched and stored >= self.cache_threshold * len(key):
                chosen = min(replicas, key=lambda r: (r.load, r.id))
                reason, matched = "storage", stored
            else:
                chosen = min(replicas, key=lambda r: (self.tree_tokens(r.id), r.load, r.id))
                reason = "smallest_tree"
        self._record(chosen.id, key, namespace)
        self.last = CacheAwareDecision(chosen.id, reason, matched)
        return chosen

    def forget(self, replica_id: str) -> None:
        self._trees.pop(replica_id, None)

    def _match(self, replica_id: str, key: Sequence[int], namespace: Hashable | None) -> int:
        if not key:
            return 0
        return self.tree(replica_id).match_prefix(key, namespace).length

    def _record(self, replica_id: str, key: Sequence[int], namespace: Hashable | None) -> None:
        """Add the key to the replica's tree; past the bound, drop least recently used keys."""
        if not key:
            return
        trees = [self.tree(replica_id)]
        if self._storage is not None:
            trees.append(self._storage)
        for tree in trees:
            # The tree holds no KV: each token's "slot" is a placeholder the router never reads.
            tree.insert(key, [0] * len(key), namespace)
            excess = tree.total_size - self.max_tree_tokens
            if excess > 0:
                tree.evict(excess)


POLICIES: dict[str, type[Any]] = {
    CacheAware.name: CacheAware,
    RoundRobin.name: RoundRobin,
    PowerOfTwo.name: PowerOfTwo,
    ShortestQueue.name: ShortestQueue,
    RandomChoice.name: RandomChoice,
}


def make_policy(name: str, **options: Any) -> Policy:
    """The policy called `name` (`cache_aware`, `round_robin`, `power_of_two`,
    `shortest_queue`, `random`), built with `options` (a ValueError names the choices or the
    bad option)."""
    policy_class = POLICIES.get(name)
    if policy_class is None:
        raise ValueError(f"router policy must be one of {', '.join(POLICIES)}; got {name!r}")
    try:
        policy: Policy = policy_class(**options)
    except TypeError as error:
        raise ValueError(f"router policy {name}: {error}") from None
    return policy
