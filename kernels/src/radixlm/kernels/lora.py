"""Public segmented multi-adapter LoRA matmuls: shrink (``x @ A.T``) and expand (``+= y @ B.T``).

A batch's T rows are split into G contiguous segments by ``seg_indptr`` (``[G + 1]``, from 0 to
T, non-decreasing; empty segments allowed), and ``seg_slots[g]`` is the slot of segment g's
adapter in a stacked weight pool, or -1 for rows without an adapter. This is the SGMV layout of
S-LoRA and Punica: one launch serves a batch that mixes adapters. Scaling (alpha / r) is folded
into B by the caller, and ranks below the pool's R are zero-padded, so no per-slot rank is
needed.
"""

from __future__ import annotations

import torch

from radixlm.kernels import _checks, reference
from radixlm.kernels._backend import use_triton
from radixlm.kernels.reference.lora import LoraPlan, lora_plan

__all__ = ["MAX_RANK", "LoraPlan", "lora_expand", "lora_plan", "lora_shrink"]

# The tiles are sized for LoRA ranks (shrink's rank tiles sit on a grid axis); a wider
# low-rank product is better served by two dense GEMMs.
MAX_RANK = 256


def _fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def _segments(
    op: str,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int | None,
) -> None:
    """Shapes and dtypes of the segment tensors only: their values stay on the device."""
    _checks.integer(op, "seg_indptr", seg_indptr)
    _checks.integer(op, "seg_slots", seg_slots)
    if seg_indptr.dim() != 1 or seg_indptr.shape[0] < 1:
        _fail(op, f"seg_indptr must have shape [G + 1] (G >= 0), got {tuple(seg_indptr.shape)}")
    _checks.length(op, "seg_slots", seg_slots, seg_indptr.shape[0] - 1, "G")
    if max_seg_len is not None and max_seg_len < 0:
        _fail(
            op, f"max_seg_len must be >= 0 (or None to read it from seg_indptr), got {max_seg_len}"
        )


def _pool(
    op: str, name: str, weights: torch.Tensor, shape: str, act: str, dtype: torch.dtype
) -> None:
    _checks.rank(op, name, weights, 3, shape)
    if weights.dtype != dtype:
        _fail(op, f"{name} must have {act}'s dtype {dtype}, got {weights.dtype}")


def _rank(op: str, r: int, source: str) -> None:
    if r > MAX_RANK:
        _fail(op, f"the LoRA rank R = {r} ({source}) must be at most {MAX_RANK}")


def lora_shrink(
    x: torch.Tensor,
    weights_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    max_seg_len: int | None = None,
    plan: LoraPlan | None = None,
) -> torch.Tensor:
    """``y[t] = weights_a[slot(t)] @ x[t]`` (that is ``x @ A.T``) row by row, each row with its
    segment's adapter; zeros for rows whose slot is -1.

    Args:
        x: ``[T, K]`` float32 / float16 / bfloat16; any strides (a column slice of a wider
            tensor is fine).
        weights_a: ``[S, R, K]`` in x's dtype: the A matrices of S adapter slots, max rank
            ``R <= 256`` (smaller ranks zero-padded).
        seg_indptr: ``[G + 1]`` int32 / int64; segment g holds rows
            ``seg_indptr[g] .. seg_indptr[g + 1] - 1``. Must run non-decreasing from 0 to T.
        seg_slots: ``[G]`` int32 / int64; each segment's slot in ``0 .. S - 1``, or -1.
        max_seg_len: the longest segment's length if the caller knows it (it must not be
            smaller); otherwise the Triton path reads it from the device (one synchronisation).
            The reference ignores it.
        plan: the rows grouped by slot (:func:`lora_plan` of these segments), built once for a
            batch and passed to every layer's call: the reference then skips the grouping. The
            Triton path ignores it.

    Returns:
        A new ``[T, R]`` tensor in x's dtype, accumulated in fp32. The segment tensors' values
        are not checked on the Triton path (no synchronisation): a slot outside the pool gives
        zeros there, while the reference raises ``ValueError``.
    """
    op = "lora_shrink"
    _checks.rank(op, "x", x, 2, "[T, K]")
    _checks.floating(op, "x", x)
    _pool(op, "weights_a", weights_a, "[S, R, K]", "x", x.dtype)
    if weights_a.shape[2] != x.shape[1]:
        _fail(
            op,
            f"weights_a must have shape [S, R, K] with K = {x.shape[1]} (x.shape[1]), got "
            f"{tuple(weights_a.shape)}",
        )
    _rank(op, weights_a.shape[1], "weights_a.shape[1]")
    _segments(op, seg_indptr, seg_slots, max_seg_len)
    _checks.same_device(
        op, {"x": x, "weights_a": weights_a, "seg_indptr": seg_indptr, "seg_slots": seg_slots}
    )
    if use_triton(x):
        from radixlm.kernels import triton_ops

        impl = triton_ops.lora_shrink
    else:
        impl = reference.lora_shrink
    return impl(x, weights_a, seg_indptr, seg_slots, max_seg_len=max_seg_len, plan=plan)


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
    """``out[t] += weights_b[slot(t)] @ y[t]`` (that is ``out += y @ B.T``) in place, row by row
    with each row's segment's adapter; rows whose slot is -1 are left untouched.

    Args:
        y: ``[T, R]`` float32 / float16 / bfloat16 (usually :func:`lora_shrink`'s result, or a
            column slice of it when several projections were shrunk together); any strides.
        weights_b: ``[S, N, R]`` in y's dtype, the B matrices with the LoRA scaling folded in.
        seg_indptr, seg_slots, max_seg_len, plan: as in :func:`lora_shrink`.
        out: ``[T, N]`` float32 / float16 / bfloat16, updated in place; any strides, e.g. the
            column slice ``qkv[:, q_size:q_size + kv_size]`` of a fused projection's output.

    Returns:
        ``out``, after adding the fp32 product to it and rounding once into its dtype.
    """
    op = "lora_expand"
    _checks.rank(op, "y", y, 2, "[T, R]")
    _checks.floating(op, "y", y)
    _pool(op, "weights_b", weights_b, "[S, N, R]", "y", y.dtype)
    _rank(op, y.shape[1], "y.shape[1]")
    _checks.rank(op, "out", out, 2, "[T, N]")
    _checks.floating(op, "out", out)
    if tuple(out.shape) != (y.shape[0], weights_b.shape[1]):
        _fail(
            op,
            f"out must have shape [T, N] = [{y.shape[0]}, {weights_b.shape[1]}] (y.shape[0], "
            f"weights_b.shape[1]), got {tuple(out.shape)}",
        )
    if weights_b.shape[2] != y.shape[1]:
        _fail(
            op,
            f"weights_b must have shape [S, N, R] with R = {y.shape[1]} (y.shape[1]), got "
            f"{tuple(weights_b.shape)}",
        )
    _segments(op, seg_indptr, seg_slots, max_seg_len)
    _checks.same_device(
        op,
        {
            "y": y,
            "weights_b": weights_b,
            "seg_indptr": seg_indptr,
            "seg_slots": seg_slots,
            "out": out,
        },
    )
    if use_triton(y):
        from radixlm.kernels import triton_ops

        impl = triton_ops.lora_expand
    else:
        impl = reference.lora_expand
    return impl(y, weights_b, seg_indptr, seg_slots, out, max_seg_len=max_seg_len, plan=plan)
