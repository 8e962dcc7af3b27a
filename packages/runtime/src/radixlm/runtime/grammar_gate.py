"""A grammar that starts after a marker: structured output after a reasoning model's thinking."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class GatedGrammar:
    """A structured-output matcher that constrains nothing until `marker` (token ids, such as
    those of `</think>`) has been generated, then runs `inner` from its start.

    It satisfies the constrained package's `Grammar` protocol, so the scheduler, the bitmask
    and speculative drafts treat it as any other grammar. Before the marker every token is
    accepted, no token is masked, nothing is forced (no jump-forward) and the output never
    terminates it; the token that completes the marker is the last free one, and the next one
    is the grammar's first. The marker is matched on token ids, exactly: one token, or its
    several tokens in a row. `rollback` may go back across the marker: the grammar is then
    back to not started (and `inner`, rolled back to its start, is as fresh as a new one).

    Not thread-safe: one owner (the sequence's scheduler request).
    """

    def __init__(self, inner: Any, marker: Sequence[int]) -> None:
        if not marker:
            raise ValueError("a gated grammar needs a marker of at least one token")
        self.inner = inner
        self.marker = tuple(int(t) for t in marker)
        #: The output tokens up to and including the marker (all of them until it appears).
        self._free: list[int] = []
        #: Tokens `inner` has accepted since the marker (what `rollback` gives back to it).
        self._constrained = 0
        self._started = False

    @property
    def started(self) -> bool:
        """Whether the marker has been generated: the grammar constrains from here."""
        return self._started

    # -- Grammar -------------------------------------------------------------------------------

    def accept_token(self, token_id: int) -> bool:
        """Before the marker: always True (the token is recorded; the one completing the marker
        starts the grammar). After it: `inner.accept_token`."""
        if not self._started:
            self._free.append(int(token_id))
            marker = self.marker
            if len(self._free) >= len(marker) and tuple(self._free[-len(marker) :]) == marker:
                self._started = True
            return True
        if not self.inner.accept_token(token_id):
            return False
        self._constrained += 1
        return True

    def fill_bitmask(self, bitmask: Any, row: int = 0) -> None:
        """Every token is allowed before the marker; the grammar's tokens after it."""
        if self._started:
            self.inner.fill_bitmask(bitmask, row)
        else:
            bitmask[row] = -1

    def is_terminated(self) -> bool:
        return self._started and bool(self.inner.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens, across the marker if need be."""
        accepted = len(self._free) + self._constrained
        if not 0 <= num_tokens <= accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {accepted} were accepted")
        back = min(num_tokens, self._constrained)
        if back:
            self.inner.rollback(back)
            self._constrained -= back
        rest = num_tokens - back
        if rest:
            del self._free[len(self._free) - rest :]
            self._started = False  # the marker's last token was taken back

    def jump_forward(self) -> Any:
        """Nothing is forced before the marker; the grammar's continuation after it."""
        return self.inner.jump_forward() if self._started else None

    def fork(self) -> GatedGrammar:
        copy = GatedGrammar(self.inner.fork(), self.marker)
        copy._free = list(self._free)
        copy._constrained = self._constrained
        copy._started = self._started
        return copy

    def violation(self) -> Any:
        if not self._started:
            return None
        check = getattr(self.inner, "violation", None)
        return check() if check is not None else None

    # -- what the engine reads besides the protocol --------------------------------------------

    @property
    def committed(self) -> int | None:
        """Output tokens no violation can take back (None when `inner` does not say): the free
        part is final; after the marker, as far as `inner` commits."""
        inner = getattr(self.inner, "committed", None)
        if inner is None:
            return None
        if not self._started:
            return len(self._free)
        return len(self._free) + int(inner)
