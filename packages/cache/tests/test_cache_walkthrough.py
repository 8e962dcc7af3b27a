"""The SGLang paper's nine-step RadixAttention example (two chat sessions, a batch of few-shot
queries, self-consistency samples) replayed on a RadixCache of 40 slots with LRU eviction.

Each named segment below is a run of distinct token ids, so every edge of the tree reads as
a list of segment names. The sizes are chosen so that memory runs out exactly where the
paper's figure evicts nodes.
"""

from __future__ import annotations

import itertools

from radixlm.cache import RadixCache, RadixNode, TokenSlotAllocator

CAPACITY = 40
SEGMENTS = {
    "SYS": 4,  # "You are a helpful assistant."
    "U1": 1,  # "User: Hello!"
    "A1": 1,  # "Assistant: Hi!"
    "U2": 2,  # "User: Solve this problem ..."
    "A2": 14,  # "Assistant: Sure! ..." (a long answer)
    "Ub": 2,  # second session: "User: What can you do?"
    "Ab": 4,  # "Assistant: I can ..."
    "Ub2": 2,  # "User: Write a story."
    "Ab2": 12,  # "Assistant: Sure! ..."
    "EX": 4,  # few-shot examples
    **{f"Q{i}": 1 for i in range(1, 5)},  # few-shot questions
    **{f"R{i}": 1 for i in range(1, 5)},  # their answers
    "U3": 1,  # first session, third turn
    "A3": 1,
    **{f"S{i}": 3 for i in range(1, 4)},  # self-consistency samples for question 4
}
_ids = itertools.count(1000)
TOKENS = {name: [next(_ids) for _ in range(size)] for name, size in SEGMENTS.items()}
NAME_OF = {token: name for name, tokens in TOKENS.items() for token in tokens}

Tree = dict[str, "Tree"]


def seq(*names: str) -> list[int]:
    return [token for name in names for token in TOKENS[name]]


def label(tokens: list[int]) -> str:
    names = [NAME_OF[t] for t in tokens]
    return " ".join(name for i, name in enumerate(names) if i == 0 or names[i - 1] != name)


class Server:
    """The runtime's use of the cache, reduced to what the figure shows."""

    def __init__(self) -> None:
        self.cache = RadixCache(page_size=1, eviction_policy="lru")
        self.pool = TokenSlotAllocator(CAPACITY)
        self.slot_token: dict[int, int] = {}
        self.evicted: set[str] = set()
        self.matched: list[int] = []

    def serve(self, prompt: list[int], output: list[int]) -> None:
        result = self.cache.match_prefix(prompt)
        self.matched.append(result.length)
        self.cache.lock(result.node)
        need = len(prompt) + len(output) - result.length
        if self.pool.available < need:
            freed = self.cache.evict(need - self.pool.available)
            self.evicted |= {NAME_OF[self.slot_token.pop(slot)] for slot in freed}
            self.pool.free(freed)
        slots = self.pool.alloc(need)
        assert slots is not None, "the figure never runs out of evictable memory"
        full = prompt + output
        indices = result.indices + slots
        self.slot_token.update(zip(slots, full[result.length :], strict=True))
        cached = self.cache.insert(full, indices).prefix_len
        self.pool.free(indices[result.length : cached])
        self.cache.unlock(result.node)
        self.cache.check_invariants()
        assert self.pool.available + self.cache.total_size == CAPACITY

    def tree(self) -> Tree:
        def walk(node: RadixNode) -> Tree:
            return {label(child.tokens()): walk(child) for child in node.children.values()}

        return walk(self.cache._root)

    def step_report(self) -> tuple[Tree, set[str]]:
        evicted, self.evicted = self.evicted, set()
        return self.tree(), evicted


def test_the_papers_nine_step_example() -> None:
    server = Server()

    # (1) The radix tree is initially empty.
    assert server.step_report() == ({}, set())

    # (2) A chat turn (system prompt, "Hello!", "Hi!") is stored as a single edge.
    server.serve(seq("SYS", "U1"), seq("A1"))
    assert server.step_report() == ({"SYS U1 A1": {}}, set())

    # (3) The second turn reuses the first turn's cache and appends a new node.
    server.serve(seq("SYS", "U1", "A1", "U2"), seq("A2"))
    assert server.matched[-1] == len(seq("SYS", "U1", "A1"))
    assert server.step_report() == ({"SYS U1 A1": {"U2 A2": {}}}, set())

    # (4) A new session splits the first node so that both share the system prompt.
    server.serve(seq("SYS", "Ub"), seq("Ab"))
    assert server.step_report() == (
        {"SYS": {"U1 A1": {"U2 A2": {}}, "Ub Ab": {}}},
        set(),
    )

    # (5) The second session continues; memory is short, so the LRU leaf (the first
    # session's second turn) is evicted, and the new turn is appended to the second session.
    server.serve(seq("SYS", "Ub", "Ab", "Ub2"), seq("Ab2"))
    chats: Tree = {"U1 A1": {}, "Ub Ab": {"Ub2 Ab2": {}}}
    assert server.step_report() == ({"SYS": chats}, {"U2", "A2"})

    # (6) A few-shot query shares nothing: the root gets a second child.
    server.serve(seq("EX", "Q1"), seq("R1"))
    assert server.step_report() == ({"SYS": chats, "EX Q1 R1": {}}, set())

    # (7) A batch of few-shot queries shares the examples: that node is split.
    for i in (2, 3, 4):
        server.serve(seq("EX", f"Q{i}"), seq(f"R{i}"))
    few_shot: Tree = {"Q1 R1": {}, "Q2 R2": {}, "Q3 R3": {}, "Q4 R4": {}}
    assert server.step_report() == ({"SYS": chats, "EX": few_shot}, set())

    # (8) The first session returns; the second session's nodes are least recently used and
    # are evicted (leaf first, then its parent). The evicted second turn is recomputed.
    server.serve(seq("SYS", "U1", "A1", "U2", "A2", "U3"), seq("A3"))
    assert server.matched[-1] == len(seq("SYS", "U1", "A1"))
    first_chat: Tree = {"SYS": {"U1 A1": {"U2 A2 U3 A3": {}}}}
    assert server.step_report() == (
        {**first_chat, "EX": few_shot},
        {"Ub", "Ab", "Ub2", "Ab2"},
    )

    # (9) Self-consistency: more answers sampled for question 4. To make room, the other
    # few-shot queries are evicted; question 4's node is split to share its question.
    for i in (1, 2, 3):
        server.serve(seq("EX", "Q4"), seq(f"S{i}"))
    samples: Tree = {"R4": {}, "S1": {}, "S2": {}, "S3": {}}
    assert server.step_report() == (
        {**first_chat, "EX": {"Q4": samples}},
        {"Q1", "R1", "Q2", "R2", "Q3", "R3"},
    )
