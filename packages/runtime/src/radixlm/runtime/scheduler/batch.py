"""The plain data a scheduling step hands to the model side: one entry per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from radixlm.runtime.scheduler.request import Req
from radixlm.sampling import FinishReason


# Built per request each step: slots, not frozen (see forward_batch.BatchEntry).
@dataclass(slots=True)
class StepEntry:
    """One request's part of a step.

    Compute `input_ids` (positions `prefix_len ..`) into `out_slots`; before that, write
    `row_write = (start, slots)` into the request's row of the request-to-token table when
    given (a cached prefix the row does not hold yet). `sample` says whether the logits after
    the last new token give the request's next token (False for a non-final prefill chunk).
    `logprob_targets`, when given, asks for prompt logprobs: position `logprob_start + i` of
    the new tokens is scored against `logprob_targets[i]`. With `draft`, the new tokens end
    with those draft tokens: the logits after each of the last `len(draft) + 1` new tokens are
    wanted, to verify them and to sample the token after the last accepted one.
    """

    req: Req
    input_ids: list[int]
    prefix_len: int
    out_slots: list[int]
    row: int
    row_write: tuple[int, list[int]] | None
    sample: bool
    is_prefill: bool
    logprob_start: int = 0
    logprob_targets: list[int] | None = None
    #: The request's LoRA adapter slot (-1: the base model).
    lora_slot: int = -1
    #: Draft tokens (speculative decoding), the last `len(draft)` of `input_ids` (None: none).
    draft: list[int] | None = None


@dataclass(frozen=True)
class ScheduledBatch:
    """What to compute in one forward pass (decode entries first, then prefill entries).

    `retracted`: requests sent back to the queue in this step (their tokens are kept);
    `dropped`: requests the scheduler ended because they cannot fit in the KV pool even alone
    (already released; the engine reports them as aborted). `adapter_table`: with LoRA, the
    (uid, directory) each adapter slot holds for this step (None: an empty slot).
    """

    entries: tuple[StepEntry, ...]
    retracted: tuple[Req, ...] = field(default=())
    dropped: tuple[Req, ...] = field(default=())
    adapter_table: tuple[tuple[str, str] | None, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(e.input_ids) for e in self.entries)

    @property
    def prefill_tokens(self) -> int:
        return sum(len(e.input_ids) for e in self.entries if e.is_prefill)

    @property
    def num_decodes(self) -> int:
        return sum(1 for e in self.entries if not e.is_prefill)

    def __len__(self) -> int:
        return len(self.entries)


class SeqUpdate(NamedTuple):
    """What the update phase did to one request's output this step: its tokens changed
    (appended, forced, or taken back: read `req.output_ids`), and `finish` when it ended (its
    memory is already released then)."""

    req: Req
    finish: FinishReason | None = None
