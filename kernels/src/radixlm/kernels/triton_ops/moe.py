"""The grouped (per-expert) matmul of mixture-of-experts layers in Triton, and the fused MoE
built on it."""

# Triton reads kernel parameter annotations itself, so @triton.jit functions stay unannotated.
# mypy: disable-error-code="untyped-decorator, no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.reference.moe import MoePlan, moe_mlp
from radixlm.kernels.triton_ops._common import (
    INTERPRETED,
    Blocks,
    capped_dot_block,
    next_pow2,
    upcast_dots,
)
from radixlm.kernels.triton_ops.elementwise import silu_and_mul


def choose_blocks(rows_per_expert: int, cols: int, depth: int, dtype: torch.dtype) -> Blocks:
    """Tiles from an expert's expected rows, the output width N and the reduction depth K.

    Every row tile of an expert reads that expert's whole weight column tile, so the row tile
    grows with the rows an expert gets (decode: a few, prefill: thousands) to read each weight
    tile fewer times. fp32 halves the K step (shared memory per stage).
    """
    if INTERPRETED:  # small tiles keep the tests quick and exercise the edge masks
        return Blocks(
            16, capped_dot_block(cols, 32), capped_dot_block(depth, 32), num_warps=4, num_stages=1
        )
    m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64
    n = capped_dot_block(cols, 128 if m == 64 else 64)
    k = capped_dot_block(depth, (128 if m <= 32 else 64) // (2 if dtype == torch.float32 else 1))
    stages = 2 if dtype == torch.float32 else 3
    return Blocks(m, n, k, num_warps=4, num_stages=stages)


@triton.jit
def _grouped_matmul_kernel(
    X,
    W,
    Out,
    ExpertOffsets,
    TileStarts,
    M,
    N,
    K,
    E,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``out[rows] = x[rows] @ W[e].T`` for one row tile of one expert e and one column tile;
    grid (row tile, column tile). Expert e's rows ``ExpertOffsets[e] .. ExpertOffsets[e + 1]``
    are cut into tiles numbered ``TileStarts[e] .. TileStarts[e + 1]``; tiles past the last
    one (the grid is an upper bound, known without reading the device) do nothing."""
    tile = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    tile_ends = tl.load(TileStarts + 1 + offs_e, mask=offs_e < E, other=2147483647)
    # The experts whose tiles all come before this one: their count is this tile's expert.
    expert = tl.sum((tile_ends <= tile).to(tl.int32), axis=0)
    if expert >= E:
        return
    first_tile = tl.load(TileStarts + expert)
    end = tl.minimum(tl.load(ExpertOffsets + expert + 1).to(tl.int64), M)
    first = tl.load(ExpertOffsets + expert).to(tl.int64) + (tile - first_tile) * BLOCK_M
    if first >= end:
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_in = offs_m < end
    col_in = offs_n < N
    # Rows and columns past the edges read valid ones (never stored): only K is masked.
    rows = tl.where(row_in, offs_m, first)
    cols = tl.where(col_in, offs_n, 0).to(tl.int64)
    x_ptrs = X + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = (
        W
        + expert.to(tl.int64) * stride_we
        + cols[None, :] * stride_wn
        + offs_k[:, None] * stride_wk
    )  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_in = offs_k < K - k0
        a = tl.load(x_ptrs, mask=k_in[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_in[:, None], other=0.0)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    out_ptrs = Out + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


def _max_tiles(rows: int, experts: int, block_m: int) -> int:
    """The most row tiles ``rows`` rows can need when cut per expert: at most ``min(E, M)``
    experts have rows, and each adds at most one partial tile."""
    busy = min(experts, rows)
    return (rows + busy * (block_m - 1)) // block_m


def grouped_matmul(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    max_rows_per_expert: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`radixlm.kernels.grouped_matmul`."""
    m, k = x.shape
    e, n, _ = weights.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    # Without a hint, assume the rows are spread evenly over the experts that can have some.
    expected = max_rows_per_expert if max_rows_per_expert is not None else triton.cdiv(m, min(e, m))
    blocks = choose_blocks(expected, n, k, x.dtype)
    rows = expert_offsets[1:] - expert_offsets[:-1]
    tile_starts = torch.zeros(e + 1, dtype=torch.int32, device=x.device)
    torch.cumsum(
        torch.div(rows + (blocks.m - 1), blocks.m, rounding_mode="floor"),
        0,
        dtype=torch.int32,
        out=tile_starts[1:],
    )
    grid = (_max_tiles(m, e, blocks.m), triton.cdiv(n, blocks.n))
    _grouped_matmul_kernel[grid](
        x,
        weights,
        out,
        expert_offsets,
        tile_starts,
        m,
        n,
        k,
        e,
        x.stride(0),
        x.stride(1),
        weights.stride(0),
        weights.stride(1),
        weights.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_M=blocks.m,
        BLOCK_N=blocks.n,
        BLOCK_K=blocks.k,
        BLOCK_E=next_pow2(e),
        UPCAST=upcast_dots(x.dtype),
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
    return out


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    plan: MoePlan | None = None,
) -> torch.Tensor:
    """Triton version of :func:`radixlm.kernels.fused_moe`: the reference's composition with
    the Triton grouped matmul and SiLU-and-mul."""
    return moe_mlp(
        hidden,
        w13,
        w2,
        topk_weights,
        topk_ids,
        plan,
        matmul=grouped_matmul,
        activation=silu_and_mul,
    )
