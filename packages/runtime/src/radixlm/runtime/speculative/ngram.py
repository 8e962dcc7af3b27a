"""NGRAM drafts (torch-free): what followed the sequence's last n-gram in its own tokens, or what
the radix cache holds after the whole sequence (an earlier answer to the same context).

Prompt lookup: for n from the longest window down to the shortest, find the latest earlier
occurrence of the sequence's last n tokens and propose the tokens that came after it. Tokens
are matched as packed int64 (`array("q")`), one `bytes.rfind` per window length, in C.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from radixlm.cache import RadixCache
from radixlm.runtime.speculative.costs import DraftCosts, StepCost

if TYPE_CHECKING:
    from radixlm.runtime.scheduler.request import Req


def ngram_lookup(tokens: array[int], count: int, min_n: int = 1, max_n: int = 12) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the last n tokens of
    `tokens` (an `array("q")`), for the longest n in [min_n, max_n] that occurs; [] if none."""
    size = len(tokens)
    if count <= 0 or size < 2:
        return []
    data = tokens.tobytes()
    # An occurrence must end before the last token, so at least one token follows it.
    limit = 8 * (size - 1)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        pattern = data[8 * (size - n) :]
        end = limit
        while True:
            at = data.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 8 == 0:  # a whole-token match, not one across token boundaries
                start = at // 8 + n
                return tokens[start : start + count].tolist()
            end = at + len(pattern) - 1
    return []


class NgramDrafter:
    """Drafts for a running request: the radix cache's continuation of its whole sequence when
    that is at least as long as the n-gram lookup's, else the lookup's."""

    def __init__(
        self,
        cache: RadixCache,
        max_draft: int,
        min_window: int = 1,
        max_window: int = 12,
        disable_by_batch_size: int | None = None,
        step_tokens: int | None = None,
        cost: StepCost | None = None,
    ) -> None:
        self.cache = cache
        #: The most draft tokens one request gets per step.
        self.max_draft = max_draft
        self.min_window = min_window
        self.max_window = max_window
        #: No drafts in a step with more decoding requests than this (None: always).
        self.disable_by_batch_size = disable_by_batch_size
        #: The most tokens a decode step with drafts computes (None: no limit).
        self.step_tokens = step_tokens
        #: The target's step cost (a lookup costs nothing next to it).
        self.costs = DraftCosts(cost or StepCost.assumed(), None, step_tokens)

    def threshold(self, size: int) -> float:
        """See the scheduler's `Drafter`."""
        return self.costs.threshold(size)

    def propose(self, asks: Sequence[tuple[Req, int]]) -> list[list[int]]:
        """Per (request, count): up to `count` draft tokens to follow its tokens."""
        return [self.propose_one(req, count) for req, count in asks]

    def accepted(self, req: Req, slots: Sequence[int]) -> None:
        """Nothing to keep: drafts are looked up afresh each step."""

    def propose_one(self, req: Req, count: int) -> list[int]:
        """Up to `count` draft tokens to follow `req`'s tokens."""
        key = req.key()
        # A whole-sequence match is stronger evidence than an n-gram's: it wins a tie.
        seen = self.cache.continuation(key, count, req.extra_key)
        if len(seen) == count:
            return seen
        own = ngram_lookup(key, count, self.min_window, self.max_window)
        return seen if len(seen) >= len(own) else own
