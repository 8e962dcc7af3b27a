"""Orders of the waiting queue: lpm, dfs-weight, fcfs, random (torch-free)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Literal

from radixlm.runtime.scheduler.request import Req

PolicyName = Literal["lpm", "dfs-weight", "fcfs", "random"]
POLICIES: tuple[str, ...] = ("lpm", "dfs-weight", "fcfs", "random")

#: prefix length of a request in the cache (read-only for the cache's contents).
PrefixLength = Callable[[Req], int]


def fcfs(queue: Sequence[Req]) -> list[Req]:
    """Arrival order (retracted requests keep theirs, so they go first)."""
    return sorted(queue, key=lambda r: r.arrival)


def longest_prefix_match(queue: Sequence[Req], prefix_length: PrefixLength) -> list[Req]:
    """Longest cached prefix first (ties in arrival order): requests that reuse most go
    while their prefix is still in the cache."""
    lengths = {id(r): prefix_length(r) for r in queue}
    return sorted(queue, key=lambda r: (-lengths[id(r)], r.arrival))


def _packed(req: Req) -> bytes:
    return req.key().tobytes()


def common_prefix_bytes(a: bytes, b: bytes) -> int:
    """Length of the common prefix of two byte strings (binary search over C comparisons)."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while low < high:  # a[:low] == b[:low] and a[:high] != b[:high]
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Common prefix, in int64 tokens, of two packed token sequences."""
    return common_prefix_bytes(a, b) // 8


def dfs_weight(queue: Sequence[Req]) -> list[Req]:
    """Depth-first over the prefix tree of the queued sequences, heavier subtrees first.

    The weight of a subtree is the number of requests in it; requests sharing a prefix come
    out together, so the prefix is computed once and reused while it is hot in the cache.
    """
    items = [(_packed(r), r) for r in sorted(queue, key=lambda r: r.arrival)]
    out: list[Req] = []
    _dfs(items, 0, out)
    return out


def _dfs(items: list[tuple[bytes, Req]], depth: int, out: list[Req]) -> None:
    while True:
        if len(items) == 1:
            out.append(items[0][1])
            return
        keys = [key for key, _ in items]
        common = common_prefix_bytes(min(keys), max(keys))
        depth = max(depth, common - common % 8)
        ended = [req for key, req in items if len(key) <= depth]
        groups: dict[bytes, list[tuple[bytes, Req]]] = {}
        for key, req in items:
            if len(key) > depth:
                groups.setdefault(key[depth : depth + 8], []).append((key, req))
        out.extend(ended)
        if len(groups) == 1 and not ended:
            items = next(iter(groups.values()))
            depth += 8
            continue
        # Heavier subtrees first; a stable sort keeps arrival order among equals.
        for group in sorted(groups.values(), key=len, reverse=True):
            _dfs(group, depth + 8, out)
        return


class Policy:
    """Orders the waiting queue by one policy.

    The prefix-aware policies (`lpm`, `dfs-weight`) cost time per queued request, so with more
    than `fallback_queue_len` requests waiting they fall back to `fcfs`.
    """

    def __init__(self, name: str, fallback_queue_len: int = 128, seed: int = 0) -> None:
        if name not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(POLICIES)}; got {name!r}")
        self.name = name
        self.fallback_queue_len = fallback_queue_len
        self._rng = random.Random(seed)

    def order(self, queue: Sequence[Req], prefix_length: PrefixLength) -> list[Req]:
        """A new list: the queue in the order admission should try it. Mutates nothing but
        the cache's access times (through `prefix_length`)."""
        if len(queue) <= 1:
            return list(queue)
        name = self.name
        if name in ("lpm", "dfs-weight") and len(queue) > self.fallback_queue_len:
            name = "fcfs"
        if name == "lpm":
            return longest_prefix_match(queue, prefix_length)
        if name == "dfs-weight":
            return dfs_weight(queue)
        if name == "random":
            shuffled = list(queue)
            self._rng.shuffle(shuffled)
            return shuffled
        return fcfs(queue)
