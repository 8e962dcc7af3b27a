"""Torch references of the segmented multi-adapter LoRA matmuls (shrink and expand)."""

from __future__ import annotations

import torch


def _row_slots(
    op: str, seg_indptr: torch.Tensor, seg_slots: torch.Tensor, rows: int
) -> torch.Tensor:
    """The adapter slot of every row (int64 ``[rows]``), from segment boundaries and slots."""
    lengths = (seg_indptr[1:] - seg_indptr[:-1]).long()
    first, last = int(seg_indptr[0]), int(seg_indptr[-1])
    if first != 0 or last != rows or (lengths.numel() and int(lengths.min()) < 0):
        raise ValueError(
            f"{op}: seg_indptr must be non-decreasing from 0 to the number of rows T = "
            f"{rows}, got seg_indptr[0] = {first}, seg_indptr[-1] = {last}"
        )
    return torch.repeat_interleave(seg_slots.long(), lengths, output_size=rows)


def _groups(
    op: str, row_slots: torch.Tensor, num_slots: int
) -> list[tuple[int, torch.Tensor | None]]:
    """``(slot, rows)`` for every adapter slot present; ``rows`` is None when the slot owns the
    whole batch (no gather needed). Loops over distinct slots only, never over rows."""
    present = [int(s) for s in torch.unique(row_slots).tolist() if s != -1]
    if present and (present[0] < -1 or present[-1] >= num_slots):
        raise ValueError(
            f"{op}: seg_slots must be -1 (no adapter) or a slot in 0..{num_slots - 1}, got "
            f"{present[0] if present[0] < -1 else present[-1]}"
        )
    if len(present) == 1 and bool((row_slots == present[0]).all()):
        return [(present[0], None)]
    return [(s, (row_slots == s).nonzero().squeeze(1)) for s in present]


def lora_shrink(
    x: torch.Tensor,
    weights_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    max_seg_len: int | None = None,
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.lora_shrink` (``max_seg_len`` is ignored)."""
    op = "lora_shrink"
    y = torch.zeros(x.shape[0], weights_a.shape[1], dtype=x.dtype, device=x.device)
    row_slots = _row_slots(op, seg_indptr, seg_slots, x.shape[0])
    for slot, rows in _groups(op, row_slots, weights_a.shape[0]):
        a = weights_a[slot].float()
        if rows is None:
            y.copy_(x.float() @ a.T)
        else:
            y.index_copy_(0, rows, (x.index_select(0, rows).float() @ a.T).to(x.dtype))
    return y


def lora_expand(
    y: torch.Tensor,
    weights_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    out: torch.Tensor,
    *,
    max_seg_len: int | None = None,
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.lora_expand` (``max_seg_len`` is ignored)."""
    op = "lora_expand"
    row_slots = _row_slots(op, seg_indptr, seg_slots, y.shape[0])
    for slot, rows in _groups(op, row_slots, weights_b.shape[0]):
        b = weights_b[slot].float()
        # Sum in fp32 and round once into out's dtype, as the kernel does.
        if rows is None:
            out.copy_(out.float() + y.float() @ b.T)
        else:
            summed = out.index_select(0, rows).float() + y.index_select(0, rows).float() @ b.T
            out.index_copy_(0, rows, summed.to(out.dtype))
    return out
