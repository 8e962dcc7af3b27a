"""RadixAttention's radix tree: token-id keys, KV slot values, LRU/LFU eviction and locks."""

from __future__ import annotations

import heapq
import struct
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, NamedTuple

from radixlm.cache._node import (
    TOKEN_FORMAT,
    RadixNode,
    Tokens,
    as_tokens,
    child_key,
    common_prefix_length,
    edge_child_key,
    pack_prefix,
)
from radixlm.cache._report import check_tree, format_tree

EvictionPolicy = Literal["lru", "lfu"]
_POLICIES = ("lru", "lfu")


class MatchResult(NamedTuple):
    """The longest cached prefix of a key (frozen: a named tuple, cheap to make per lookup).

    - `indices`: the KV slot ids of the matched tokens, a new plain `list[int]` the caller
      may keep or convert (e.g. `torch.tensor(result.indices)`); the slots still belong to
      the cache and stay valid while `node` is locked.
    - `node`: an opaque handle to the end of the match, for `lock` / `unlock`.
    - `length`: the number of matched tokens (== `len(indices)`).
    """

    indices: list[int]
    node: RadixNode
    length: int


# Makes a MatchResult without the generated __new__'s extra call (a lookup's last step).
_new_match: Callable[[tuple[list[int], RadixNode, int]], MatchResult] = partial(
    tuple.__new__, MatchResult
)


class InsertResult(NamedTuple):
    """What `insert` left in the cache for a key (frozen, like `MatchResult`).

    - `prefix_len`: how many leading tokens of the key were cached before the call (their
      slots stay the cache's; the caller's slots for them are duplicates to free).
    - `node`: an opaque handle to the node that ends the stored (page-aligned) key, for
      `lock` / `unlock`: the node `match_prefix` of the stored key would return.
    - `indices`: the cache's slot ids for the whole stored key, in order, a new plain
      `list[int]`; they stay valid while `node` is locked (see `RadixCache.insert`).
    """

    prefix_len: int
    node: RadixNode
    indices: list[int]


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
        self._root = RadixNode(None, b"", [], None, None, self._clock, 0)
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
        return self._match(key, len(key), extra_key, len(key))

    def match_prompt(self, prompt: Sequence[int], extra_key: Hashable | None = None) -> MatchResult:
        """`match_prefix` for a prompt that is about to be prefilled: never a full hit.

        Matches at most `len(prompt) - 1` tokens (then page-aligned), so at least the last
        prompt token is computed and yields the logits of the first output token. Same
        mutations and validity as `match_prefix`.
        """
        return self._match(prompt, len(prompt) - 1, extra_key, len(prompt))

    def continuation(
        self, key: Sequence[int], max_tokens: int, extra_key: Hashable | None = None
    ) -> list[int]:
        """Up to `max_tokens` token ids the tree holds right after the whole of `key` in
        namespace `extra_key`: how an earlier sequence with this prefix went on (at a branch,
        the most recently used child). Empty when the tree does not hold all of `key`.

        Read-only: no edge is split and no access time, use count or statistic changes (a
        speculative decoder's draft source, asked every step, must not keep entries alive).
        """
        if self._disabled or max_tokens <= 0 or not key:
            return []
        if type(key) is not list:
            key = as_tokens(key)
        size = len(key)
        packed = pack_prefix(key, size)
        page = self._page
        node = self._root
        end = 0
        while True:
            if end + page <= size:
                child = node.children.get(
                    child_key(key, end, page, extra_key if node is self._root else None)
                )
            else:  # a partial page is left: any child whose first page starts with it
                child = self._child_starting(node, packed, end, size, extra_key)
            if child is None:
                return []
            length = min(child.end, size) - end
            if not packed.startswith(child.key[: 8 * length], 8 * end):
                return []
            if child.end >= size:
                break
            node, end = child, child.end
        # The key ends inside (or at the end of) `child`'s edge: the rest of it comes first.
        found = child.tokens()[size - (child.end - (len(child.key) >> 3)) :]
        node = child
        while len(found) < max_tokens and node.children:
            node = max(node.children.values(), key=_last_use)
            found += node.tokens(max_tokens - len(found))
        return found[:max_tokens]

    @staticmethod
    def _child_starting(
        node: RadixNode, packed: bytes, start: int, size: int, extra_key: Hashable | None
    ) -> RadixNode | None:
        """A child of `node` whose edge begins with tokens `start:size` of the packed key (fewer
        than a page), the most recently used of them."""
        head = packed[8 * start : 8 * size]
        best: RadixNode | None = None
        for child in node.children.values():
            if child.namespace != extra_key or not child.key.startswith(head):
                continue
            if best is None or child.tick > best.tick:
                best = child
        return best

    def _match(
        self, key: Sequence[int], limit: int, extra_key: Hashable | None, offered: int
    ) -> MatchResult:
        self._queries += 1
        self._query_tokens += offered
        page = self._page
        if self._disabled or limit < page:
            return MatchResult([], self._root, 0)
        self._clock += 1
        if type(key) is not list:
            key = as_tokens(key)
        path, length, _ = self._descend(key, limit - limit % page, extra_key, b"")
        if not path:
            return MatchResult([], self._root, 0)
        tick = self._clock
        indices: list[int] = []
        for node in path:
            indices += node.value
            node.tick = tick
        if self._lfu:
            for node in path:
                node.hits += 1
        if node.lock_ref == 0 and not node.children:
            self._push(node)
        self._matched_tokens += length
        return _new_match((indices, node, length))

    def _descend(
        self, key: Tokens, n: int, extra_key: Hashable | None, packed: bytes
    ) -> tuple[list[RadixNode], int, bytes]:
        """The nodes from the root that spell the longest cached prefix of `key[:n]`, its
        length, and `key` packed at least that far (`packed` if it is long enough).

        `n` is page-aligned. If the prefix ends inside an edge, that edge is split there, so
        the last node ends at the prefix; nothing else changes (the caller touches the path).
        """
        page = self._page
        # Walk by first tokens (first pages) alone, then check the edges on the way with one
        # comparison: one memcmp per lookup instead of a slice and a compare per edge. One
        # loop per child-key kind, so that the loop itself tests nothing but the walk.
        path: list[RadixNode] = []
        end = 0
        if page == 1:
            first = key[0] if extra_key is None else child_key(key, 0, 1, extra_key)
            child = self._root.children.get(first)
            while child is not None:
                path.append(child)
                end = child.end
                if end >= n:
                    break
                child = child.children.get(key[end])
        else:
            child = self._root.children.get(child_key(key, 0, page, extra_key))
            while child is not None:
                path.append(child)
                end = child.end
                if end >= n:
                    break
                child = child.children.get(tuple(key[end : end + page]))
        if not path:
            return path, 0, packed
        if end <= n:
            if len(packed) < 8 * end:
                packed = pack_prefix(key, end)  # only as far as the tree can match
            if packed.startswith(b"".join([node.key for node in path])):
                return path, end, packed
            i = 0  # an edge differs: the prefix ends inside the first one that does
        else:
            # The last edge reaches past `n`: check the others whole, then how far it matches.
            if len(packed) < 8 * n:
                packed = pack_prefix(key, n)
            i = len(path) - 1
            if i and not packed.startswith(b"".join([node.key for node in path[:i]])):
                i = 0
        if i < len(path) - 1:
            # Each edge's key starts at byte 8 * end - len(key) of the packed key.
            while packed.startswith(path[i].key, 8 * path[i].end - len(path[i].key)):
                i += 1
        last = path[i]
        del path[i + 1 :]
        start = last.end - len(last.value)
        same = common_prefix_length(packed, start, last.key, min(last.end, n) - start)
        # The edge was found by its first page, so at least one page is shared; it differs
        # (or reaches past `n`) before its end, so the split is strictly inside it.
        path[-1] = self._split(last, same - same % page)
        return path, start + same - same % page, packed

    # -------------------------------------------------------------------------------- updates

    def insert(
        self, key: Sequence[int], indices: Sequence[int], extra_key: Hashable | None = None
    ) -> InsertResult:
        """Store `key` with one KV slot id per token in namespace `extra_key`.

        Only whole pages are stored: `stored = len(key) // page_size * page_size`. Returns
        `InsertResult(prefix_len, node, indices)`. The tokens `key[:prefix_len]` were already
        cached (the cache keeps its own slots for them), so the caller's `indices[:prefix_len]`
        stay with the caller; the cache takes ownership of `indices[prefix_len:stored]`; the
        caller's `indices[stored:]` (a partial last page) stay with the caller. A caller that
        matched `m` tokens first (whose slots were the cache's own) therefore frees
        `indices[m:prefix_len]` (its duplicates) and `indices[stored:]`, and nothing else.

        The result's `node` ends exactly at `stored` and its `indices` are the cache's slot
        ids for `key[:stored]`: what `match_prefix(key[:stored], extra_key)` would return
        right after, so a caller that keeps using the slots locks `node` without a second
        lookup. A disabled cache stores nothing and returns `InsertResult(stored, <root
        handle>, [])`, so the same recipe frees every slot; so does a key shorter than a page.

        Mutates the tree (may split one edge, so that `node` ends at `stored`, and add one
        leaf), the access time (and use count) of every node on the path, the stats. Never
        evicts: make room before allocating the slots. Validity: as for `match_prefix`, the
        result's `indices` stay valid while `node` is locked; unlocked, only until the next
        `evict`; `reset` invalidates all.
        """
        tokens = as_tokens(key)
        if type(indices) is not list:
            indices = list(indices)
        if len(indices) != len(tokens):
            raise ValueError(
                f"insert needs one slot id per token: got {len(tokens)} tokens and "
                f"{len(indices)} slot ids"
            )
        page = self._page
        n = len(tokens) - len(tokens) % page
        root = self._root
        if self._disabled or n == 0:
            return InsertResult(n, root, [])
        self._clock += 1
        tick = self._clock
        # The new leaf stores its part of the packed key, so pack all of it now.
        path, length, packed = self._descend(tokens, n, extra_key, pack_prefix(tokens, n))
        cached: list[int] = []
        for node in path:
            cached += node.value
            node.tick = tick
        if self._lfu:
            for node in path:
                node.hits += 1
        node = path[-1] if path else root
        if length == n:
            if node.lock_ref == 0 and not node.children:
                self._push(node)
            return InsertResult(n, node, cached)
        if node is root:
            ckey = child_key(tokens, 0, page, extra_key)
        else:
            ckey = tokens[length] if page == 1 else tuple(tokens[length : length + page])
        value = indices[length:n]
        leaf = RadixNode(node, packed[8 * length : 8 * n], value, ckey, extra_key, tick, n)
        node.children[ckey] = leaf
        self._nodes += 1
        self._evictable += n - length
        self._inserted_tokens += n - length
        self._push(leaf)
        cached += value
        return InsertResult(length, leaf, cached)

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut `child`'s edge after `at` tokens; return the new upper node.

        The lower part stays the same object, so handles to it (and their locks) stay valid.
        """
        parent = child.parent
        assert parent is not None and 0 < at < len(child.value)
        cut = 8 * at
        end = child.end - len(child.value) + at
        upper = RadixNode(
            parent, child.key[:cut], child.value[:at], child.ckey, child.namespace, 0, end
        )
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

    def evict(self, num_tokens: int, demote: Callable[[Demoted], None] | None = None) -> list[int]:
        """Remove unlocked leaves until at least `num_tokens` tokens are freed; return slot ids.

        Leaves go in policy order (LRU: least recently used first; LFU: fewest uses, then
        least recent); a parent that becomes an unlocked leaf joins the candidates, so
        eviction cascades up a branch. Whole leaves are removed, so the result may hold more
        than `num_tokens` ids, or fewer if nothing else is evictable. Locked paths are never
        touched. The cache frees nothing itself: the caller gives the returned ids back to
        their pool. Mutates the tree and stats; handles to removed nodes become stale.

        `demote` (a hierarchical cache) is called with each leaf before it goes, while its
        slots and its ancestors' still hold their K/V: the whole sequence up to the leaf's
        end, so that the caller can copy the pages it completes to a lower tier.
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
            if demote is not None:
                demote(_demoted(node))
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


def _last_use(node: RadixNode) -> int:
    return node.tick


class Demoted(NamedTuple):
    """A leaf about to be evicted (see `RadixCache.evict`): `tokens` and `slots` of the whole
    sequence from the root to the leaf's end (the leaf's own part from `start` on), in
    `namespace`. Valid during the call only: the slots are freed after it."""

    tokens: list[int]
    slots: list[int]
    start: int
    namespace: Hashable | None


def _demoted(node: RadixNode) -> Demoted:
    keys: list[bytes] = []
    values: list[list[int]] = []
    at: RadixNode | None = node
    while at is not None and at.parent is not None:
        keys.append(at.key)
        values.append(at.value)
        at = at.parent
    packed = b"".join(reversed(keys))
    tokens = list(struct.unpack(f"{len(packed) >> 3}{TOKEN_FORMAT}", packed))
    slots = [slot for value in reversed(values) for slot in value]
    return Demoted(tokens, slots, node.end - len(node.value), node.namespace)
