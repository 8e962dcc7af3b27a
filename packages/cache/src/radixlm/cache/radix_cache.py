"""RadixAttention's radix tree: token-id keys, KV slot values, LRU/LFU eviction and locks."""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from radixlm.cache._node import (
    RadixNode,
    child_key,
    common_prefix_length,
    edge_child_key,
    pack_tokens,
)
from radixlm.cache._report import check_tree, format_tree

EvictionPolicy = Literal["lru", "lfu"]
_POLICIES = ("lru", "lfu")
# match_prefix packs the query lazily, at least this many tokens at a time (doubling after):
# a typical prompt is packed in one call, a long one only as far as the tree can match it.
_PACK_CHUNK = 4096


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached prefix of a key.

    - `indices`: the KV slot ids of the matched tokens, a new plain `list[int]` the caller
      may keep or convert (e.g. `torch.tensor(result.indices)`); the slots still belong to
      the cache and stay valid while `node` is locked.
    - `node`: an opaque handle to the end of the match, for `lock` / `unlock`.
    - `length`: the number of matched tokens (== `len(indices)`).
    """

    indices: list[int]
    node: RadixNode
    length: int


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters since construction or the last `reset()`.

    `query_tokens` counts the tokens offered to `match_prefix` / `match_prompt`,
    `matched_tokens` those found in the cache, `inserted_tokens` those newly stored by `insert`
    and `evicted_tokens` those removed by `evict`.
    """

    queries: int
    query_tokens: int
    matched_tokens: int
    inserted_tokens: int
    evicted_tokens: int

    @property
    def hit_rate(self) -> float:
        """matched_tokens / query_tokens (0.0 before the first query)."""
        return self.matched_tokens / self.query_tokens if self.query_tokens else 0.0


class RadixCache:
    """A radix tree from token-id sequences to KV-cache slot ids (RadixAttention).

    Every edge holds a run of token ids (`key`) and one slot id per token (`value`); a path
    from the root spells a cached prefix. The cache never allocates or frees slots: `insert`
    takes ownership of the caller's slots for the new part of a key, and `evict` hands slot
    ids back to whoever owns the pool (e.g. a `TokenSlotAllocator`).

    - `page_size`: keys are stored and matched in whole pages of this many tokens; a child is
      found by its first page. With `page_size=1` any prefix length can match.
    - `eviction_policy`: `"lru"` (least recently used leaf first) or `"lfu"` (fewest uses
      first, ties broken by least recent use).
    - `disable`: a cache that matches nothing and stores nothing (same interface), for
      comparisons with prefix caching turned off.

    Keys are lists of ints in the int64 range, or `array("q")` (used without conversion, the
    fastest); other int sequences are copied into a list. Token ids may be negative, e.g. the
    pseudo-tokens of images (see `pseudo_token_ids`). `extra_key` is a namespace (LoRA
    adapter, cache salt, ...): keys in different namespaces never share a node.

    Not thread-safe: call it from one thread (the scheduler's).
    """

    def __init__(
        self,
        page_size: int = 1,
        eviction_policy: EvictionPolicy = "lru",
        disable: bool = False,
    ) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if eviction_policy not in _POLICIES:
            raise ValueError(f"eviction_policy must be one of {_POLICIES}, got {eviction_policy!r}")
        self._page = page_size
        self._policy: EvictionPolicy = eviction_policy
        self._lfu = eviction_policy == "lfu"
        self._disabled = bool(disable)
        self._clock = 0  # logical time: +1 per match / insert
        self._reset_state()

    def _reset_state(self) -> None:
        self._root = RadixNode(None, b"", [], None, None, self._clock)
        self._evictable = 0
        self._protected = 0
        self._nodes = 0  # non-root nodes
        # Eviction candidates: (priority..., seq, node). Entries go stale when the node's
        # priority changes or it stops being an unlocked leaf; `_valid` filters them on pop.
        self._heap: list[tuple[Any, ...]] = []
        self._heap_limit = 1024
        self._seq = 0
        self._queries = 0
        self._query_tokens = 0
        self._matched_tokens = 0
        self._inserted_tokens = 0
        self._evicted_tokens = 0

    # ----------------------------------------------------------------------------- properties

    @property
    def page_size(self) -> int:
        return self._page

    @property
    def eviction_policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def disabled(self) -> bool:
        return self._disabled

    @property
    def evictable_size(self) -> int:
        """Cached tokens on no locked path: what `evict` can free."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Cached tokens on locked paths: `evict` never frees them."""
        return self._protected

    @property
    def total_size(self) -> int:
        """All cached tokens (evictable + protected)."""
        return self._evictable + self._protected

    @property
    def node_count(self) -> int:
        """Number of nodes below the root."""
        return self._nodes

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters (a new frozen object each time)."""
        return CacheStats(
            queries=self._queries,
            query_tokens=self._query_tokens,
            matched_tokens=self._matched_tokens,
            inserted_tokens=self._inserted_tokens,
            evicted_tokens=self._evicted_tokens,
        )

    # -------------------------------------------------------------------------------- lookups

    def match_prefix(self, key: Sequence[int], extra_key: Hashable | None = None) -> MatchResult:
        """Find the longest cached prefix of `key` in namespace `extra_key`.

        The match is page-aligned. If it ends inside an edge, that edge is split so that the
        returned node ends exactly at the match. Mutates: the split, the access time (and use
        count) of every node on the path, the stats; frees nothing.

        Validity: the result's `indices` name slots the cache owns. They stay valid while
        `node` is locked, until a `reset`; unlocked, only until the next `evict`. So lock the
        node before anything can evict; the handle itself survives later splits of its edge.
        A full-prompt hit leaves nothing to compute logits from: for prompts use
        `match_prompt`, which never matches the last token.
        """
        return self._match(key, len(key), extra_key)

    def match_prompt(self, prompt: Sequence[int], extra_key: Hashable | None = None) -> MatchResult:
        """`match_prefix` for a prompt that is about to be prefilled: never a full hit.

        Matches at most `len(prompt) - 1` tokens (then page-aligned), so at least the last
        prompt token is computed and yields the logits of the first output token. Same
        mutations and validity as `match_prefix`.
        """
        return self._match(prompt, len(prompt) - 1, extra_key, len(prompt))

    def _match(
        self, key: Sequence[int], limit: int, extra_key: Hashable | None, offered: int = -1
    ) -> MatchResult:
        self._queries += 1
        self._query_tokens += len(key) if offered < 0 else offered
        root = self._root
        page = self._page
        n = limit - limit % page if limit > 0 else 0
        if self._disabled or n == 0:
            return MatchResult([], root, 0)
        self._clock += 1
        tick = self._clock
        lfu = self._lfu
        indices: list[int] = []
        node = root
        # Positions are byte offsets into `packed`, the key as int64 (8 bytes per token),
        # packed on demand so that a long key is converted only as far as the tree matches.
        if type(key) is array and key.typecode == "q":
            packed = key.tobytes()
        else:
            packed = b""
            if type(key) is not list:
                key = list(key)
        have = len(packed)
        stop = 8 * n
        at = 0
        ckey = child_key(key, 0, page, extra_key)
        while True:
            child = node.children.get(ckey)
            if child is None:
                break
            edge = child.key
            end = at + len(edge)
            if end > have and have < stop:
                # Packing past `stop` is harmless (comparisons stop there) and packing the
                # whole key avoids copying a slice of it first.
                done = have >> 3
                upto = min(len(key), max(end >> 3, 2 * done, _PACK_CHUNK))
                packed += pack_tokens(key, done, upto)
                have = len(packed)
            if end <= stop and packed[at:end] == edge:
                indices += child.value
                child.tick = tick
                if lfu:
                    child.hits += 1
                node = child
                at = end
                if end == stop:
                    break
                ckey = key[end >> 3] if page == 1 else tuple(key[end >> 3 : (end >> 3) + page])
                continue
            # The match ends inside this edge: split it there.
            same = common_prefix_length(packed, at >> 3, edge, (min(end, stop) - at) >> 3)
            child = self._split(child, same - same % page)
            indices += child.value
            child.tick = tick
            if lfu:
                child.hits += 1
            node = child
            at += len(child.key)
            break
        pos = at >> 3
        if node is not root and node.lock_ref == 0 and not node.children:
            self._push(node)
        self._matched_tokens += pos
        return MatchResult(indices, node, pos)

    # -------------------------------------------------------------------------------- updates

    def insert(
        self, key: Sequence[int], indices: Sequence[int], extra_key: Hashable | None = None
    ) -> int:
        """Store `key` with one KV slot id per token; return the already-cached length `n`.

        Only whole pages are stored: `stored = len(key) // page_size * page_size`. The
        tokens `key[:n]` were already cached (the cache keeps its own slots for them), so
        `indices[:n]` stay with the caller; the cache takes ownership of `indices[n:stored]`;
        `indices[stored:]` (a partial last page) stay with the caller. A caller that matched
        `prefix_len` tokens first (whose slots were the cache's own) therefore frees
        `indices[prefix_len:n]` (its duplicates) and `indices[stored:]`, and nothing else.
        A disabled cache stores nothing and returns `stored`, so the same recipe frees all.

        Mutates the tree (may split one edge and add one leaf), access times and stats.
        Never evicts: make room before allocating the slots.
        """
        if type(key) is array and key.typecode == "q":
            packed = key.tobytes()
        else:
            if type(key) is not list:
                key = list(key)
            packed = b""
        if type(indices) is not list:
            indices = list(indices)
        if len(indices) != len(key):
            raise ValueError(
                f"insert needs one slot id per token: got {len(key)} tokens and "
                f"{len(indices)} slot ids"
            )
        page = self._page
        n = len(key) - len(key) % page
        if self._disabled or n == 0:
            return n
        self._clock += 1
        tick = self._clock
        lfu = self._lfu
        root = self._root
        node = root
        pos = 0
        packed = packed[: 8 * n] if packed else pack_tokens(key, 0, n)
        ckey = child_key(key, 0, page, extra_key)
        while True:
            child = node.children.get(ckey)
            if child is None:
                leaf = RadixNode(node, packed[8 * pos :], indices[pos:n], ckey, extra_key, tick)
                node.children[ckey] = leaf
                self._nodes += 1
                self._evictable += n - pos
                self._inserted_tokens += n - pos
                self._push(leaf)
                return pos
            edge = child.key
            size = len(child.value)
            end = pos + size
            if end <= n and packed[8 * pos : 8 * end] == edge:
                child.tick = tick
                if lfu:
                    child.hits += 1
                node = child
                pos = end
                if pos == n:
                    break
                ckey = key[pos] if page == 1 else tuple(key[pos : pos + page])
                continue
            same = common_prefix_length(packed, pos, edge, min(n - pos, size))
            same -= same % page
            if pos + same != n:
                child = self._split(child, same)
            # else the key ends inside this edge: all of it is cached; no need to split.
            child.tick = tick
            if lfu:
                child.hits += 1
            node = child
            pos += same
            if pos == n:
                break
            ckey = key[pos] if page == 1 else tuple(key[pos : pos + page])
        if node is not root and node.lock_ref == 0 and not node.children:
            self._push(node)
        return n

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut `child`'s edge after `at` tokens; return the new upper node.

        The lower part stays the same object, so handles to it (and their locks) stay valid.
        """
        parent = child.parent
        assert parent is not None and 0 < at < len(child.value)
        cut = 8 * at
        upper = RadixNode(parent, child.key[:cut], child.value[:at], child.ckey, child.namespace, 0)
        upper.tick = child.tick
        upper.hits = child.hits
        upper.lock_ref = child.lock_ref
        parent.children[child.ckey] = upper
        child.key = child.key[cut:]
        child.value = child.value[at:]
        child.ckey = edge_child_key(child.key, self._page)
        child.parent = upper
        upper.children[child.ckey] = child
        self._nodes += 1
        return upper

    # ---------------------------------------------------------------------------------- locks

    def lock(self, node: RadixNode) -> None:
        """Protect the path from the root to `node` from eviction (reference counted).

        Mutates lock counts and moves the path's tokens from evictable to protected when they
        become locked. The handle of an empty match (the root) carries no lock: locking or
        unlocking it does nothing, even after a `reset`. Raises ValueError for any other
        handle that was evicted, reset away or belongs to another cache.
        """
        if self._is_root_handle(node):
            return
        self._check_handle(node)
        root = self._root
        while node is not root:
            if node.lock_ref == 0:
                size = len(node.value)
                self._evictable -= size
                self._protected += size
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)` (pair every unlock with a lock of the same handle).

        Tokens whose lock count drops to zero become evictable again. Raises ValueError for a
        stale or foreign handle, or for a node that is not locked.
        """
        if self._is_root_handle(node):
            return
        self._check_handle(node)
        root = self._root
        if node.lock_ref <= 0:
            raise ValueError("unlock() of a node that is not locked: pair it with lock()")
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                size = len(node.value)
                self._protected -= size
                self._evictable += size
                if not node.children:
                    self._push(node)
            node = node.parent  # type: ignore[assignment]

    @staticmethod
    def _is_root_handle(node: RadixNode) -> bool:
        # The handle of an empty match, possibly from before a reset: it carries no lock.
        return node.parent is None and not node.key

    def _check_handle(self, node: RadixNode) -> None:
        root = self._root
        walk: RadixNode | None = node
        while walk is not None and walk is not root:
            walk = walk.parent
        if walk is None:
            raise ValueError(
                f"{node!r} is not in this cache (evicted, reset, or from another cache): "
                "lock a node right after match_prefix, before anything can evict it"
            )

    # ------------------------------------------------------------------------------- eviction

    def evict(self, num_tokens: int) -> list[int]:
        """Remove unlocked leaves until at least `num_tokens` tokens are freed; return slot ids.

        Leaves go in policy order (LRU: least recently used first; LFU: fewest uses, then
        least recent); a parent that becomes an unlocked leaf joins the candidates, so
        eviction cascades up a branch. Whole leaves are removed, so the result may hold more
        than `num_tokens` ids, or fewer if nothing else is evictable. Locked paths are never
        touched. The cache frees nothing itself: the caller gives the returned ids back to
        their pool. Mutates the tree and stats; handles to removed nodes become stale.
        """
        if num_tokens <= 0 or self._disabled:
            return []
        freed: list[int] = []
        heap = self._heap
        root = self._root
        pop = heapq.heappop
        valid = self._valid
        while len(freed) < num_tokens and heap:
            entry = pop(heap)
            node = entry[-1]
            if not valid(entry, node):
                continue
            parent = node.parent
            del parent.children[node.ckey]
            node.parent = None
            # A node owns its value list outright: hand the first one over instead of copying
            # it (evicting one big leaf is the common case), and drop the node's reference.
            value, node.value = node.value, []
            if freed:
                freed += value
            else:
                freed = value
            self._evictable -= len(value)
            self._nodes -= 1
            if parent is not root and parent.lock_ref == 0 and not parent.children:
                self._push(parent)
        self._evicted_tokens += len(freed)
        return freed

    def _valid(self, entry: tuple[Any, ...], node: RadixNode) -> bool:
        if node.parent is None or node.lock_ref or node.children:
            return False
        if self._lfu:
            return bool(entry[0] == node.hits and entry[1] == node.tick)
        return bool(entry[0] == node.tick)

    def _push(self, node: RadixNode) -> None:
        self._seq += 1
        if self._lfu:
            heapq.heappush(self._heap, (node.hits, node.tick, self._seq, node))
        else:
            heapq.heappush(self._heap, (node.tick, self._seq, node))
        if len(self._heap) > self._heap_limit:
            self._compact_heap()

    def _compact_heap(self) -> None:
        """Drop stale and duplicate entries; amortized O(1) per push."""
        seen: set[int] = set()
        kept = []
        for entry in self._heap:
            node = entry[-1]
            if id(node) not in seen and self._valid(entry, node):
                seen.add(id(node))
                kept.append(entry)
        heapq.heapify(kept)
        self._heap[:] = kept  # in place: callers may hold a reference to the list
        self._heap_limit = max(1024, 2 * len(kept))

    # --------------------------------------------------------------------------------- whole

    def reset(self) -> list[int]:
        """Empty the tree and zero the stats; return every slot id the tree held.

        All handles become stale, locked or not (flush only when no request holds a lock).
        The owner of the pool frees the returned ids or resets the pool.
        """
        freed: list[int] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            freed += node.value
            node.parent = None
            stack.extend(node.children.values())
        self._reset_state()
        return freed

    def check_invariants(self) -> None:
        """Raise AssertionError if the tree is inconsistent. O(cached tokens); for tests.

        Checks: sizes add up (evictable, protected, total, node count), every non-root node
        is non-empty with one slot per token in whole pages, children are keyed by their own
        first token/page (and namespace at the root), lock counts are >= 0 and a parent's
        count covers its children's (so protected nodes form paths from the root), no slot id
        appears twice, and every evictable leaf is an eviction candidate.
        """
        check_tree(self)

    def format_tree(self, max_tokens: int = 8) -> str:
        """The tree as indented text, one node per line (at most `max_tokens` ids shown)."""
        return format_tree(self, max_tokens)

    def pretty_print(self, max_tokens: int = 8) -> None:
        """Print `format_tree()`."""
        print(self.format_tree(max_tokens))

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self._page}, eviction_policy={self._policy!r}, "
            f"disable={self._disabled}, total_size={self.total_size}, "
            f"protected_size={self._protected})"
        )
