"""Torch references of the segmented multi-adapter LoRA matmuls (shrink and expand).

Rows are grouped by adapter slot (a loop over the slots present, never over rows): one
gather, one matmul and one scatter per adapter. The grouping depends only on the segments, so
a caller that runs many layers over the same batch builds it once with :func:`lora_plan` and
passes it to every call (``plan=``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraPlan:
    """The rows of each adapter slot present in a batch of ``rows`` rows: ``(slot, row
    indices)``, the indices None when that slot owns every row (no gather needed)."""

    rows: int
    groups: tuple[tuple[int, torch.Tensor | None], ...]


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


def lora_plan(
    seg_indptr: torch.Tensor, seg_slots: torch.Tensor, rows: int, op: str = "lora_plan"
) -> LoraPlan:
    """Group the rows of a batch by adapter slot (see :class:`LoraPlan`)."""
    row_slots = _row_slots(op, seg_indptr, seg_slots, rows)
    present = [int(s) for s in torch.unique(row_slots).tolist() if s != -1]
    if present and present[0] < -1:
        raise ValueError(f"{op}: seg_slots must be -1 (no adapter) or a slot, got {present[0]}")
    if len(present) == 1 and bool((row_slots == present[0]).all()):
        return LoraPlan(rows, ((present[0], None),))
    return LoraPlan(rows, tuple((s, (row_slots == s).nonzero().squeeze(1)) for s in present))


def _checked_plan(
    op: str,
    plan: LoraPlan | None,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    rows: int,
    num_slots: int,
) -> LoraPlan:
    if plan is None:
        plan = lora_plan(seg_indptr, seg_slots, rows, op)
    elif plan.rows != rows:
        raise ValueError(f"{op}: the plan is for {plan.rows} rows, the batch has {rows}")
    for slot, _ in plan.groups:
        if slot >= num_slots:
            raise ValueError(
                f"{op}: seg_slots must be -1 (no adapter) or a slot in 0..{num_slots - 1}, "
                f"got {slot}"
            )
    return plan


def lora_shrink(
    x: torch.Tensor,
    weights_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    max_seg_len: int | None = None,
    plan: LoraPlan | None = None,
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.lora_shrink` (``max_seg_len`` is ignored)."""
    op = "lora_shrink"
    plan = _checked_plan(op, plan, seg_indptr, seg_slots, x.shape[0], weights_a.shape[0])
    groups = plan.groups
    if len(groups) == 1 and groups[0][1] is None:
        a = weights_a[groups[0][0]]
        if x.dtype == torch.float32:
            return x @ a.T
        return (x.float() @ a.float().T).to(x.dtype)
    y = torch.zeros(x.shape[0], weights_a.shape[1], dtype=x.dtype, device=x.device)
    for slot, rows in groups:
        assert rows is not None
        a = weights_a[slot].float()
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
    plan: LoraPlan | None = None,
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.lora_expand` (``max_seg_len`` is ignored)."""
    op = "lora_expand"
    plan = _checked_plan(op, plan, seg_indptr, seg_slots, y.shape[0], weights_b.shape[0])
    exact = out.dtype == torch.float32 and y.dtype == torch.float32
    for slot, rows in plan.groups:
        b = weights_b[slot]
        if exact:
            # In place: no copy of `out` (the sum is already fp32).
            if rows is None:
                out.addmm_(y, b.T)
            else:
                out.index_add_(0, rows, y.index_select(0, rows) @ b.T)
            continue
        # Sum in fp32 and round once into out's dtype, as the kernel does.
        b = b.float()
        if rows is None:
            out.copy_(out.float() + y.float() @ b.T)
        else:
            summed = out.index_select(0, rows).float() + y.index_select(0, rows).float() @ b.T
            out.index_copy_(0, rows, summed.to(out.dtype))
    return out
