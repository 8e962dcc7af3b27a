"""Req: one sequence the scheduler tracks — its tokens, its KV slots and its place in the queue."""

from __future__ import annotations

import enum
import itertools
from array import array
from collections.abc import Hashable
from typing import Any, Protocol

from radixlm.sampling import FinishReason

_ARRIVALS = itertools.count()


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Stopper(Protocol):
    """A sequence's stop conditions over its output (the runtime's `SequenceOutput`): it is
    told every token appended and every token taken back, and says when the sequence ends."""

    @property
    def finish(self) -> FinishReason | None: ...

    def append(self, token_id: int) -> FinishReason | None: ...

    def rollback(self, num_tokens: int) -> None: ...

    def finish_length(self, message: str | None = None) -> FinishReason: ...

    def stop(
        self, matched: int | str | None = None, message: str | None = None
    ) -> FinishReason: ...

    def abort(self, message: str | None = None) -> FinishReason: ...


class Req:
    """One sequence: a prompt and the tokens generated after it.

    The scheduler owns the memory fields: `kv_slots[i]` is the KV slot of token i for the first
    `kv_len` tokens of `tokens` (the ones computed so far); the first `cache_len` of them belong
    to the radix cache and are protected by the lock on `last_node`; the rest, plus
    `spare_slots` (the unused tail of its last page), belong to the request. `row` is its row
    in the request-to-token table while it runs.

    The scheduler's update phase (`Scheduler.update`) owns the output: it appends sampled and
    forced tokens to `output_ids`, takes tokens back, and ends the request, consulting the
    request's `stopper` (stop conditions) and `grammar` (a structured-output matcher, or None).
    A request waits in the queue while `blocked()` holds: its grammar is compiling, or it is a
    sibling of an `n > 1` request whose prompt is not cached yet.

    A `rewindable` request (one with a grammar that may take tokens back) keeps the KV of its
    last prompt token and of its output out of the cache while it runs, so that any part of
    its output can be taken back and decoding resumed from fresh logits
    (`Scheduler.can_rewind`).
    """

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        extra_key: Hashable | None = None,
        input_logprob_start: int | None = None,
        wait_for: Req | None = None,
        stopper: Stopper | None = None,
        reuse_prefix: bool = True,
        lora: tuple[str, str] | None = None,
        priority: int = 0,
    ) -> None:
        if not prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.max_new_tokens = max_new_tokens
        self.extra_key = extra_key
        #: The first prompt token whose logprob is asked (None: none). Position p's logits
        #: score token p + 1, so scoring starts at position `input_logprob_start - 1`.
        self.input_logprob_start = input_logprob_start
        #: The next position to score (scored positions survive retraction).
        self.input_logprob_next: int | None = (
            None if input_logprob_start is None else max(input_logprob_start - 1, 0)
        )
        self.wait_for = wait_for
        self.stopper = stopper
        #: The structured-output matcher (the constrained package's `Grammar`) once compiled.
        self.grammar: Any = None
        #: Whether the update phase appends the tokens the grammar forces (jump-forward).
        self.jump_forward = False
        self.grammar_rollbacks = 0
        #: False: compute every prompt position, even those the cache holds (the engine wants
        #: an output of each, e.g. its hidden state).
        self.reuse_prefix = reuse_prefix
        #: Whether its decode steps may carry draft tokens (speculative decoding), and how
        #: many at most next time (it follows how many it has had accepted).
        self.speculate = False
        self.draft_cap = 1 << 30
        #: Its drafts' acceptance rate so far (a moving average, per draft position).
        self.accept_rate = 0.75  # the scheduler's _PRIOR_ACCEPT_RATE
        #: Its LoRA adapter: (uid, adapter directory), or None for the base model. The cache
        #: key's `extra_key` should name the adapter too (KV differs under each adapter).
        self.lora = lora
        #: Its scheduling priority (used when the scheduler orders by priority).
        self.priority = priority
        self._prompt_key: array[int] | None = None
        self.arrival = next(_ARRIVALS)
        self.status = ReqStatus.WAITING
        self.grammar_pending = False
        self.rewindable = False
        self.finished = False
        # Memory (the scheduler's).
        self.kv_slots: list[int] = []
        self.spare_slots: list[int] = []
        self.cache_len = 0
        self.last_node: Any = None
        self.row: int | None = None
        self.row_synced = 0  # leading positions whose slots are written in the row
        #: Leading positions whose slots a draft model has its own K/V of (speculative
        #: decoding; lowered with `row_synced` wherever the slots change).
        self.draft_kv_len = 0
        self.in_prefill = False
        # Statistics.
        self.cached_tokens: int | None = None  # prefix hit at the first admission
        self.host_cached_tokens = 0  # of them, brought back from host memory (hierarchical cache)
        self.storage_cached_tokens = 0  # and from storage
        self.retractions = 0
        self.forward_passes = 0
        self.draft_tokens = 0  # draft tokens verified
        self.accepted_tokens = 0  # of which accepted

    @property
    def kv_len(self) -> int:
        """Tokens whose K/V are computed (or scheduled in the step being built)."""
        return len(self.kv_slots)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]:
        """Tokens `start:end` of prompt + output."""
        prompt = len(self.prompt_ids)
        end = self.seq_len if end is None else end
        if end <= prompt:
            return self.prompt_ids[start:end]
        if start >= prompt:
            return self.output_ids[start - prompt : end - prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - prompt]

    def key(self) -> array[int]:
        """Prompt + output as `array("q")`: the key the radix cache matches without converting
        it (a list key costs more to pack than the whole match). The prompt's part is packed
        once per request."""
        if self._prompt_key is None:
            self._prompt_key = array("q", self.prompt_ids)
        if not self.output_ids:
            return self._prompt_key
        return self._prompt_key + array("q", self.output_ids)

    @property
    def input_logprobs_done(self) -> bool:
        """No prompt position is left to score."""
        nxt = self.input_logprob_next
        return nxt is None or nxt >= len(self.prompt_ids) - 1

    @property
    def pending(self) -> int:
        """Tokens to compute before the next token can be sampled."""
        return self.seq_len - self.kv_len

    def blocked(self) -> bool:
        """Whether the request must stay in the queue for now."""
        if self.grammar_pending:
            return True
        parent = self.wait_for
        if parent is None:
            return False
        if parent.finished or (parent.status is ReqStatus.RUNNING and not parent.in_prefill):
            self.wait_for = None
            return False
        return True

    @property
    def owned_slots(self) -> list[int]:
        """Slots this request must give back when it releases its memory."""
        return self.kv_slots[self.cache_len :] + self.spare_slots

    def __repr__(self) -> str:
        return (
            f"Req({self.rid!r}, {self.status.value}, prompt={len(self.prompt_ids)}, "
            f"output={len(self.output_ids)}, kv={self.kv_len}, cached={self.cache_len})"
        )
