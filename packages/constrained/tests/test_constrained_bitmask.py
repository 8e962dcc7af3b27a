"""Packed bitmasks and the torch reference that applies them."""

from __future__ import annotations

import pytest
import torch

from radixlm.constrained import (
    allocate_bitmask,
    apply_bitmask,
    bitmask_width,
    reset_bitmask,
    unpack_bitmask,
)
from radixlm.constrained.bitmask import clear_tokens


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """Naive packing of a bool (batch, vocab) tensor, one bit at a time."""
    batch, vocab = allowed.shape
    words = [[0] * bitmask_width(vocab) for _ in range(batch)]
    for row in range(batch):
        for token in range(vocab):
            if allowed[row, token]:
                words[row][token // 32] |= 1 << (token % 32)
    signed = [[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words]
    return torch.tensor(signed, dtype=torch.int32)


def test_allocated_bitmask_allows_everything() -> None:
    bitmask = allocate_bitmask(3, 100)
    assert bitmask.shape == (3, 4) and bitmask.dtype == torch.int32
    assert unpack_bitmask(bitmask, 100).all()


def test_reset_allows_everything_again() -> None:
    bitmask = torch.zeros(2, 4, dtype=torch.int32)
    reset_bitmask(bitmask)
    assert unpack_bitmask(bitmask, 128).all()


def test_unpack_inverts_packing_including_bit_31() -> None:
    allowed = torch.rand(3, 97, generator=torch.Generator().manual_seed(0)) < 0.5
    allowed[:, 31] = True
    allowed[:, 63] = True
    assert torch.equal(unpack_bitmask(pack(allowed), 97), allowed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_sets_disallowed_logits_to_minus_infinity(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    allowed = torch.rand(4, 70, generator=generator) < 0.3
    logits = torch.randn(4, 70, generator=generator).to(dtype)
    expected = logits.masked_fill(~allowed, float("-inf"))
    apply_bitmask(logits, pack(allowed))
    assert torch.equal(logits, expected)


def test_logit_columns_beyond_the_mask_are_masked() -> None:
    logits = torch.zeros(1, 40)
    apply_bitmask(logits, allocate_bitmask(1, 32))
    assert torch.isinf(logits[0, 32:]).all() and torch.isfinite(logits[0, :32]).all()


def test_indices_pick_the_logit_rows_a_mask_applies_to() -> None:
    logits = torch.zeros(3, 32)
    bitmask = torch.zeros(1, 1, dtype=torch.int32)
    apply_bitmask(logits, bitmask, indices=torch.tensor([1]))
    assert torch.isinf(logits[1]).all()
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()


def test_wrong_dtype_or_row_count_is_refused() -> None:
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows"):
        apply_bitmask(torch.zeros(2, 32), allocate_bitmask(1, 32))


def test_clear_tokens_disallows_exactly_those_tokens() -> None:
    vocab = 200
    generator = torch.Generator().manual_seed(0)
    allowed = torch.rand((1, vocab), generator=generator) < 0.7
    cleared = [0, 1, 31, 32, 63, 64, 95, 130, 131, 199]  # bit 31 and several per word
    row = pack(allowed)[0].clone()
    clear_tokens(row, cleared)
    expected = allowed.clone()
    expected[0, cleared] = False
    assert torch.equal(row, pack(expected)[0])
    clear_tokens(row, [])
    assert torch.equal(row, pack(expected)[0])
