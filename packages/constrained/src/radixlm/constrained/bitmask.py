"""Packed token bitmasks (xgrammar's layout) and a torch reference that applies them to logits.

Row `r` of a bitmask of shape (batch, ceil(vocab_size / 32)), dtype int32, allows token `i`
when bit `i % 32` of word `i // 32` is set. torch is imported on first use, so the rest of the
package works without it.
"""

from __future__ import annotations

from typing import Any


def _torch() -> Any:
    try:
        import torch
    except ImportError as error:  # pragma: no cover - every extra brings torch
        raise ImportError(
            "token bitmasks need torch: pip install 'radixlm-constrained[xgrammar]' "
            "(or install torch)"
        ) from error
    return torch


def word_bit(position: int) -> int:
    """Bit `position` (0..31) of an int32 word, as a signed value (bit 31 is negative)."""
    return (1 << position) - (1 << 32 if position == 31 else 0)


def clear_tokens(row: Any, token_ids: list[int]) -> None:
    """Disallow `token_ids` (distinct) in one bitmask row (a 1-D int32 tensor), in place."""
    if not token_ids:
        return
    torch = _torch()
    ids = torch.tensor(token_ids, dtype=torch.int64)
    bits = torch.zeros(row.shape[0], dtype=torch.int64)
    bits.index_add_(
        0, ids >> 5, torch.ones_like(ids) << (ids & 31)
    )  # distinct bits: a sum is an or
    signed = bits - ((bits >> 31) << 32)  # as int32 words (bit 31 negative)
    row &= ~signed.to(torch.int32, copy=False).to(row.device)


def bitmask_width(vocab_size: int) -> int:
    """Number of int32 words per row for `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def allocate_bitmask(batch: int, vocab_size: int) -> Any:
    """A CPU int32 tensor of shape (batch, bitmask_width(vocab_size)) with every token allowed."""
    torch = _torch()
    return torch.full((batch, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def reset_bitmask(bitmask: Any) -> None:
    """Allow every token again in every row (rows of unconstrained requests)."""
    bitmask.fill_(-1)


def unpack_bitmask(bitmask: Any, vocab_size: int) -> Any:
    """A bool tensor (batch, vocab_size): True where the token is allowed."""
    torch = _torch()
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: Any, bitmask: Any, indices: Any = None) -> None:
    """Set the logits of disallowed tokens to -inf, in place (the torch reference; the runtime
    uses the kernels package on CUDA).

    `logits` is (batch, vocab) of any float dtype; `bitmask` is (batch, width) int32 on any
    device. With `indices`, row `k` of `bitmask` applies to row `indices[k]` of `logits`.
    Logit columns beyond the bitmask's width (a model vocab wider than the mask) are masked.
    """
    torch = _torch()
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError("logits and bitmask must be 2-D (batch, vocab) and (batch, width)")
    rows = logits if indices is None else logits[indices]
    if rows.shape[0] != bitmask.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {rows.shape[0]} rows of logits")
    vocab = logits.shape[1]
    covered = min(vocab, bitmask.shape[1] * 32)
    allowed = torch.zeros(rows.shape, dtype=torch.bool, device=logits.device)
    allowed[:, :covered] = unpack_bitmask(bitmask.to(logits.device), covered)
    masked = rows.masked_fill(~allowed, float("-inf"))
    if indices is None:
        logits.copy_(masked)
    else:
        logits[indices] = masked
