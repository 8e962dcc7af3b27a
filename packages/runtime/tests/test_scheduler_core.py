"""The scheduler against a fake model that checks every KV slot it reads (torch-free)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from radixlm.cache import RadixCache, TokenSlotAllocator
from radixlm.runtime.config import SchedulerConfig
from radixlm.runtime.scheduler import Req, ReqStatus, ScheduledBatch, Scheduler, dfs_weight
from radixlm.sampling import EngineOverloaded, FinishReason

VOCAB = 97


class PagedSlots:
    """A SlotPool over a TokenSlotAllocator of pages (like the runner's KVPool)."""

    def __init__(self, size: int, page_size: int = 1) -> None:
        self.page_size = page_size
        self.size = size
        self.allocator = TokenSlotAllocator(size // page_size)

    @property
    def available(self) -> int:
        return self.allocator.available * self.page_size

    def alloc_pages(self, num_pages: int) -> list[int] | None:
        pages = self.allocator.alloc(num_pages)
        if pages is None:
            return None
        return [p * self.page_size + i for p in pages for i in range(self.page_size)]

    def free(self, slots: Sequence[int]) -> None:
        slots = list(slots)
        assert len(slots) % self.page_size == 0, "frees whole pages only"
        pages = [s // self.page_size for s in slots[:: self.page_size]]
        for k, page in enumerate(pages):  # each page's slots in order
            run = slots[k * self.page_size : (k + 1) * self.page_size]
            assert run == [page * self.page_size + i for i in range(self.page_size)], run
        self.allocator.free(pages)


class Rows:
    def __init__(self, n: int) -> None:
        self.free_rows = list(range(n))

    def alloc(self) -> int | None:
        return self.free_rows.pop() if self.free_rows else None

    def free(self, row: int) -> None:
        assert row not in self.free_rows
        self.free_rows.append(row)


def next_token(tokens: Sequence[int]) -> int:
    """The fake model: a deterministic function of the whole sequence."""
    h = 17
    for t in tokens[-8:]:
        h = (h * 31 + t) % 1_000_003
    return (h + len(tokens)) % VOCAB


class FakeModel:
    """Writes K/V (token, position) into slots and reads every earlier one back through the
    request-to-token rows, so any bookkeeping error in the scheduler shows up as a mismatch."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[int, int]] = {}
        self.rows: dict[int, dict[int, int]] = {}
        self.tokens_forwarded = 0
        self.forward_calls = 0

    def forward(self, batch: ScheduledBatch) -> list[int]:
        self.forward_calls += 1
        out = []
        for e in batch.entries:
            row = self.rows.setdefault(e.row, {})
            if e.row_write is not None:
                start, slots = e.row_write
                for i, slot in enumerate(slots):
                    row[start + i] = slot
            for i, (token, slot) in enumerate(zip(e.input_ids, e.out_slots, strict=True)):
                self.kv[slot] = (token, e.prefix_len + i)
                row[e.prefix_len + i] = slot
            self.tokens_forwarded += len(e.input_ids)
            end = e.prefix_len + len(e.input_ids)
            seen = [self.kv[row[p]] for p in range(end)]
            expected = e.req.tokens(0, end)
            assert [t for t, _ in seen] == expected, f"{e.req} read wrong K/V"
            assert [p for _, p in seen] == list(range(end))
            out.append(next_token(expected))
        return out


def make(pool: int = 4096, page: int = 1, rows: int = 64, **config: Any) -> Scheduler:
    config.setdefault("schedule_policy", "fcfs")
    running = config.pop("max_running_requests", 256)
    return Scheduler(
        SchedulerConfig(**config),
        PagedSlots(pool, page),
        Rows(rows),
        RadixCache(page_size=page),
        max_running_requests=running,
    )


def run(sched: Scheduler, model: FakeModel, max_steps: int = 10_000, on_step: Any = None) -> None:
    for step in range(max_steps):
        if not sched.waiting and not sched.running:
            return
        batch = sched.schedule()
        tokens = model.forward(batch) if batch.entries else []
        sched.after_forward(batch)
        for entry, token in zip(batch.entries, tokens, strict=False):
            req = entry.req
            if entry.sample and req.status is ReqStatus.RUNNING:
                if req.max_new_tokens == 0:
                    sched.finish(req)
                    continue
                req.output_ids.append(token)
                if len(req.output_ids) >= req.max_new_tokens:
                    sched.finish(req)
        if on_step is not None:
            on_step(step, sched)
    raise AssertionError("the scheduler did not drain")


def solo(prompt: list[int], max_new: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_new):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


def prompts(count: int, shared: int, own: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared)]
    return [prefix + [rng.randrange(VOCAB) for _ in range(own)] for _ in range(count)]


def assert_clean(sched: Scheduler, pool: int) -> None:
    sched.check_memory(pool)
    assert sched.pool.available + sched.cache.total_size == pool


def test_every_request_finishes_with_its_solo_output() -> None:
    sched, model = make(), FakeModel()
    reqs = [Req(f"r{i}", p, 12) for i, p in enumerate(prompts(20, 30, 10))]
    for r in reqs:
        sched.add(r)
    run(sched, model)
    for r in reqs:
        assert r.finished and r.output_ids == solo(r.prompt_ids, 12)
    assert_clean(sched, 4096)


def test_second_request_reuses_a_500_token_prefix() -> None:
    sched, model = make(), FakeModel()
    first, second = prompts(2, 500, 20)
    a = Req("a", first, 4)
    sched.add(a)
    run(sched, model)
    before = model.tokens_forwarded
    b = Req("b", second, 4)
    sched.add(b)
    run(sched, model)
    assert b.cached_tokens is not None and b.cached_tokens >= 499
    # The prefill computes only the uncached part, then 3 decode steps of one token.
    assert model.tokens_forwarded - before == len(second) - b.cached_tokens + 3


def test_lpm_admits_the_longest_cached_prefix_first() -> None:
    sched, model = make(schedule_policy="lpm", max_running_requests=1), FakeModel()
    warm, hit = prompts(2, 64, 8, seed=1)
    sched.add(Req("warm", warm, 1))
    run(sched, model)
    cold = Req("cold", prompts(1, 0, 72, seed=2)[0], 1)
    hot = Req("hot", hit, 1)
    sched.add(cold)
    sched.add(hot)
    first = sched.schedule()
    assert [e.req.rid for e in first.entries] == ["hot"]


def test_dfs_weight_groups_requests_by_shared_prefix() -> None:
    a = prompts(2, 40, 5, seed=3)
    b = prompts(3, 40, 5, seed=4)
    queue = [Req("a0", a[0], 1), Req("b0", b[0], 1), Req("a1", a[1], 1)]
    queue += [Req("b1", b[1], 1), Req("b2", b[2], 1)]
    order = [r.rid for r in dfs_weight(queue)]
    assert order == ["b0", "b1", "b2", "a0", "a1"]  # the heavier subtree first


def test_prefix_policies_fall_back_to_fcfs_on_a_long_queue() -> None:
    sched = make(schedule_policy="lpm", policy_fallback_queue_len=2)
    reqs = [Req(f"r{i}", p, 1) for i, p in enumerate(prompts(4, 0, 10, seed=5))]
    order = sched.policy.order(list(reversed(reqs)), lambda r: int(r.rid[1:]))
    assert order == reqs  # arrival order, not the (reversed) prefix lengths


def test_chunked_prefill_splits_the_prompt_and_caches_finished_chunks() -> None:
    sched, model = make(chunked_prefill_size=64), FakeModel()
    req = Req("long", prompts(1, 0, 200, seed=6)[0], 2)
    sched.add(req)
    batch = sched.schedule()
    assert batch.num_tokens == 64 and not batch.entries[0].sample
    model.forward(batch)
    sched.after_forward(batch)
    assert sched.cache.total_size == 64  # the finished chunk is in the cache, locked
    assert sched.cache.protected_size == 64
    run(sched, model)
    assert req.output_ids == solo(req.prompt_ids, 2)
    assert_clean(sched, 4096)


def test_mixed_step_carries_decodes_and_a_prefill_chunk() -> None:
    sched, model = make(chunked_prefill_size=32), FakeModel()
    sched.add(Req("short", prompts(1, 0, 8, seed=7)[0], 20))
    batch = sched.schedule()
    model.forward(batch)
    sched.after_forward(batch)
    batch.entries[0].req.output_ids.append(1)
    sched.add(Req("long", prompts(1, 0, 100, seed=8)[0], 2))
    mixed = sched.schedule()
    kinds = [(e.req.rid, e.is_prefill, len(e.input_ids)) for e in mixed.entries]
    assert kinds == [("short", False, 1), ("long", True, 31)]


def test_max_running_requests_caps_the_running_set() -> None:
    sched, model = make(max_running_requests=3), FakeModel()
    for i, p in enumerate(prompts(8, 0, 6, seed=9)):
        sched.add(Req(f"r{i}", p, 5))
    peak = []
    run(sched, model, on_step=lambda _s, s: peak.append(len(s.running)))
    assert max(peak) == 3


def test_full_queue_refuses_with_engine_overloaded() -> None:
    sched = make(max_queued_requests=2, max_running_requests=1)
    for name in "abc":  # a runs at the next step; b and c wait
        sched.add(Req(name, [1, 2], 1))
    with pytest.raises(EngineOverloaded, match="queue is full"):
        sched.add(Req("d", [1, 2], 1))


def test_requests_that_free_running_slots_can_take_are_not_queued() -> None:
    sched, model = make(max_queued_requests=2, max_running_requests=8), FakeModel()
    for i in range(10):  # a burst before any step: 8 will run, 2 wait
        sched.add(Req(f"r{i}", [1, 2, i], 3))
    with pytest.raises(EngineOverloaded):
        sched.add(Req("over", [1, 2], 3))
    seen: list[tuple[int, int]] = []

    def after_step(_step: int, s: Scheduler) -> None:
        seen.append((len(s.running), s.backlog()))

    run(sched, model, on_step=after_step)
    assert seen[0] == (8, 2)  # after the first step: 8 running, 2 waiting
    assert_clean(sched, 4096)


def test_queue_limit_counts_every_waiting_request_while_memory_holds_them_back() -> None:
    sched = make(pool=64, max_queued_requests=1, max_running_requests=8)
    sched.add(Req("big", list(range(40)), 20))
    sched.add(Req("next", list(range(100, 140)), 20))  # no room for it beside big
    sched.schedule()
    assert len(sched.running) == 1 and sched.memory_bound
    assert sched.backlog() == 1
    with pytest.raises(EngineOverloaded):
        sched.add(Req("over", [1, 2], 1))


def test_cache_is_evicted_before_a_request_is_refused() -> None:
    sched, model = make(pool=300), FakeModel()
    for i, p in enumerate(prompts(4, 0, 60, seed=10)):
        sched.add(Req(f"w{i}", p, 2))
    run(sched, model)
    assert sched.cache.total_size >= 240
    big = Req("big", prompts(1, 0, 200, seed=11)[0], 3)
    sched.add(big)
    run(sched, model)
    assert big.output_ids == solo(big.prompt_ids, 3)
    assert sched.cache.stats.evicted_tokens > 0
    assert_clean(sched, 300)


def test_decode_out_of_slots_retracts_the_youngest_and_all_finish() -> None:
    sched, model = make(pool=200, init_new_token_ratio=0.0, min_new_token_ratio=0.0), FakeModel()
    reqs = [Req(f"r{i}", p, 40) for i, p in enumerate(prompts(6, 0, 20, seed=12))]
    for r in reqs:
        sched.add(r)
    run(sched, model)
    assert sched.num_retractions > 0
    assert max(r.retractions for r in reqs) > 0
    assert reqs[0].retractions == 0  # the oldest is never the victim
    for r in reqs:
        assert r.output_ids == solo(r.prompt_ids, 40)
    assert_clean(sched, 200)


def test_abort_frees_everything_at_once() -> None:
    sched, model = make(pool=512), FakeModel()
    reqs = [Req(f"r{i}", p, 30) for i, p in enumerate(prompts(5, 10, 20, seed=13))]
    for r in reqs:
        sched.add(r)

    def abort_some(step: int, s: Scheduler) -> None:
        if step == 3:
            s.abort(reqs[1])
            s.abort(reqs[4])
            s.check_memory(512)

    run(sched, model, on_step=abort_some)
    assert reqs[1].finished and len(reqs[1].output_ids) < 30
    assert_clean(sched, 512)


def test_finished_request_is_inserted_with_its_output() -> None:
    sched, model = make(), FakeModel()
    req = Req("a", prompts(1, 0, 10, seed=14)[0], 5)
    sched.add(req)
    run(sched, model)
    follow_up = req.prompt_ids + req.output_ids[:4] + [3]
    assert sched.cache.match_prompt(follow_up).length == 14  # prompt + computed output


def test_siblings_wait_for_the_first_prefill_and_reuse_it() -> None:
    sched, model = make(), FakeModel()
    prompt = prompts(1, 0, 100, seed=15)[0]
    first = Req("x#0", prompt, 3)
    siblings = [Req(f"x#{i}", list(prompt), 3, wait_for=first) for i in range(1, 4)]
    for r in [first, *siblings]:
        sched.add(r)
    batch = sched.schedule()
    assert [e.req.rid for e in batch.entries] == ["x#0"]
    first.output_ids += model.forward(batch)
    sched.after_forward(batch)
    run(sched, model)
    assert [s.cached_tokens for s in siblings] == [99, 99, 99]


def test_copies_sent_apart_wait_for_the_one_computing_their_uncached_part() -> None:
    """n as separate requests (what HTTP clients send): after a shared, cached 200-token
    prefix each copy's own 20 tokens are fewer than in_batch_prefix_min, and yet only the
    first copy computes them; the others wait one step and take them from the cache."""
    sched, model = make(schedule_policy="lpm"), FakeModel()
    rng = random.Random(17)
    prefix = [rng.randrange(3, VOCAB) for _ in range(200)]
    calls = [prefix + [rng.randrange(3, VOCAB) for _ in range(20)] for _ in range(3)]
    reqs = [Req(f"c{c}#{j}", list(p), 4) for c, p in enumerate(calls) for j in range(3)]
    for r in reqs:
        sched.add(r)
    run(sched, model)
    assert [r.cached_tokens for r in reqs] == [0, 219, 219, 200, 219, 219, 200, 219, 219]
    # every prompt token computed once (+1 for each copy's last), then 3 decodes each
    assert model.tokens_forwarded == 200 + 3 * 20 + 6 + 9 * 3
    for r in reqs:
        assert r.output_ids == solo(r.prompt_ids, 4)
    assert_clean(sched, 4096)


def test_a_request_that_reuses_no_prefix_does_not_wait_for_one() -> None:
    sched, model = make(schedule_policy="lpm"), FakeModel()
    prompt = prompts(1, 0, 100, seed=18)[0]
    first, every_row = Req("a", prompt, 2), Req("b", list(prompt), 2, reuse_prefix=False)
    sched.add(first)
    sched.add(every_row)
    batch = sched.schedule()
    assert [e.req.rid for e in batch.entries] == ["a", "b"]  # nothing to gain by waiting
    model.forward(batch)


def test_a_copy_under_another_adapter_does_not_wait_for_the_first() -> None:
    sched, model = make(schedule_policy="lpm"), FakeModel()
    prompt = prompts(1, 0, 20, seed=19)[0]
    sched.add(Req("a", prompt, 2, extra_key="adapter-a"))
    sched.add(Req("b", list(prompt), 2, extra_key="adapter-b"))  # its K/V is cached apart
    sched.add(Req("a2", list(prompt), 2, extra_key="adapter-a"))
    batch = sched.schedule()
    assert [e.req.rid for e in batch.entries] == ["a", "b"]
    model.forward(batch)


def test_input_logprob_positions_and_prefix_limited_to_them() -> None:
    sched, model = make(), FakeModel()
    prompt = prompts(1, 0, 40, seed=16)[0]
    sched.add(Req("warm", prompt, 1))
    run(sched, model)
    req = Req("score", prompt, 0, input_logprob_start=30)
    sched.add(req)
    batch = sched.schedule()
    (entry,) = batch.entries
    assert entry.prefix_len == 29  # the cached prefix stops where scoring starts
    assert entry.logprob_start == 0 and entry.logprob_targets == prompt[30:40]


def test_paged_pool_keeps_pages_whole_under_pressure() -> None:
    sched, model = make(pool=256, page=4, chunked_prefill_size=24), FakeModel()
    reqs = [Req(f"r{i}", p, 15) for i, p in enumerate(prompts(10, 21, 7, seed=17))]
    for r in reqs:
        sched.add(r)
    run(sched, model)
    for r in reqs:
        assert r.output_ids == solo(r.prompt_ids, 15)
    assert_clean(sched, 256)


def test_rollback_returns_kv_of_taken_back_tokens() -> None:
    sched, model = make(), FakeModel()
    req = Req("a", prompts(1, 0, 10, seed=18)[0], 50)
    sched.add(req)
    for _ in range(5):
        batch = sched.schedule()
        tokens = model.forward(batch)
        sched.after_forward(batch)
        req.output_ids.append(tokens[0])
    assert req.kv_len == 14 and req.seq_len == 15
    assert sched.can_rollback(req, 2)
    del req.output_ids[-2:]
    sched.trim_kv(req)
    req.output_ids += [5, 6, 7]
    batch = sched.schedule()
    (entry,) = batch.entries
    assert entry.prefix_len == 13 and entry.input_ids == [5, 6, 7]
    model.forward(batch)  # reads back every slot: the rolled-back ones were rewritten
    sched.after_forward(batch)
    sched.abort(req)
    assert_clean(sched, 4096)


@pytest.mark.parametrize("page", [1, 4])
def test_rewindable_request_can_take_back_its_whole_output(page: int) -> None:
    sched, model = make(page=page), FakeModel()
    req = Req("a", prompts(1, 0, 10, seed=20)[0], 50)
    req.rewindable = True
    sched.add(req)
    for _ in range(4):
        batch = sched.schedule()
        tokens = model.forward(batch)
        sched.after_forward(batch)
        req.output_ids.append(tokens[0])
    # The last prompt token stays the request's: the cache holds at most 9 of the 10.
    assert req.cache_len <= 9 and req.cache_len % page == 0
    assert sched.can_rewind(req, 4) and not sched.can_rewind(req, 5)
    del req.output_ids[:]
    sched.trim_kv(req, recompute_last=True)
    assert req.kv_len == 9 and req.pending == 1
    batch = sched.schedule()
    (entry,) = batch.entries
    assert entry.prefix_len == 9 and entry.input_ids == req.prompt_ids[-1:] and entry.sample
    model.forward(batch)  # reads back every slot of the prefix
    sched.after_forward(batch)
    sched.check_memory(4096)
    sched.finish(req)
    assert_clean(sched, 4096)


def test_request_that_is_not_rewindable_cannot_rewind_into_the_cache() -> None:
    sched, model = make(), FakeModel()
    req = Req("a", prompts(1, 0, 10, seed=21)[0], 50)
    sched.add(req)
    for _ in range(3):
        batch = sched.schedule()
        tokens = model.forward(batch)
        sched.after_forward(batch)
        req.output_ids.append(tokens[0])
    assert req.cache_len == 10  # the whole prompt is cached after its prefill
    assert sched.can_rewind(req, 2) and not sched.can_rewind(req, 3)
    sched.abort(req)
    assert_clean(sched, 4096)


def test_retracted_request_is_not_readmitted_in_the_same_step() -> None:
    sched, model = make(pool=120, init_new_token_ratio=0.0, min_new_token_ratio=0.0), FakeModel()
    reqs = [Req(f"r{i}", p, 60) for i, p in enumerate(prompts(3, 0, 30, seed=19))]
    for r in reqs:
        sched.add(r)

    seen_retracted: list[Req] = []
    for _ in range(400):
        if not sched.running and not sched.waiting:
            break
        batch = sched.schedule()
        admitted = {e.req.rid for e in batch.entries if e.is_prefill}
        assert not admitted & {r.rid for r in batch.retracted}
        seen_retracted += batch.retracted
        tokens = model.forward(batch) if batch.entries else []
        sched.after_forward(batch)
        for entry, token in zip(batch.entries, tokens, strict=False):
            if entry.sample and entry.req.status is ReqStatus.RUNNING:
                entry.req.output_ids.append(token)
                if len(entry.req.output_ids) >= entry.req.max_new_tokens:
                    sched.finish(entry.req)
    assert seen_retracted
    assert all(r.finished for r in reqs)
    assert_clean(sched, 120)


def test_random_policy_is_reproducible_from_its_seed() -> None:
    reqs = [Req(f"r{i}", [i + 1], 1) for i in range(10)]
    orders = [
        [
            r.rid
            for r in make(schedule_policy="random", random_seed=3).policy.order(reqs, lambda r: 0)
        ]
        for _ in range(2)
    ]
    assert orders[0] == orders[1] and orders[0] != [r.rid for r in reqs]


def test_dfs_weight_engine_run_keeps_outputs_and_memory_right() -> None:
    sched, model = make(schedule_policy="dfs-weight", pool=600), FakeModel()
    groups = prompts(6, 40, 8, seed=20) + prompts(6, 40, 8, seed=21)
    reqs = [Req(f"r{i}", p, 6) for i, p in enumerate(groups)]
    for r in reqs:
        sched.add(r)
    run(sched, model)
    assert all(r.output_ids == solo(r.prompt_ids, 6) for r in reqs)
    assert sum(r.cached_tokens or 0 for r in reqs) >= 10 * 39
    assert_clean(sched, 600)


def test_input_logprobs_resume_after_a_retraction_without_repeats() -> None:
    sched, model = make(chunked_prefill_size=16), FakeModel()
    prompt = prompts(1, 0, 40, seed=22)[0]
    req = Req("score", prompt, 1, input_logprob_start=0)
    sched.add(req)
    scored: list[int] = []
    for step in range(10):
        if req.finished:
            break
        batch = sched.schedule()
        tokens = model.forward(batch)
        sched.after_forward(batch)
        for entry, token in zip(batch.entries, tokens, strict=True):
            scored += entry.logprob_targets or []
            if entry.sample:
                req.output_ids.append(token)
                sched.finish(req)
        if step == 0:
            sched._retract(req)  # as decode pressure would
    assert scored == prompt[1:]
    assert_clean(sched, 4096)


# ------------------------------------------------------------------------ the update phase


class CountStopper:
    """Stops after `limit` tokens, or at `stop_id`; records what it was told."""

    def __init__(self, limit: int, stop_id: int | None = None) -> None:
        self.limit, self.stop_id = limit, stop_id
        self.ids: list[int] = []
        self.finish: FinishReason | None = None

    def append(self, token_id: int) -> FinishReason | None:
        self.ids.append(token_id)
        if token_id == self.stop_id:
            self.finish = FinishReason("stop", matched=token_id)
        elif len(self.ids) >= self.limit:
            self.finish = FinishReason("length")
        return self.finish

    def rollback(self, num_tokens: int) -> None:
        del self.ids[len(self.ids) - num_tokens :]

    def finish_length(self, message: str | None = None) -> FinishReason:
        self.finish = FinishReason("length", message=message)
        return self.finish

    def stop(self, matched: int | str | None = None, message: str | None = None) -> FinishReason:
        self.finish = FinishReason("stop", matched, message)
        return self.finish

    def abort(self, message: str | None = None) -> FinishReason:
        self.finish = FinishReason("abort", message=message)
        return self.finish


class ForcingGrammar:
    """Accepts every token but `refused`; after the first token forces `forced`."""

    def __init__(self, forced: tuple[int, ...], refused: int = -1) -> None:
        self.forced, self.refused, self.accepted = forced, refused, 0

    def accept_token(self, token: int) -> bool:
        self.accepted += 1
        return token != self.refused

    def is_terminated(self) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        self.accepted -= num_tokens

    def jump_forward(self) -> Any:
        forced, self.forced = self.forced, ()
        return SimpleNamespace(text="", token_ids=forced, rollback=0) if forced else None


def _step(sched: Scheduler, model: FakeModel) -> list[Any]:
    batch = sched.schedule()
    tokens = model.forward(batch) if batch.entries else []
    sampled = [t if e.sample else None for e, t in zip(batch.entries, tokens, strict=True)]
    return sched.update(batch, sampled)


def test_update_appends_checks_stops_and_releases_a_finished_request() -> None:
    sched, model = make(pool=256), FakeModel()
    stopper = CountStopper(limit=3)
    req = Req("a", [1, 2, 3, 4], max_new_tokens=3, stopper=stopper)
    sched.add(req)
    finished = None
    for _ in range(10):
        for update in _step(sched, model):
            assert update.req is req and req.output_ids == stopper.ids
            finished = update.finish
        if finished is not None:
            break
    assert finished == FinishReason("length") and len(req.output_ids) == 3
    assert req.status is ReqStatus.FINISHED and not sched.running
    sched.check_memory(256)
    # Every computed token (all but the last one sampled) went to the cache.
    assert sched.cache.match_prefix(req.tokens()).length == req.seq_len - 1
    assert sched.generated_tokens == 3


def test_update_appends_forced_tokens_and_a_refused_token_aborts() -> None:
    sched, model = make(pool=256), FakeModel()
    forced = Req("f", [5, 6, 7], max_new_tokens=10, stopper=CountStopper(limit=10))
    forced.grammar, forced.jump_forward = ForcingGrammar((40, 41, 42)), True
    sched.add(forced)
    _step(sched, model)
    assert forced.output_ids[1:] == [40, 41, 42] and sched.jump_forward_tokens == 3
    first = forced.output_ids[0]
    refused = Req("r", [8, 9], max_new_tokens=10, stopper=CountStopper(limit=10))
    refused.grammar = ForcingGrammar((), refused=next_token([8, 9]))
    sched.add(refused)
    updates = {u.req.rid: u for u in _step(sched, model)}
    assert updates["r"].finish is not None and updates["r"].finish.type == "abort"
    assert refused.output_ids == [] and refused.status is ReqStatus.FINISHED
    assert forced.output_ids[0] == first
    sched.check_memory(256)


def test_each_waiting_request_is_prefix_matched_once_per_step() -> None:
    sched, model = make(pool=4096, schedule_policy="lpm"), FakeModel()
    for k in range(6):
        sched.add(Req(f"r{k}", [1, 2, 3, 10 + k, 20 + k], 2, stopper=CountStopper(limit=2)))
    calls: list[int] = []
    original = sched.cache.match_prompt

    def counting(key: Any, extra_key: Any = None) -> Any:
        calls.append(1)
        return original(key, extra_key)

    sched.cache.match_prompt = counting  # type: ignore[method-assign]
    batch = sched.schedule()
    assert len(batch.entries) == 6
    assert len(calls) == 6  # ordering by prefix and admitting share one match per request
    sched.update(batch, model.forward(batch))
    sched.check_memory(4096)


# ---------------------------------------------------- prompts prefilled by another engine


def test_a_request_prefilled_elsewhere_decodes_as_if_prefilled_here() -> None:
    sched, model = make(page=4), FakeModel()
    prompt = prompts(1, 0, 13, seed=7)[0]
    req = Req("pd", prompt, 6)
    req.stopper = CountStopper(limit=6)
    slots = sched.admit_prefilled(req)
    assert slots is not None and len(slots) == len(prompt)
    assert req.status is ReqStatus.RUNNING and not req.in_prefill and not sched.waiting
    # What the prefill engine sent: the prompt's K/V, written into the slots, and its token.
    for position, (token, slot) in enumerate(zip(prompt, slots, strict=True)):
        model.kv[slot] = (token, position)
    first = next_token(prompt)
    assert sched.append_prefilled(req, first).finish is None
    while req.status is ReqStatus.RUNNING:
        batch = sched.schedule()
        assert all(not e.is_prefill for e in batch.entries)  # its prompt is never computed
        sched.update(batch, model.forward(batch))
    assert req.output_ids == solo(prompt, 6)
    assert model.tokens_forwarded == 5
    # Its prompt and output are cached as a computed request's are; no slot is lost.
    assert_clean(sched, 4096)
    assert sched.cache.match_prefix(prompt).length == 12  # whole pages


def test_a_request_prefilled_elsewhere_waits_for_room_and_may_end_at_once() -> None:
    sched = make(pool=32, rows=1)
    busy = Req("busy", prompts(1, 0, 8, seed=1)[0], 4)
    busy.stopper = CountStopper(limit=4)
    assert sched.admit_prefilled(busy) is not None
    late = Req("late", prompts(1, 0, 8, seed=2)[0], 1)
    late.stopper = CountStopper(limit=1)
    assert sched.admit_prefilled(late) is None  # no row: nothing changed
    assert late.status is ReqStatus.WAITING and late.kv_len == 0
    sched.abort(busy)
    assert sched.admit_prefilled(late) is not None
    assert sched.append_prefilled(late, 3).finish == FinishReason("length")
    assert late.finished
    assert_clean(sched, 32)


def test_a_retracted_request_prefilled_elsewhere_recomputes_from_the_cache_only() -> None:
    sched, model = make(), FakeModel()
    prompt = prompts(1, 0, 10, seed=9)[0]
    req = Req("pd", prompt, 4, input_logprob_start=0, stopper=CountStopper(limit=4))
    slots = sched.admit_prefilled(req)
    assert slots is not None and req.input_logprobs_done  # its prompt logprobs came along
    for position, (token, slot) in enumerate(zip(prompt, slots, strict=True)):
        model.kv[slot] = (token, position)
    sched.append_prefilled(req, next_token(prompt))
    batch = sched.schedule()
    sched.update(batch, model.forward(batch))
    assert sched.retract_all() == 1
    batch = sched.schedule()
    [entry] = batch.entries
    # Back from the cache: only the token after what it cached is computed, nothing scored.
    assert entry.is_prefill and entry.logprob_targets is None
    assert entry.prefix_len == len(prompt) + 1 and len(entry.input_ids) == 1
    sched.update(batch, model.forward(batch))
    while req.status is ReqStatus.RUNNING:
        batch = sched.schedule()
        sched.update(batch, model.forward(batch))
    assert req.output_ids == solo(prompt, 4)
    assert_clean(sched, 4096)
