"""Segmented multi-adapter LoRA matmuls in Triton (S-LoRA / Punica SGMV style)."""

# Triton reads kernel parameter annotations itself, so @triton.jit functions stay unannotated.
# mypy: disable-error-code="untyped-decorator, no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.reference.lora import LoraPlan
from radixlm.kernels.triton_ops._common import (
    INTERPRETED,
    Blocks,
    capped_dot_block,
    upcast_dots,
)


def choose_blocks(max_seg_len: int, cols: int, depth: int, dtype: torch.dtype) -> Blocks:
    """Tiles from the longest segment (rows), the output width and the reduction depth.

    Shrink has few output columns (the rank) and a deep K; expand has many output columns and a
    shallow K (the rank). Decode segments (one row each) get 16-row tiles; prefill segments
    grow the row tile so that each weight tile loaded serves more rows. fp32 halves the K step.
    """
    if INTERPRETED:  # small tiles keep the tests quick and exercise the edge masks
        return Blocks(
            16, capped_dot_block(cols, 32), capped_dot_block(depth, 32), num_warps=4, num_stages=1
        )
    m = 16 if max_seg_len <= 16 else 32 if max_seg_len <= 64 else 64
    n = capped_dot_block(cols, 128 if m == 64 else 64)
    k = capped_dot_block(depth, (128 if m <= 32 else 64) // (2 if dtype == torch.float32 else 1))
    stages = 2 if dtype == torch.float32 else 3
    return Blocks(m, n, k, num_warps=4, num_stages=stages)


@triton.jit
def _segment_rows(SegIndptr, T, BLOCK_M: tl.constexpr):
    """This program's rows: ``first`` (its first row) and ``end`` (its segment's end, capped
    at T); ``first >= end`` means the program has no rows."""
    seg = tl.program_id(0)
    end = tl.minimum(tl.load(SegIndptr + seg + 1).to(tl.int64), T)
    first = tl.load(SegIndptr + seg).to(tl.int64) + tl.program_id(1) * BLOCK_M
    return first, end


@triton.jit
def _segment_dot(
    A,
    W,
    rows,
    cols,
    depth,
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``A[rows, :depth] @ W[cols, :depth].T`` in fp32. Rows and columns past the edges were
    redirected to valid ones by the caller (never stored), so only the depth is masked."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = W + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, depth, BLOCK_K):
        k_in = offs_k < depth - k0
        a = tl.load(a_ptrs, mask=k_in[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_in[:, None], other=0.0)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def _lora_shrink_kernel(
    X,
    W,
    Y,
    SegIndptr,
    SegSlots,
    T,
    R,
    K,
    S,
    stride_xt,
    stride_xk,
    stride_ws,
    stride_wr,
    stride_wk,
    stride_yt,
    stride_yr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``y[t, n] = x[t] @ W[slot, n]`` for a tile of one segment's rows; grid (segment, row
    tile, rank tile). Rows without an adapter (slot -1, or a slot outside the pool rather than
    read out of bounds) get zeros."""
    first, end = _segment_rows(SegIndptr, T, BLOCK_M)
    if first >= end:
        return
    slot = tl.load(SegSlots + tl.program_id(0)).to(tl.int64)
    offs_m = first + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = offs_m < end
    col_in = offs_n < R
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if (slot >= 0) & (slot < S):
        rows = tl.where(row_in, offs_m, first)
        cols = tl.where(col_in, offs_n, 0).to(tl.int64)
        acc = _segment_dot(
            X,
            W + slot * stride_ws,
            rows,
            cols,
            K,
            stride_xt,
            stride_xk,
            stride_wr,
            stride_wk,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            UPCAST,
        )
    y_ptrs = Y + offs_m[:, None] * stride_yt + offs_n[None, :] * stride_yr
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


@triton.jit
def _lora_expand_kernel(
    Y,
    W,
    Out,
    SegIndptr,
    SegSlots,
    T,
    N,
    R,
    S,
    stride_yt,
    stride_yr,
    stride_ws,
    stride_wn,
    stride_wr,
    stride_ot,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``out[t, n] += y[t] @ W[slot, n]`` for a tile of one segment's rows; grid (segment, row
    tile, output column tile). Rows without an adapter are left untouched."""
    first, end = _segment_rows(SegIndptr, T, BLOCK_M)
    slot = tl.load(SegSlots + tl.program_id(0)).to(tl.int64)
    if (first >= end) | (slot < 0) | (slot >= S):
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = offs_m < end
    col_in = offs_n < N
    rows = tl.where(row_in, offs_m, first)
    cols = tl.where(col_in, offs_n, 0).to(tl.int64)
    acc = _segment_dot(
        Y,
        W + slot * stride_ws,
        rows,
        cols,
        R,
        stride_yt,
        stride_yr,
        stride_wn,
        stride_wr,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        UPCAST,
    )
    # Sum in fp32, round once into out's dtype.
    out_ptrs = Out + offs_m[:, None] * stride_ot + offs_n[None, :] * stride_on
    mask = row_in[:, None] & col_in[None, :]
    summed = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(out_ptrs, summed.to(Out.dtype.element_ty), mask=mask)


def _longest_segment(seg_indptr: torch.Tensor, max_seg_len: int | None) -> int:
    if max_seg_len is not None:
        return max_seg_len
    if seg_indptr.shape[0] < 2:
        return 0
    return int((seg_indptr[1:] - seg_indptr[:-1]).max().item())  # one device sync


def _grid(groups: int, longest: int, cols: int, blocks: Blocks) -> tuple[int, int, int]:
    return (groups, triton.cdiv(longest, blocks.m), triton.cdiv(cols, blocks.n))


def lora_shrink(
    x: torch.Tensor,
    weights_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    max_seg_len: int | None = None,
    plan: LoraPlan | None = None,  # the reference's row grouping: not needed here
) -> torch.Tensor:
    """Triton version of :func:`radixlm.kernels.lora_shrink`."""
    t, k = x.shape
    s, r, _ = weights_a.shape
    groups = seg_slots.shape[0]
    y = torch.empty((t, r), dtype=x.dtype, device=x.device)
    if t == 0 or r == 0:
        return y
    longest = _longest_segment(seg_indptr, max_seg_len)
    if groups == 0 or longest <= 0:  # no row belongs to a segment
        return y.zero_()
    blocks = choose_blocks(longest, r, k, x.dtype)
    _lora_shrink_kernel[_grid(groups, longest, r, blocks)](
        x,
        weights_a,
        y,
        seg_indptr,
        seg_slots,
        t,
        r,
        k,
        s,
        x.stride(0),
        x.stride(1),
        weights_a.stride(0),
        weights_a.stride(1),
        weights_a.stride(2),
        y.stride(0),
        y.stride(1),
        BLOCK_M=blocks.m,
        BLOCK_N=blocks.n,
        BLOCK_K=blocks.k,
        UPCAST=upcast_dots(x.dtype),
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
    return y


def lora_expand(
    y: torch.Tensor,
    weights_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    out: torch.Tensor,
    *,
    max_seg_len: int | None = None,
    plan: LoraPlan | None = None,  # the reference's row grouping: not needed here
) -> torch.Tensor:
    """Triton version of :func:`radixlm.kernels.lora_expand`."""
    t, r = y.shape
    s, n, _ = weights_b.shape
    groups = seg_slots.shape[0]
    if t == 0 or n == 0 or groups == 0:
        return out
    longest = _longest_segment(seg_indptr, max_seg_len)
    if longest <= 0:
        return out
    blocks = choose_blocks(longest, n, r, y.dtype)
    _lora_expand_kernel[_grid(groups, longest, n, blocks)](
        y,
        weights_b,
        out,
        seg_indptr,
        seg_slots,
        t,
        n,
        r,
        s,
        y.stride(0),
        y.stride(1),
        weights_b.stride(0),
        weights_b.stride(1),
        weights_b.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_M=blocks.m,
        BLOCK_N=blocks.n,
        BLOCK_K=blocks.k,
        UPCAST=upcast_dots(y.dtype),
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
    return out
