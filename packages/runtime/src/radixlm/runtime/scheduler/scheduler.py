"""Scheduler: waiting queue, running batch, KV-slot budgets, prefix reuse and retraction.

Torch-free. One step: `schedule()` picks the work and allocates its KV slots (evicting from the
radix cache before refusing, retracting the youngest running requests when decode runs out of
slots), the model side computes it, and `update(batch, tokens)` — the one update phase —
records what was computed (caching finished prefill chunks), appends the sampled and forced
tokens, takes tokens back for grammars, checks stops and ends finished requests with
`finish(req)` / `abort(req)`, which give every slot back (to the cache when reusable, else to
the pool). What is left for the engine is to emit the outputs. Not thread-safe: one thread (the
engine loop) calls it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Literal, Protocol

from radixlm.cache import Demoted, MatchResult, RadixCache
from radixlm.runtime.config import SchedulerConfig
from radixlm.runtime.scheduler.adapters import AdapterSlots
from radixlm.runtime.scheduler.batch import ScheduledBatch, SeqUpdate, StepEntry
from radixlm.runtime.scheduler.policy import Policy, common_prefix_tokens
from radixlm.runtime.scheduler.request import Req, ReqStatus
from radixlm.sampling import EngineOverloaded


class SlotPool(Protocol):
    """The KV slots (e.g. the runner's `KVPool`): whole pages of `page_size` slots."""

    page_size: int

    @property
    def available(self) -> int:
        """Free token slots."""
        ...

    def alloc_pages(self, num_pages: int) -> list[int] | None:
        """The slots of `num_pages` free pages (in order), or None if fewer are free."""
        ...

    def free(self, slots: Sequence[int]) -> None:
        """Give back slots of whole pages, in page order."""
        ...


class TierFind(Protocol):
    """What the lower tiers hold past a tree match: tokens `start` .. `end`, the first
    `host_tokens` of them in host memory (the rest in storage)."""

    start: int
    end: int

    @property
    def host_tokens(self) -> int: ...


class Tiers(Protocol):
    """The tiers under the KV pool (a hierarchical cache: the runtime's `HierarchicalCache`):
    what the tree evicts is demoted to them, a prompt that goes on past the tree's match into
    pages they hold gets those copied back into fresh slots."""

    page_size: int

    def demote(self, leaf: Demoted) -> None:
        """The tree is about to evict `leaf` (its slots still hold the K/V)."""
        ...

    def cached(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        extra_key: Hashable | None,
        start: int,
        reused: bool,
    ) -> None:
        """The tree now holds `tokens` in `slots`, new from `start` on (write-through)."""
        ...

    def find(
        self, tokens: Sequence[int], matched: int, limit: int, extra_key: Hashable | None
    ) -> TierFind | None:
        """What the tiers hold of `tokens` past `matched`, up to `limit` tokens."""
        ...

    def load(self, found: Any, slots: Sequence[int]) -> int:
        """Copy what `find` found into `slots`; how many tokens were copied."""
        ...

    def drop(self, found: Any) -> None:
        """What `find` found will not be loaded."""
        ...

    def prefetch(self, tokens: Sequence[int], extra_key: Hashable | None) -> None:
        """A request for `tokens` arrived: start reading what storage holds of it."""
        ...

    def clear(self) -> None: ...

    def check_invariants(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None:
        """Stop what runs beside the scheduler (a storage read-ahead thread)."""
        ...


class Drafter(Protocol):
    """Proposes draft tokens for a decoding request (speculative decoding; e.g. the runtime's
    `NgramDrafter`)."""

    max_draft: int
    disable_by_batch_size: int | None
    #: The most tokens (decodes and drafts) a decode step may compute with drafts (None: no
    #: limit); drafts are cut to fit.
    step_tokens: int | None

    def threshold(self, size: int) -> float:
        """The chance of acceptance a draft row must beat in a step of `size` decodes (what
        the row and its proposal cost against what a token costs without drafts)."""
        ...

    def propose(self, asks: Sequence[tuple[Req, int]]) -> list[list[int]]:
        """Per (request, count): up to `count` tokens likely to follow the request's tokens
        (its last one has no KV yet). Asked once per step, for every request it drafts for."""
        ...

    def accepted(self, req: Req, slots: Sequence[int]) -> None:
        """The step verified `req`'s drafts: `slots` now hold the K/V of the token before them
        and of the drafts accepted, in order (a draft model keeps its own K/V of them)."""
        ...


class RowPool(Protocol):
    """Rows of the request-to-token table (e.g. the runner's `ReqToTokenPool`)."""

    def alloc(self) -> int | None: ...

    def free(self, row: int) -> None: ...


#: What appending one token did: the sequence goes on, it finished, or a grammar violation
#: took tokens back (the token was not kept).
Appended = Literal["ok", "finished", "rolled_back"]


class Scheduler:
    """Continuous batching over a radix cache. See the module docstring for the step."""

    def __init__(
        self,
        config: SchedulerConfig,
        pool: SlotPool,
        rows: RowPool,
        cache: RadixCache,
        max_running_requests: int = 256,
        context_length: int = 1 << 30,
        adapters: AdapterSlots | None = None,
        drafter: Drafter | None = None,
        tiers: Tiers | None = None,
    ) -> None:
        if cache.page_size != pool.page_size:
            raise ValueError("the radix cache and the KV pool must use the same page size")
        self.config = config
        self.pool = pool
        self.rows = rows
        self.cache = cache
        self.page = pool.page_size
        #: The most requests running at once: the request-to-token table's rows.
        self.max_running = max_running_requests
        #: A sequence that reaches this many tokens ends (finish reason length).
        self.context_length = context_length
        #: The LoRA adapter slots (None: the engine serves no adapters). A request is admitted
        #: only when its adapter has a slot, so a step never needs more than the pool holds.
        self.adapters = adapters
        #: Speculative decoding: proposes draft tokens for the decodes of requests that
        #: `speculate` (None: no drafts).
        self.drafter = drafter
        #: The hierarchical cache's tiers under the pool (None: what the tree evicts is gone).
        self.tiers = tiers if not cache.disabled else None
        if self.tiers is not None and self.tiers.page_size % self.page:
            raise ValueError("the lower tiers' page size must be a multiple of the KV pool's")
        self.host_cached_tokens = 0  # prompt tokens brought back from host memory
        self.storage_cached_tokens = 0  # and from storage
        self.policy = Policy(
            config.schedule_policy, config.policy_fallback_queue_len, config.random_seed
        )
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.new_token_ratio = config.init_new_token_ratio
        # The last step left requests waiting for memory (KV slots or table rows), not slots.
        self.memory_bound = False
        # Prefix matches made while ordering the queue, reused at admission when no eviction
        # came between (each candidate is matched once per step).
        self._matches: dict[Req, tuple[int, MatchResult]] = {}
        self._evictions = 0
        # Statistics (cumulative).
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.num_retractions = 0
        self.generated_tokens = 0
        self.jump_forward_tokens = 0
        self.grammar_rollbacks = 0
        self.draft_tokens = 0  # draft tokens verified
        self.accepted_tokens = 0  # of which accepted
        self.verify_steps = 0  # decode entries that carried drafts

    # ---------------------------------------------------------------------------- the queue

    @property
    def caching(self) -> bool:
        return not self.cache.disabled

    def headroom(self) -> int:
        """Requests that could join the running batch at the next step: the free running
        slots, or none while memory holds waiting requests back."""
        return 0 if self.memory_bound else max(0, self.max_running - len(self.running))

    def backlog(self, incoming: int = 0) -> int:
        """Requests that must wait (`max_queued_requests` bounds it): the waiting ones plus
        `incoming`, less those the next step can admit. A burst that fits in free running
        slots is not a queue, even before the loop has admitted it."""
        return max(0, len(self.waiting) + incoming - self.headroom())

    def add(self, req: Req) -> Req | None:
        """Queue a request; raises EngineOverloaded beyond `max_queued_requests` waiting.
        Under priority scheduling a full queue takes a request whose priority beats a waiting
        one's that has not run yet: that one leaves the queue (unfinished) and is returned
        for its owner to refuse."""
        limit = self.config.max_queued_requests
        bumped = None
        if limit is not None and self.backlog(1) > limit:
            bumped = self._bumped_by(req)
            if bumped is None:
                raise EngineOverloaded(
                    f"the engine's queue is full ({limit} requests waiting); retry later"
                )
            self.waiting.remove(bumped)
        req.status = ReqStatus.WAITING
        self.waiting.append(req)
        if self.tiers is not None and req.reuse_prefix:
            self.tiers.prefetch(req.key(), req.extra_key)  # storage reads while it waits
        return bumped

    # ------------------------------------------------------------------------- priorities

    def rank(self, req: Req) -> int:
        """Smaller runs first: the request's priority in the configured direction (0 for
        every request without priority scheduling)."""
        config = self.config
        if not config.enable_priority_scheduling:
            return 0
        return req.priority if config.schedule_low_priority_values_first else -req.priority

    def _victim(self, among: Sequence[Req]) -> Req:
        """The request to retract first: the lowest priority, the youngest among equals."""
        return max(among, key=lambda r: (self.rank(r), r.arrival))

    def _bumped_by(self, req: Req) -> Req | None:
        """The waiting request a full queue refuses to take `req` (priority scheduling): the
        lowest-priority one below `req`'s that never ran (one that ran has sent output)."""
        if not self.config.enable_priority_scheduling:
            return None
        rank = self.rank(req)
        fresh = [r for r in self.waiting if r.retractions == 0 and self.rank(r) > rank]
        return self._victim(fresh) if fresh else None

    def _preempt(self, retracted: list[Req]) -> None:
        """Priority scheduling: retract running requests whose priority the best waiting
        request beats by the preemption threshold (lowest first) until it could be admitted:
        a running slot and room for its next chunk beside what the others keep."""
        config = self.config
        waiting = [r for r in self.waiting if not r.blocked()]
        if not waiting:
            return
        req = min(waiting, key=lambda r: (self.rank(r), r.arrival))
        floor = self.rank(req) + max(config.priority_scheduling_preemption_threshold, 1)
        while True:
            victims = [r for r in self.running if self.rank(r) >= floor]
            if not victims:
                return
            count = min(req.seq_len, config.prefill_budget)
            future = self.new_token_ratio * min(req.max_new_tokens, config.clip_max_new_tokens)
            reserve = sum(self._reserve(r) for r in self.running)
            free = self.pool.available + (self.cache.evictable_size if self.caching else 0)
            fits = free >= self._tokens_to_alloc(req, count) + reserve + future
            if len(self.running) < self.max_running and fits:
                return
            retracted.append(self._retract(self._victim(victims)))

    def abort(self, req: Req) -> None:
        """Remove a request wherever it is and give back everything it holds (nothing is
        cached for it). Idempotent."""
        if req.status is ReqStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        elif req.status is ReqStatus.RUNNING:
            self._release(req, cache_it=False)
            self.running.remove(req)
        self._mark_finished(req)

    def finish(self, req: Req) -> None:
        """A running request ended normally: cache prompt + output, unlock, free the rest."""
        if req.status is ReqStatus.RUNNING:
            self._release(req, cache_it=True)
            self.running.remove(req)
        elif req.status is ReqStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self._mark_finished(req)

    def flush_cache(self) -> bool:
        """Empty the radix cache if no request is running; False otherwise."""
        if self.running:
            return False
        self.pool.free(self.cache.reset())
        if self.tiers is not None:
            self.tiers.clear()
        return True

    @staticmethod
    def _mark_finished(req: Req) -> None:
        req.status = ReqStatus.FINISHED
        req.finished = True

    # ------------------------------------------------------------------------------ memory

    def _make_room(self, tokens: int) -> bool:
        """Free slots until `tokens` are available, evicting from the cache; False if it
        cannot be done (nothing is evicted then)."""
        available = self.pool.available
        if available >= tokens:
            return True
        short = tokens - available
        if not self.caching or self.cache.evictable_size < short:
            return False
        self._evictions += 1  # matches made before this may hold evicted nodes
        demote = self.tiers.demote if self.tiers is not None else None
        self.pool.free(self.cache.evict(short, demote))
        return self.pool.available >= tokens

    def _tokens_to_alloc(self, req: Req, count: int) -> int:
        """Fresh slots (whole pages) needed to add `count` tokens to `req`."""
        need = count - len(req.spare_slots)
        if need <= 0:
            return 0
        return -(-need // self.page) * self.page

    def _alloc(self, req: Req, count: int) -> list[int] | None:
        """Slots for the next `count` tokens of `req` (appended to its kv_slots), or None."""
        fresh = self._tokens_to_alloc(req, count)
        new: list[int] = []
        if fresh:
            if not self._make_room(fresh):
                return None
            got = self.pool.alloc_pages(fresh // self.page)
            if got is None:
                return None
            new = got
        pool = req.spare_slots + new
        slots, req.spare_slots = pool[:count], pool[count:]
        req.kv_slots.extend(slots)
        return slots

    def _release(self, req: Req, cache_it: bool) -> None:
        """Give back a running request's slots, row and lock; with `cache_it`, first insert its
        computed tokens into the cache (which keeps the new part)."""
        kv = req.kv_len
        if cache_it and self.caching and kv > 0:
            key = req.tokens(0, kv)
            result = self.cache.insert(key, req.kv_slots, req.extra_key)
            inserted = result.prefix_len
            stored = kv - kv % self.page
            if self.tiers is not None and stored > inserted:
                self.tiers.cached(
                    key[:stored], result.indices, req.extra_key, inserted, bool(req.cached_tokens)
                )
            duplicates = req.kv_slots[req.cache_len : max(req.cache_len, inserted)]
            self.pool.free(duplicates + req.kv_slots[stored:] + req.spare_slots)
        else:
            self.pool.free(req.owned_slots)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        if req.row is not None:
            self.rows.free(req.row)
        if req.lora is not None and self.adapters is not None:
            self.adapters.release(req.lora[0])
        req.kv_slots = []
        req.spare_slots = []
        req.cache_len = 0
        req.last_node = None
        req.row = None
        req.row_synced = 0
        req.draft_kv_len = 0
        req.in_prefill = False

    def _cache_computed(self, req: Req) -> None:
        """Insert what `req` has computed into the cache and hold it by a lock (the cache's
        slots replace the request's duplicates). A rewindable request keeps its last prompt
        token and its output to itself (see `can_rewind`)."""
        kv = self._cacheable(req, req.kv_len)
        stored = kv - kv % self.page
        if not self.caching or stored <= req.cache_len:
            return
        key = req.tokens(0, stored)
        inserted = self.cache.insert(key, req.kv_slots[:stored], req.extra_key)
        assert len(inserted.indices) == stored, "a fresh insert must hold the key in full"
        if inserted.prefix_len > req.cache_len:
            self.pool.free(req.kv_slots[req.cache_len : inserted.prefix_len])
            req.row_synced = min(req.row_synced, req.cache_len)
            req.draft_kv_len = min(req.draft_kv_len, req.cache_len)
        if self.tiers is not None and stored > inserted.prefix_len:
            self.tiers.cached(
                key, inserted.indices, req.extra_key, inserted.prefix_len, bool(req.cached_tokens)
            )
        self.cache.lock(inserted.node)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.kv_slots[:stored] = inserted.indices
        req.cache_len = stored
        req.last_node = inserted.node

    def _cacheable(self, req: Req, tokens: int) -> int:
        """How many of the first `tokens` tokens of `req` may belong to the cache while it
        runs: all, or for a rewindable request at most its prompt less the last token."""
        return min(tokens, len(req.prompt_ids) - 1) if req.rewindable else tokens

    def can_rewind(self, req: Req, num_tokens: int) -> bool:
        """Whether the last `num_tokens` output tokens (0 included) can be taken back with the
        token before them computed again, for fresh logits at the new end (a grammar
        violation): that token's KV must belong to the request, not to the cache. Always true
        for a `rewindable` request."""
        return 0 <= num_tokens <= len(req.output_ids) and (
            req.seq_len - num_tokens - 1 >= req.cache_len
        )

    def can_rollback(self, req: Req, num_tokens: int) -> bool:
        """Whether the last `num_tokens` output tokens can be taken back (their KV, if any,
        belongs to the request and not to the cache)."""
        return req.seq_len - num_tokens >= req.cache_len and num_tokens <= len(req.output_ids)

    def trim_kv(self, req: Req, recompute_last: bool = False) -> None:
        """After output tokens were taken back (`del req.output_ids[-k:]`), drop the KV of
        positions past the new end (their slots stay with the request for its next tokens);
        with `recompute_last`, the last token's too, so the next step computes it again and
        samples from fresh logits. Check `can_rollback` (`can_rewind` with `recompute_last`)
        before taking tokens back."""
        keep = req.seq_len - 1 if recompute_last else req.seq_len
        if keep < req.kv_len:
            assert keep >= req.cache_len, "cannot take back tokens the cache owns"
            self._drop_kv(req, keep)

    # -------------------------------------------------------------------------- scheduling

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work and allocate its slots. Mutates the queue, the running set,
        the pool and the cache (locks, evictions). The batch may be empty."""
        retracted: list[Req] = []
        dropped: list[Req] = []
        budget = self.config.prefill_budget
        if self.config.enable_priority_scheduling and self.waiting:
            self._preempt(retracted)
        while True:
            if self.config.enable_mixed_chunk:
                entries = self._schedule_decodes(retracted, dropped)
                entries += self._schedule_prefills(budget - len(entries), retracted, bool(entries))
            else:
                entries = self._schedule_prefills(budget, retracted, False)
                if not entries:
                    entries = self._schedule_decodes(retracted, dropped)
            if entries or not self.running:
                break
            # Nothing could run but requests hold memory: free some and try again.
            if len(self.running) > 1:
                retracted.append(self._retract(self._victim(self.running)))
            else:
                dropped.append(self._drop(self.running[0]))
        if any(not e.is_prefill for e in entries):
            self.new_token_ratio = max(
                self.config.min_new_token_ratio,
                self.new_token_ratio - self.config.new_token_ratio_decay,
            )
        table = self.adapters.snapshot() if self.adapters is not None else None
        return ScheduledBatch(tuple(entries), tuple(retracted), tuple(dropped), table)

    def _retract(self, req: Req) -> Req:
        """Send a running request back to the queue: its computed tokens go to the cache (or
        are freed), its tokens stay; it is prefilled again when admitted."""
        self._release(req, cache_it=True)
        self.running.remove(req)
        req.status = ReqStatus.WAITING
        req.retractions += 1
        self.waiting.append(req)
        self.num_retractions += 1
        self.new_token_ratio = self.config.init_new_token_ratio
        self.memory_bound = True
        return req

    def retract_all(self) -> int:
        """Send every running request back to the queue (a pause that frees their KV slots;
        their computed tokens stay in the cache); how many went back."""
        running = list(self.running)
        for req in running:
            self._retract(req)
        self.memory_bound = False  # nothing waits for memory because of this
        return len(running)

    def _drop(self, req: Req) -> Req:
        """End a request that cannot fit in the KV pool even alone."""
        self._release(req, cache_it=True)
        self.running.remove(req)
        self._mark_finished(req)
        return req

    def _drafts(self, decoding: Sequence[Req]) -> dict[Req, list[int]]:
        """Draft tokens for this step's decodes (speculative decoding): each request that
        speculates and has one token to compute gets up to `max_draft` of them, fewer near its
        `max_new_tokens` or the context's end or its `draft_cap`, only a prefix its grammar
        allows, and no more
        in all than the drafter's `step_tokens` leave room for."""
        drafter = self.drafter
        if drafter is None:
            return {}
        limit = drafter.disable_by_batch_size
        if limit is not None and len(decoding) > limit:
            return {}
        budget = drafter.step_tokens
        left = 1 << 30 if budget is None else budget - sum(r.pending for r in decoding)
        # A draft j tokens deep is accepted with chance about rate ** j: worth its row and
        # its proposal while that beats the drafter's threshold.
        worth = drafter.threshold(len(decoding))
        asks: list[tuple[Req, int]] = []
        for req in decoding:
            if left <= 0:
                break
            if not req.speculate or req.pending != 1:
                continue
            deep = _worth_drafting(req.accept_rate, worth)
            if deep == 0:
                # Not worth a row now; the rate drifts back so that the request tries again
                # (what it writes may start to repeat).
                req.accept_rate += 0.1 * (_PRIOR_ACCEPT_RATE - req.accept_rate)
                continue
            room = min(
                drafter.max_draft,
                req.draft_cap,
                deep,
                left,
                req.max_new_tokens - len(req.output_ids) - 1,
                self.context_length - req.seq_len - 1,
            )
            if room > 0:
                asks.append((req, room))
                left -= room
        drafts: dict[Req, list[int]] = {}
        if not asks:
            return drafts
        for (req, _room), draft in zip(asks, drafter.propose(asks), strict=True):
            if draft and req.grammar is not None:
                draft = _grammar_prefix(req.grammar, draft)
            if draft:
                drafts[req] = draft
        return drafts

    def _schedule_decodes(self, retracted: list[Req], dropped: list[Req]) -> list[StepEntry]:
        decoding = [r for r in self.running if not r.in_prefill]
        if not decoding:
            return []
        drafts = self._drafts(decoding)
        while True:
            fresh = [self._tokens_to_alloc(r, r.pending + len(drafts.get(r, ()))) for r in decoding]
            if self._make_room(sum(fresh)):
                break
            if drafts:  # drafts never cost another request its place
                drafts = {}
                continue
            first = min(decoding, key=lambda r: (self.rank(r), r.arrival))
            victims = [r for r in self.running if r is not first]
            if not victims:
                dropped.append(self._drop(decoding[0]))
                return []
            victim = self._victim(victims)
            retracted.append(self._retract(victim))
            if victim in decoding:
                decoding.remove(victim)
        # One allocation for all of them (room was made), shared out in order.
        got = self.pool.alloc_pages(sum(fresh) // self.page)
        assert got is not None, "room was made for every decode"
        entries = []
        at = 0
        lora = self.adapters is not None
        for req, count in zip(decoding, fresh, strict=True):
            start = len(req.kv_slots)
            pending = req.pending
            draft = drafts.get(req) if drafts else None
            if draft is not None:
                pool = req.spare_slots + got[at : at + count] if count else req.spare_slots
                at += count
                total = pending + len(draft)
                slots, req.spare_slots = pool[:total], pool[total:]
                req.kv_slots.extend(slots)
                entries.append(self._entry(req, start, slots, is_prefill=False, draft=draft))
                continue
            if pending == 1 and count == 1 and not req.spare_slots:
                # The common decode: one fresh slot for the last token.
                slots = [got[at]]
                req.kv_slots.append(got[at])
                at += 1
                row_write = None
                if req.row_synced < start:
                    row_write = (req.row_synced, req.kv_slots[req.row_synced : start])
                assert req.row is not None
                entries.append(
                    StepEntry(
                        req,
                        [req.output_ids[-1]] if req.output_ids else req.tokens(start, start + 1),
                        start,
                        slots,
                        req.row,
                        row_write,
                        True,
                        False,
                        lora_slot=self._lora_slot(req) if lora else -1,
                    )
                )
                continue
            pool = req.spare_slots + got[at : at + count] if count else req.spare_slots
            at += count
            slots, req.spare_slots = pool[:pending], pool[pending:]
            req.kv_slots.extend(slots)
            entries.append(self._entry(req, start, slots, is_prefill=False))
        return entries

    def _entry(
        self,
        req: Req,
        start: int,
        slots: list[int],
        is_prefill: bool,
        draft: list[int] | None = None,
    ) -> StepEntry:
        assert req.row is not None
        row_write = None
        if req.row_synced < start:
            row_write = (req.row_synced, req.kv_slots[req.row_synced : start])
        end = start + len(slots) - (len(draft) if draft else 0)
        targets: list[int] | None = None
        logprob_start = 0
        if is_prefill and req.input_logprob_next is not None and not req.input_logprobs_done:
            prompt = len(req.prompt_ids)
            first = max(req.input_logprob_next, start)
            last = min(prompt - 1, end)
            if last > first:
                targets = req.prompt_ids[first + 1 : last + 1]
                logprob_start = first - start
            else:
                targets = []
        return StepEntry(
            req=req,
            input_ids=req.tokens(start, end) + draft if draft else req.tokens(start, end),
            prefix_len=start,
            out_slots=slots,
            row=req.row,
            row_write=row_write,
            sample=end == req.seq_len,
            is_prefill=is_prefill,
            logprob_start=logprob_start,
            logprob_targets=targets,
            lora_slot=self._lora_slot(req),
            draft=draft,
        )

    def _lora_slot(self, req: Req) -> int:
        if req.lora is None or self.adapters is None:
            return -1
        return self.adapters.slot_of(req.lora[0])

    def _reserve(self, req: Req) -> float:
        """Slots `req` will still need: its uncomputed tokens and a share of its output."""
        remaining = max(req.max_new_tokens - len(req.output_ids), 0)
        remaining = min(remaining, self.config.clip_max_new_tokens)
        return req.pending + self.new_token_ratio * remaining

    def _schedule_prefills(
        self, budget: int, retracted: Sequence[Req], have_entries: bool
    ) -> list[StepEntry]:
        entries: list[StepEntry] = []
        chunking = self.config.chunked_prefill_size is not None
        # Requests in the middle of a chunked prefill continue first.
        for req in [r for r in self.running if r.in_prefill]:
            if budget <= 0:
                return entries
            count = min(req.pending, budget) if chunking else req.pending
            start = req.kv_len
            slots = self._alloc(req, count)
            if slots is None:
                return entries
            entries.append(self._entry(req, start, slots, is_prefill=True))
            budget -= count
        if not self.waiting:
            self.memory_bound = False
        if budget <= 0 or not self.waiting or len(self.running) >= self.max_running:
            return entries
        # Requests retracted in this step wait for the next one (no thrashing).
        candidates = [r for r in self.waiting if not r.blocked() and r not in retracted]
        if not candidates:
            return entries
        self.memory_bound = bool(retracted)  # set again below if memory stops admission
        self._matches.clear()
        order = self.policy.order(candidates, self._prefix_length)
        if self.config.enable_priority_scheduling:
            order.sort(key=self.rank)  # stable: the policy's order among equal priorities
        prefix_aware = self.policy.name in ("lpm", "dfs-weight") and (
            len(candidates) <= self.config.policy_fallback_queue_len
        )
        in_flight = [(r.extra_key, r.key().tobytes()) for r in self.running if r.in_prefill]
        reserve = sum(self._reserve(r) for r in self.running)
        for req in order:
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            if req.lora is not None and not self._adapter_fits(req.lora[0]):
                continue  # every adapter slot is held by running requests: wait for one
            match = self._match(req)
            if self.tiers is not None and req.reuse_prefix:
                match = self._promote(req, match)
            prefix = match.length if req.reuse_prefix else 0
            if req.input_logprob_next is not None and not req.input_logprobs_done:
                limit = req.input_logprob_next  # its logits must be computed
                prefix = min(prefix, limit - limit % self.page)
            limit = self._cacheable(req, prefix)  # a retracted one recomputes its output
            prefix = min(prefix, limit - limit % self.page)
            packed = req.key().tobytes() if prefix_aware else b""
            if (
                prefix_aware
                and req.reuse_prefix
                and self._shares_in_flight(req, packed, prefix, in_flight)
            ):
                continue  # reuse it from the cache once the other request has computed it
            extend = req.seq_len - prefix
            count = min(extend, budget) if chunking else extend
            if not chunking and count > budget and (entries or have_entries):
                break
            self.cache.lock(match.node)
            idle = not self.running and not entries
            future = self.new_token_ratio * min(req.max_new_tokens, self.config.clip_max_new_tokens)
            needed = self._tokens_to_alloc(req, count)
            free = self.pool.available + (self.cache.evictable_size if self.caching else 0)
            if (not idle and free < needed + reserve + future) or not self._make_room(needed):
                self.cache.unlock(match.node)
                self.memory_bound = True
                break
            row = self.rows.alloc()
            if row is None:
                self.cache.unlock(match.node)
                self.memory_bound = True
                break
            self._admit(req, match.node, match.indices[:prefix], row)
            slots = self._alloc(req, count)
            assert slots is not None, "room was made"
            entries.append(self._entry(req, prefix, slots, is_prefill=True))
            budget -= count
            reserve += self._reserve(req)
            if prefix_aware:
                in_flight.append((req.extra_key, packed))
        self._matches.clear()
        return entries

    def _adapter_fits(self, uid: str) -> bool:
        if self.adapters is None:
            raise RuntimeError("a request names a LoRA adapter but the engine serves none")
        return self.adapters.can_place(uid)

    def _prefix_length(self, req: Req) -> int:
        if not self.caching:
            return 0
        match = self.cache.match_prompt(req.key(), req.extra_key)
        self._matches[req] = (self._evictions, match)
        return match.length

    def _match(self, req: Req) -> MatchResult:
        """The request's cached prefix: the match made while ordering the queue this step if
        nothing was evicted since (its node and indices are still valid), else a new one."""
        made = self._matches.pop(req, None)
        if made is not None and made[0] == self._evictions:
            return made[1]
        return self.cache.match_prompt(req.key(), req.extra_key)

    def _promote(self, req: Req, match: MatchResult) -> MatchResult:
        """The request's match extended by what the lower tiers hold after it: copied into
        fresh slots and inserted into the tree (evicting, and so demoting, others to make
        room), then matched again. The match as it was when they hold nothing of it or it
        does not fit."""
        assert self.tiers is not None
        key = req.key()
        limit = len(key) - 1  # as match_prompt: the last prompt token is computed
        limit -= limit % self.page
        found = self.tiers.find(key, match.length, limit, req.extra_key)
        if found is None:
            return match
        count = min(found.end, limit) - match.length
        self.cache.lock(match.node)  # its slots are the promoted sequence's start
        slots = None
        if count > 0 and self._make_room(count):
            slots = self.pool.alloc_pages(count // self.page)
        if slots is None:
            self.tiers.drop(found)
            self.cache.unlock(match.node)
            return match
        loaded = self.tiers.load(found, slots)
        self.pool.free(slots[loaded:])
        self.cache.unlock(match.node)
        if loaded == 0:
            return match
        end = match.length + loaded
        refilled = getattr(self.drafter, "refilled", None)
        if refilled is not None:  # a draft model's K/V of these slots is someone else's
            refilled(slots[:loaded])
        inserted = self.cache.insert(key[:end], match.indices + slots[:loaded], req.extra_key)
        # The tree held exactly `match.length` of it (nothing ran in between): it took them all.
        assert inserted.prefix_len == match.length, "the tree changed during a promotion"
        if req.cached_tokens is None:  # counted at the first admission, as cached_tokens
            host = min(loaded, found.host_tokens)
            req.host_cached_tokens, req.storage_cached_tokens = host, loaded - host
            self.host_cached_tokens += host
            self.storage_cached_tokens += loaded - host
        return self.cache.match_prompt(key, req.extra_key)

    def _reach(self, req: Req) -> int:
        """The most of `req`'s sequence the cache could give it: all but the last token, up to
        where its input logprobs start and what it may share while it runs, in whole pages."""
        reach = req.seq_len - 1
        if req.input_logprob_next is not None and not req.input_logprobs_done:
            reach = min(reach, req.input_logprob_next)
        reach = self._cacheable(req, reach)
        return reach - reach % self.page

    def _shares_in_flight(
        self, req: Req, packed: bytes, prefix: int, in_flight: list[tuple[Hashable | None, bytes]]
    ) -> bool:
        """Whether a request admitted before it (in this step or in prefill from an earlier
        one) is computing tokens this one could take from the cache instead: at least
        `in_batch_prefix_min` of them, or all that the cache lacks of it (a copy of a prompt
        sent as separate requests, as HTTP clients send `n`)."""
        threshold = self.config.in_batch_prefix_min
        if not self.caching or threshold <= 0:
            return False
        reach = self._reach(req)
        if reach <= prefix:
            return False
        for extra_key, other in in_flight:
            if extra_key != req.extra_key:  # cached apart (another adapter's K/V)
                continue
            common = min(common_prefix_tokens(packed, other), reach)
            gain = common - common % self.page - prefix
            if gain >= threshold or (gain > 0 and prefix + gain >= reach):
                return True
        return False

    def _admit(self, req: Req, node: object, prefix_slots: list[int], row: int) -> None:
        self.waiting.remove(req)
        self._occupy(req, node, prefix_slots, row)

    def _occupy(self, req: Req, node: object, prefix_slots: list[int], row: int) -> None:
        """Make `req` a running request in prefill, holding `row` and its cached prefix."""
        self.running.append(req)
        req.status = ReqStatus.RUNNING
        req.in_prefill = True
        req.last_node = node
        req.kv_slots = list(prefix_slots)
        req.cache_len = len(prefix_slots)
        req.row = row
        req.row_synced = 0
        req.draft_kv_len = 0
        if req.lora is not None and self.adapters is not None:
            self.adapters.acquire(*req.lora)
        if req.cached_tokens is None:
            req.cached_tokens = len(prefix_slots)
            self.prompt_tokens += len(req.prompt_ids)
            self.cached_tokens += len(prefix_slots)

    def after_forward(self, batch: ScheduledBatch) -> None:
        """Record that the batch was computed: rows are in sync, finished prefills end their
        prefill phase, and computed prompt chunks are inserted into the cache."""
        for entry in batch.entries:
            req = entry.req
            if req.status is not ReqStatus.RUNNING:
                continue
            req.forward_passes += 1
            req.row_synced = entry.prefix_len + len(entry.input_ids)
            if entry.logprob_targets:
                req.input_logprob_next = (
                    entry.prefix_len + entry.logprob_start + len(entry.logprob_targets)
                )
            if entry.is_prefill:
                if entry.sample:
                    req.in_prefill = False
                self._cache_computed(req)

    # ------------------------------------------------------------------------ update phase

    def update(
        self,
        batch: ScheduledBatch,
        tokens: Sequence[int | None],
        accepted: Sequence[int] | None = None,
    ) -> list[SeqUpdate]:
        """After the forward: record what was computed (`after_forward`), then, for each entry
        that sampled, append its token (`tokens` is row-aligned with `batch.entries`, None where
        nothing was sampled), apply its grammar (a refused token ends the request, a completed
        value that breaks a keyword takes tokens back), append the tokens its grammar forces
        (jump-forward, re-tokenizing across the boundary), check its stop conditions and the
        context, and end it when it stops: its computed tokens go to the cache, everything else
        back to the pool. Returns one `SeqUpdate` per request whose output changed; after
        this, nothing but emitting remains to be done for the step.

        An entry with draft tokens had `accepted[i]` of them accepted (row-aligned, speculative
        decoding): they are appended before its token, the KV of the rejected ones is dropped
        (their slots stay with the request)."""
        self.after_forward(batch)
        updates: list[SeqUpdate] = []
        for index, (entry, token) in enumerate(zip(batch.entries, tokens, strict=True)):
            req = entry.req
            stopper = req.stopper
            if req.status is not ReqStatus.RUNNING or not entry.sample:
                continue
            assert stopper is not None, "a running request that samples has a stopper"
            if req.max_new_tokens == 0:  # prompt scoring or pooling: nothing is generated
                stopper.finish_length()
            elif token is None:
                continue
            elif entry.draft:
                assert accepted is not None, "a step with drafts says how many were accepted"
                if self._append_verified(req, entry.draft, accepted[index], token):
                    self._jump_forward(req)
            elif self._append(req, token) == "ok" and req.jump_forward and stopper.finish is None:
                self._jump_forward(req)
            updates.append(self._settle(req))
        return updates

    def _settle(self, req: Req) -> SeqUpdate:
        """End `req` if its stopper says so (aborted: freed; else cached and freed)."""
        assert req.stopper is not None
        finish = req.stopper.finish
        if finish is not None:
            if finish.type == "abort":
                self.abort(req)
            else:
                self.finish(req)
        return SeqUpdate(req, finish)

    # ------------------------------------------------------------ prefilled elsewhere

    def admit_prefilled(self, req: Req) -> list[int] | None:
        """Start running a request whose prompt another engine computed (the decode side of
        prefill/decode disaggregation; it is not in the queue): a running place, a table row
        and fresh KV slots for its whole prompt, which are returned for the caller to write
        the prompt's K/V into before the next step; then `append_prefilled` gives it its first
        token. None when they are not free now (nothing changed; try again after a step);
        with nothing running, None means the prompt does not fit in the pool at all.

        The prompt is not matched against the cache: the request runs on the K/V it was sent
        (bit for bit what its prefill computed), which goes to the cache when it ends, as a
        computed prompt does. Mutates the running set, the pool and the cache (evictions)."""
        if len(self.running) >= self.max_running:
            return None
        if req.lora is not None and not self._adapter_fits(req.lora[0]):
            return None
        count = len(req.prompt_ids)
        needed = self._tokens_to_alloc(req, count)
        # As a prefill is admitted: room beside what the running requests will still need.
        reserve = sum(self._reserve(r) for r in self.running)
        future = self.new_token_ratio * min(req.max_new_tokens, self.config.clip_max_new_tokens)
        free = self.pool.available + self.evictable_tokens()
        if (self.running and free < needed + reserve + future) or not self._make_room(needed):
            return None
        row = self.rows.alloc()
        if row is None:
            return None
        self._occupy(req, None, [], row)
        slots = self._alloc(req, count)
        assert slots is not None, "room was made"
        req.in_prefill = False  # its K/V is written now; the next step decodes
        if req.input_logprob_next is not None:
            # Its prompt logprobs came with its K/V: a retraction recomputes none.
            req.input_logprob_next = max(req.input_logprob_next, len(req.prompt_ids) - 1)
        return slots

    def append_prefilled(self, req: Req, token: int) -> SeqUpdate:
        """Append the first output token of a request `admit_prefilled` started (sampled by the
        engine that computed its prompt) as the update phase appends a sampled token: through
        its grammar, with the tokens the grammar forces after it, and its stops (it may end
        here)."""
        assert req.stopper is not None
        if self._append(req, token) == "ok" and req.jump_forward and req.stopper.finish is None:
            self._jump_forward(req)
        return self._settle(req)

    def _append_verified(self, req: Req, draft: list[int], accepted: int, token: int) -> bool:
        """Append the first `accepted` draft tokens and then `token`, as far as the request goes
        on; drop the KV past what it keeps. True when jump-forward should follow."""
        self.verify_steps += 1
        self.draft_tokens += len(draft)
        self.accepted_tokens += accepted
        req.draft_tokens += len(draft)
        req.accepted_tokens += accepted
        # Drafts cost a row each: after a refusal the next draft stops one past the accepted
        # run; each draft accepted whole allows one more (a verify row pays for itself only
        # when it is likely to be accepted).
        if accepted == len(draft):
            req.draft_cap = len(draft) + 1
        else:
            req.draft_cap = accepted + 1
        tried = accepted + (accepted < len(draft))
        req.accept_rate = 0.7 * req.accept_rate + 0.3 * (accepted / tried)
        # The rejected drafts' K/V are not the sequence's: their slots become spares.
        kept = req.kv_len - (len(draft) - accepted)
        assert self.drafter is not None, "drafts come from the drafter"
        self.drafter.accepted(req, req.kv_slots[kept - accepted - 1 : kept])
        self._drop_kv(req, kept)
        result: Appended = "ok"
        for tok in (*draft[:accepted], token):
            result = self._append(req, tok)
            if result != "ok":
                break
        if req.kv_len > req.seq_len:  # it ended on an accepted draft: the later ones go too
            self._drop_kv(req, req.seq_len)
        assert req.stopper is not None
        return result == "ok" and req.jump_forward and req.stopper.finish is None

    @staticmethod
    def _drop_kv(req: Req, keep: int) -> None:
        if keep < req.kv_len:
            req.spare_slots = req.kv_slots[keep:] + req.spare_slots
            del req.kv_slots[keep:]
            req.row_synced = min(req.row_synced, keep)
            req.draft_kv_len = min(req.draft_kv_len, keep)

    def _append(self, req: Req, token: int) -> Appended:
        """Add one token to a running request (sampled, or forced by its grammar)."""
        stopper = req.stopper
        assert stopper is not None
        grammar = req.grammar
        if grammar is not None:
            if not grammar.accept_token(token):
                # A grammar that ran into its own limits says why (llguidance's lexer fuel).
                reason = _violation(grammar)
                stopper.abort(
                    reason.message
                    if reason is not None
                    else f"the grammar does not allow token {token}"
                )
                return "finished"
            violation = _violation(grammar)
            if violation is not None:
                return self._violated(req, violation)
        req.output_ids.append(token)
        reason = stopper.append(token)
        self.generated_tokens += 1
        if reason is None and req.seq_len >= self.context_length:
            reason = stopper.finish_length("the context length is reached")
        if reason is None and grammar is not None and grammar.is_terminated():
            stopper.stop(matched=token)
        return "ok" if stopper.finish is None else "finished"

    def _violated(self, req: Req, violation: Any) -> Appended:
        """A completed value broke a keyword the grammar validates: take back
        `violation.rollback` tokens (the one just accepted, which never reached the output, and
        those before it) and decode on from there; end the request when the grammar's retries
        are used up or the tokens cannot be taken back."""
        stopper = req.stopper
        assert stopper is not None
        count = int(violation.rollback)
        earlier = count - 1  # output tokens to take back besides the one just accepted
        if violation.fatal:
            stopper.abort(violation.message)
            return "finished"
        if count < 1 or not self.can_rewind(req, earlier):
            stopper.abort(
                f"{violation.message} (the output cannot be taken back {count} tokens to retry)"
            )
            return "finished"
        req.grammar.rollback(count)
        self._take_back(req, earlier)
        # The last token kept is computed again: its logits choose the next token anew.
        self.trim_kv(req, recompute_last=True)
        self.generated_tokens -= earlier
        self.grammar_rollbacks += 1
        req.grammar_rollbacks += 1
        return "rolled_back"

    def _jump_forward(self, req: Req) -> None:
        """Append the tokens the grammar forces; the next step computes them in one extend."""
        jump = req.grammar.jump_forward()
        if jump is None or not jump.token_ids:
            return
        if jump.rollback:
            if not self.can_rollback(req, jump.rollback):
                return
            req.grammar.rollback(jump.rollback)
            self._take_back(req, jump.rollback)
            self.trim_kv(req)
            self.generated_tokens -= jump.rollback
        for token in jump.token_ids:
            self.jump_forward_tokens += 1
            if self._append(req, token) != "ok":
                return

    @staticmethod
    def _take_back(req: Req, num_tokens: int) -> None:
        if num_tokens > 0:
            del req.output_ids[len(req.output_ids) - num_tokens :]
            assert req.stopper is not None
            req.stopper.rollback(num_tokens)

    # ------------------------------------------------------------------------- inspection

    def evictable_tokens(self) -> int:
        return self.cache.evictable_size if self.caching else 0

    def held_tokens(self) -> int:
        """Slots held by running requests outside the cache."""
        return sum(len(r.owned_slots) for r in self.running)

    def check_memory(self, pool_size: int) -> None:
        """Raise AssertionError unless free + cached + held by requests == pool size (and
        the lower tiers' pages are each held once or free once)."""
        self.cache.check_invariants()
        if self.tiers is not None:
            self.tiers.check_invariants()
        total = self.pool.available + self.cache.total_size + self.held_tokens()
        assert total == pool_size, (
            f"slot leak: free {self.pool.available} + cached {self.cache.total_size} + held "
            f"{self.held_tokens()} = {total} != pool size {pool_size}"
        )


def _violation(grammar: Any) -> Any:
    """A grammar's report of a broken keyword or of its own limits (None: nothing)."""
    check = getattr(grammar, "violation", None)
    return check() if check is not None else None


def _grammar_prefix(grammar: Any, draft: Sequence[int]) -> list[int]:
    """The longest prefix of `draft` that `grammar` accepts from its current state: a token it
    forbids, one past its end or one that breaks a keyword it validates ends it. The grammar
    is left as it was (the update phase accepts the tokens verified)."""
    accepted = kept = 0
    for token in draft:
        if grammar.is_terminated() or not grammar.accept_token(token):
            break
        accepted += 1
        if _violation(grammar) is not None:
            break
        kept += 1
    if accepted:
        grammar.rollback(accepted)
    return list(draft[:kept])


#: A request's drafts' acceptance rate before it has any (and what an idle one drifts back to).
_PRIOR_ACCEPT_RATE = 0.75


def _worth_drafting(rate: float, worth: float, most: int = 64) -> int:
    """How many drafts deep the chance of acceptance (about rate ** depth) stays above
    `worth`."""
    depth, chance = 0, rate
    while depth < most and chance > worth:
        depth += 1
        chance *= rate
    return depth
