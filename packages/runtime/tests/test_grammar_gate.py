"""`GatedGrammar`: a constraint that starts after a marker (the end of a model's reasoning)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixlm.runtime.config import GrammarConfig
from radixlm.runtime.grammar import GrammarService
from radixlm.runtime.grammar_gate import GatedGrammar

VOCAB = 64


class DigitsOnly:
    """A fake grammar over token ids: accepts tokens 0..9, terminates on 10 (its stop token);
    records what it accepted so rollbacks can be checked."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        if self.is_terminated() or token_id > 10:
            return False
        self.accepted.append(token_id)
        return True

    def fill_bitmask(self, bitmask: Any, row: int = 0) -> None:
        bitmask[row] = 0
        if not self.is_terminated():
            bitmask[row, 0] = (1 << 11) - 1  # tokens 0..10

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == 10

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]

    def jump_forward(self) -> Any:
        return "forced"

    def fork(self) -> DigitsOnly:
        copy = DigitsOnly()
        copy.accepted = list(self.accepted)
        return copy

    def violation(self) -> Any:
        return None


MARKER = (40, 41, 42)  # a marker that is three tokens


def test_tokens_before_the_marker_are_accepted_and_nothing_is_masked_or_forced() -> None:
    gate = GatedGrammar(DigitsOnly(), MARKER)
    for token in (50, 60, 40, 41):  # refused by the grammar, and a partial marker
        assert gate.accept_token(token)
    assert not gate.started and not gate.is_terminated()
    assert gate.jump_forward() is None
    mask = torch.zeros(1, 2, dtype=torch.int32)
    gate.fill_bitmask(mask, 0)
    assert (mask == -1).all()
    assert gate.inner.accepted == []


def test_the_grammar_starts_fresh_at_the_token_after_the_whole_marker() -> None:
    gate = GatedGrammar(DigitsOnly(), MARKER)
    for token in (40, 41, 7, 40, 41, 42):  # an interrupted marker does not count
        assert gate.accept_token(token)
    assert gate.started and gate.inner.accepted == []
    assert not gate.accept_token(50)  # the grammar now decides
    assert gate.accept_token(3) and gate.accept_token(10)
    assert gate.is_terminated() and gate.inner.accepted == [3, 10]
    assert gate.jump_forward() == "forced"


def test_a_one_token_marker_starts_the_grammar_at_the_next_token() -> None:
    gate = GatedGrammar(DigitsOnly(), (42,))
    assert gate.accept_token(42) and gate.started
    assert not gate.accept_token(42)


def test_rolling_back_across_the_marker_stops_the_grammar_again() -> None:
    gate = GatedGrammar(DigitsOnly(), MARKER)
    for token in (50, 40, 41, 42, 1, 2):
        assert gate.accept_token(token)
    gate.rollback(1)
    assert gate.started and gate.inner.accepted == [1]
    gate.rollback(2)  # the `1` and the marker's last token
    assert not gate.started and gate.inner.accepted == []
    assert gate.accept_token(99)  # free again
    gate.rollback(1)
    assert gate.accept_token(42) and gate.started  # the marker completed again
    with pytest.raises(ValueError):
        gate.rollback(5)


def test_a_fork_is_independent() -> None:
    gate = GatedGrammar(DigitsOnly(), MARKER)
    for token in (40, 41, 42, 4):
        gate.accept_token(token)
    copy = gate.fork()
    copy.accept_token(5)
    assert gate.inner.accepted == [4] and copy.inner.accepted == [4, 5]


def test_committed_counts_the_free_part_when_the_grammar_reports_commitment() -> None:
    class Committing(DigitsOnly):
        committed = 1

    assert GatedGrammar(DigitsOnly(), MARKER).committed is None
    gate = GatedGrammar(Committing(), MARKER)
    for token in (9, 40, 41):
        gate.accept_token(token)
    assert gate.committed == 3
    for token in (42, 1, 2):
        gate.accept_token(token)
    assert gate.committed == 4 + 1


def test_a_batch_whose_gated_grammars_all_wait_for_their_marker_needs_no_bitmask() -> None:
    service = GrammarService(GrammarConfig(), tokenizer=None, vocab_size=VOCAB)
    waiting = GatedGrammar(DigitsOnly(), MARKER)
    assert service.bitmask([waiting, None], [(), ()]) is None
    started = GatedGrammar(DigitsOnly(), (42,))
    started.accept_token(42)
    mask = service.bitmask([waiting, started], [(), ()])
    assert mask is not None
    assert (mask[0] == -1).all() and mask[1, 0] == (1 << 11) - 1


def test_drafts_that_cross_the_marker_get_the_grammar_rows_after_it() -> None:
    service = GrammarService(GrammarConfig(), tokenizer=None, vocab_size=VOCAB)
    gate = GatedGrammar(DigitsOnly(), (42,))
    mask = service.bitmask([gate], [(7, 42)])
    assert mask is not None
    assert (mask[0] == -1).all() and (mask[1] == -1).all()  # before and at the marker
    assert mask[2, 0] == (1 << 11) - 1 and (mask[2, 1:] == 0).all()  # after it
    assert not gate.started  # the drafts were taken back
