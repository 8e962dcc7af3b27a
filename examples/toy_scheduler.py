"""A toy continuous-batching scheduler built on radixlm-cache alone (no model, no torch).

Requests share prefixes (three system prompts, chats whose next turn repeats the history); the
scheduler admits them into a small pool of KV slots, reuses cached prefixes, locks them while a
request runs, inserts each finished sequence and evicts old ones when the pool runs short. A
stand-in "model" writes deterministic tokens. It prints the prefix-cache hit rate beside the
hit rate of the same workload with an unbounded pool, and checks that no slot leaked.

    python examples/toy_scheduler.py                  # pool of 320 slots
    python examples/toy_scheduler.py --pool 4096      # room for everything: nothing evicted
    python examples/toy_scheduler.py --json           # the figures as one JSON object
"""

from __future__ import annotations

import argparse
import json
import random
from collections import deque
from dataclasses import dataclass, field

from radixlm.cache import RadixCache, RadixNode, TokenSlotAllocator


@dataclass
class Request:
    """One call: its prompt, then what the scheduler attached to it while it ran."""

    chat: int
    turn: int
    prompt: list[int]
    max_new: int
    output: list[int] = field(default_factory=list)
    cached: int = 0
    slots: list[int] = field(default_factory=list)  # one KV slot per prompt + output token
    node: RadixNode | None = None  # the cache handle locked while the request runs


def toy_next_token(tokens: list[int]) -> int:
    """The stand-in model: the next token depends on the last three (ids 1000..1999; 0 ends)."""
    value = (tokens[-1] * 31 + tokens[-2] * 7 + tokens[-3]) % 1009
    return 0 if value < 60 else 1000 + value % 1000


def make_chats(num_chats: int, seed: int = 0) -> list[list[list[int]]]:
    """Each chat: a system prompt (one of three) and its user turns, as token ids."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 1000) for _ in range(48)] for _ in range(3)]
    return [
        [systems[c % 3], *([rng.randrange(1, 1000) for _ in range(8)] for _ in range(3))]
        for c in range(num_chats)
    ]


def simulate(pool_size: int, num_chats: int = 12, max_running: int = 4) -> dict[str, float]:
    """Serve every turn of every chat; return the figures (and assert nothing leaked)."""
    cache = RadixCache(page_size=1, eviction_policy="lru")
    pool = TokenSlotAllocator(pool_size)
    chats = make_chats(num_chats)
    waiting = deque(Request(c, 1, chat[0] + chat[1], 16) for c, chat in enumerate(chats))
    running: list[Request] = []
    prompt_tokens = cached_tokens = steps = peak_used = requests = 0

    def admit(req: Request) -> bool:
        match = cache.match_prompt(req.prompt)
        cache.lock(match.node)  # before anything can evict the matched slots
        need = len(req.prompt) - match.length + req.max_new  # reserve room for the output
        if pool.available < need:
            pool.free(cache.evict(need - pool.available))  # the cache hands slots back
        slots = pool.alloc(need)
        if slots is None:  # still no room: wait for a running request to finish
            cache.unlock(match.node)
            return False
        req.cached, req.node, req.slots = match.length, match.node, match.indices + slots
        return True

    def finish(req: Request) -> None:
        sequence = req.prompt + req.output
        used, unused = req.slots[: len(sequence)], req.slots[len(sequence) :]
        already = cache.insert(sequence, used).prefix_len  # the cache keeps used[already:]
        pool.free(used[req.cached : already] + unused)  # our duplicates and the spare slots
        assert req.node is not None
        cache.unlock(req.node)
        chat = chats[req.chat]
        if req.turn + 1 < len(chat):  # the next turn repeats the whole history
            waiting.appendleft(Request(req.chat, req.turn + 1, sequence + chat[req.turn + 1], 16))

    while waiting or running:
        while waiting and len(running) < max_running and admit(waiting[0]):
            req = waiting.popleft()
            running.append(req)
            requests += 1
            prompt_tokens += len(req.prompt)
            cached_tokens += req.cached
        if not running:
            raise RuntimeError(f"a request needs more than the {pool_size}-slot pool")
        steps += 1
        peak_used = max(peak_used, pool.in_use)
        for req in list(running):  # one decode step for the whole batch
            token = toy_next_token(req.prompt + req.output)
            if token:
                req.output.append(token)
            if not token or len(req.output) == req.max_new:
                running.remove(req)
                finish(req)

    cache.check_invariants()
    assert cache.protected_size == 0, "a lock was not released"
    assert pool.available + cache.total_size == pool.size, "a KV slot leaked"
    return {
        "pool": pool_size,
        "requests": requests,
        "steps": steps,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "hit_rate": cached_tokens / prompt_tokens,
        "evicted_tokens": cache.stats.evicted_tokens,
        "peak_used": peak_used,
        "free": pool.available,
        "cached_at_end": cache.total_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=int, default=320, help="KV slots in the pool")
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    small = simulate(args.pool, args.chats)
    unbounded = simulate(1 << 20, args.chats)
    if args.json:
        print(json.dumps({"small": small, "unbounded": unbounded}))
        return
    print(
        f"{small['requests']} requests, {small['prompt_tokens']} prompt tokens, "
        f"{small['steps']} steps"
    )
    for name, run in (("pool", small), ("unbounded", unbounded)):
        print(
            f"{name:>9} {run['pool']:>8} slots: hit rate {run['hit_rate']:.1%} "
            f"({run['cached_tokens']} cached), {run['evicted_tokens']} tokens evicted, "
            f"peak {run['peak_used']} slots in use"
        )
    print(f"no leak: {small['free']} free + {small['cached_at_end']} cached = {args.pool} slots")


if __name__ == "__main__":
    main()
