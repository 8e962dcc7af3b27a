"""Whole-tree walks of a RadixCache: the invariant check and the text rendering."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixlm.cache._node import RadixNode, child_key

if TYPE_CHECKING:
    from radixlm.cache.radix_cache import RadixCache


def _fail(message: str) -> None:
    raise AssertionError(f"RadixCache invariant broken: {message}")


def _walk(root: RadixNode) -> list[RadixNode]:
    """Every node below `root`, parents before children."""
    out: list[RadixNode] = []
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def check_tree(cache: RadixCache) -> None:
    root = cache._root
    page = cache._page
    if root.key or root.value or root.parent is not None or root.lock_ref or root.end:
        _fail("the root must be empty, parentless and unlocked")
    nodes = _walk(root)
    evictable = protected = 0
    slots: set[int] = set()
    slot_count = 0
    candidates = {id(entry[-1]) for entry in cache._heap if cache._valid(entry, entry[-1])}
    for node in [root, *nodes]:
        below = 0
        for ckey, child in node.children.items():
            if child.parent is not node:
                _fail(f"{child!r} is under a parent it does not point to")
            namespace = child.namespace if node is root else None
            if not child.value or ckey != child_key(child.tokens(page), 0, page, namespace):
                _fail(f"{child!r} is keyed by {ckey!r}, not by its first token/page")
            if child.ckey is not ckey and child.ckey != ckey:
                _fail(f"{child!r} remembers the wrong child key")
            below += child.lock_ref
        if node is root:
            continue
        size = len(node.value)
        if size == 0 or size % page or len(node.key) != 8 * size:
            _fail(f"{node!r} holds {len(node.key)} key bytes and {size} slots (page {page})")
        start = node.parent.end if node.parent is not None else 0
        if node.end != start + size:
            _fail(f"{node!r} ends at token {node.end}, not {start + size}")
        if node.lock_ref < 0:
            _fail(f"{node!r} has a negative lock count")
        if node.lock_ref < below:
            _fail(f"{node!r} has fewer locks than its children together")
        if node.lock_ref:
            protected += size
        else:
            evictable += size
            if not node.children and id(node) not in candidates:
                _fail(f"evictable leaf {node!r} is not an eviction candidate")
        slots.update(node.value)
        slot_count += size
    if len(slots) != slot_count:
        _fail("a slot id is held by more than one token")
    if evictable != cache._evictable or protected != cache._protected:
        _fail(
            f"sizes drifted: evictable {cache._evictable} (tree says {evictable}), "
            f"protected {cache._protected} (tree says {protected})"
        )
    if len(nodes) != cache._nodes:
        _fail(f"node count drifted: {cache._nodes} (tree says {len(nodes)})")


def format_tree(cache: RadixCache, max_tokens: int) -> str:
    root = cache._root
    lines = [
        f"RadixCache page_size={cache._page} policy={cache._policy}"
        f"{' (disabled)' if cache._disabled else ''}: {cache.total_size} tokens in "
        f"{cache._nodes} nodes, evictable {cache._evictable}, protected {cache._protected}",
        "root",
    ]

    def describe(node: RadixNode) -> str:
        size = len(node.value)
        shown = " ".join(map(str, node.tokens(max_tokens)))
        more = f" …+{size - max_tokens}" if size > max_tokens else ""
        namespace = (
            f" ns={node.namespace!r}" if node.parent is root and node.namespace is not None else ""
        )
        lock = f" lock={node.lock_ref}" if node.lock_ref else ""
        return f"[{shown}{more}] ({size}){namespace}{lock} t={node.tick} hits={node.hits}"

    stack: list[tuple[RadixNode, str, bool]] = [
        (child, "", i == len(root.children) - 1) for i, child in enumerate(root.children.values())
    ][::-1]
    while stack:
        node, indent, last = stack.pop()
        lines.append(f"{indent}{'└── ' if last else '├── '}{describe(node)}")
        kids = list(node.children.values())
        deeper = indent + ("    " if last else "│   ")
        stack.extend((kid, deeper, i == len(kids) - 1) for i, kid in list(enumerate(kids))[::-1])
    return "\n".join(lines)
