"""The tree node (an opaque handle for callers), the child-key scheme and key packing."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Hashable, Sequence
from functools import lru_cache
from struct import Struct
from typing import Any, Union

# Packed keys hold one native int64 per token. struct's "n" (ssize_t) packs about 10% faster
# than "q" and is the same 8 bytes on 64-bit platforms, like array("q").tobytes().
TOKEN_FORMAT = "n" if struct.calcsize("n") == 8 else "q"

# Marks the child key of a namespaced top-level node: (_NAMESPACE, extra_key, first). A page of
# token ids holds only ints, so such a key can never equal a plain first token or first page.
_NAMESPACE = object()


class RadixNode:
    """An opaque handle to a point in a `RadixCache` tree.

    Callers receive one in `MatchResult.node` and pass it back to `RadixCache.lock` /
    `RadixCache.unlock`; they should not read or change its attributes.
    """

    __slots__ = (
        "children",
        "ckey",
        "end",
        "hits",
        "key",
        "lock_ref",
        "namespace",
        "parent",
        "tick",
        "value",
    )

    def __init__(
        self,
        parent: RadixNode | None,
        key: bytes,
        value: list[int],
        ckey: Any,
        namespace: Hashable | None,
        tick: int,
        end: int,
    ) -> None:
        self.parent = parent
        # Token ids on the edge from `parent` to this node, packed as native int64 so that
        # comparing a run of tokens is one memcmp (see `pack_tokens`).
        self.key = key
        self.value = value  # one KV slot id per token of the edge
        # Token offset from the root where the edge ends (the parent's end + the edge's length):
        # a lookup steps from edge to edge by reading it instead of summing lengths. Splits keep
        # it true without touching other nodes: the lower part still ends where it did.
        self.end = end
        self.ckey = ckey  # this node's key in `parent.children`
        self.namespace = namespace
        self.children: dict[Any, RadixNode] = {}
        self.lock_ref = 0  # number of locks held on this node or on any descendant
        self.tick = tick  # logical time of the last match / insert through this node
        self.hits = 1  # number of matches / inserts through this node (for LFU)

    def tokens(self, limit: int | None = None) -> list[int]:
        """The token ids of the edge (the first `limit` of them)."""
        size = len(self.key) >> 3  # not len(value): an evicted node has handed its slots back
        count = size if limit is None else min(limit, size)
        return list(struct.unpack_from(f"{count}{TOKEN_FORMAT}", self.key))

    def __repr__(self) -> str:
        head = ", ".join(map(str, self.tokens(4)))
        size = len(self.key) >> 3
        more = f", … ({size} tokens)" if size > 4 else ""
        return f"<RadixNode [{head}{more}] lock_ref={self.lock_ref}>"


# A key is packed whole, rather than as a prefix (which needs a copy of that part of the list
# first), when it has at most this many tokens or at most twice the prefix needed.
_PACK_WHOLE = 4096

# A key as the tree reads it: a list or tuple of ints, or an array("q") (packed as it is).
Tokens = Union[list[int], tuple[int, ...], "array[int]"]


def as_tokens(key: Sequence[int]) -> Tokens:
    """`key` itself if it is a list, a tuple or an array("q"), else a list of its items."""
    if isinstance(key, (list, tuple)) or (isinstance(key, array) and key.typecode == "q"):
        return key
    return list(key)


def pack_prefix(key: Tokens, count: int) -> bytes:
    """At least the first `count` tokens of `key` packed as native int64 (see `pack_tokens`)."""
    size = len(key)
    if isinstance(key, array):  # already int64: one copy of the part needed
        return key.tobytes() if size <= 2 * count else memoryview(key)[:count].tobytes()
    return pack_tokens(key, 0, size if size <= 2 * count or size <= _PACK_WHOLE else count)


@lru_cache(maxsize=1024)
def _packer(count: int) -> Struct:
    """The compiled format of `count` tokens: formatting and compiling it on every lookup
    costs about 0.3 µs, the cache's lookup a third of that."""
    return Struct(f"{count}{TOKEN_FORMAT}")


def pack_tokens(key: Sequence[int], start: int, stop: int) -> bytes:
    """`key[start:stop]` packed as native int64: 8 bytes per token, converted in C."""
    # Struct(fmt).pack(*key) copies the items once, into the argument tuple; struct.pack(fmt,
    # *key) copies them twice (format and items into a list, then a tuple): about 3 µs more
    # for 2,000 tokens. Reading the int objects is most of what is left (about 6.5 ns each):
    # no other stdlib or numpy conversion of a list of ints is faster.
    try:
        if start == 0 and stop == len(key):
            return _packer(stop).pack(*key)
        return _packer(stop - start).pack(*key[start:stop])
    except struct.error as exc:
        raise ValueError(f"token ids must be ints in the int64 range ({exc})") from None


def child_key(key: Sequence[int], pos: int, page_size: int, namespace: Hashable | None) -> Any:
    """The key under which the edge starting at `key[pos]` hangs from its parent.

    A child is found by its first token (page_size 1) or its first page (a tuple); at the root,
    a namespace other than None is folded in so that namespaces never share a node.
    """
    first: Any = key[pos] if page_size == 1 else tuple(key[pos : pos + page_size])
    if namespace is None:
        return first
    return (_NAMESPACE, namespace, first)


def edge_child_key(key: bytes, page_size: int) -> Any:
    """`child_key` of an edge below the root, computed from its packed tokens."""
    if page_size == 1:
        return struct.unpack_from(TOKEN_FORMAT, key)[0]
    return struct.unpack_from(f"{page_size}{TOKEN_FORMAT}", key)


def common_prefix_length(a: bytes, start: int, b: bytes, limit: int) -> int:
    """Number of leading tokens shared by `a` (from token `start`) and `b`, at most `limit`.

    `a` and `b` are packed keys (8 bytes per token). Binary search on slice equality: every
    comparison is a memcmp and the slices halve each round, so the cost is O(limit) bytes,
    never a Python loop per token.
    """
    base = 8 * start
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if a[base + 8 * lo : base + 8 * mid] == b[8 * lo : 8 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
