"""Paged decode attention in Triton: one query token per request, split-K over the context."""

# Triton reads kernel parameter annotations itself, so @triton.jit functions stay unannotated.
# mypy: disable-error-code="untyped-decorator, no-untyped-def"

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from radixlm.kernels.triton_ops._common import dot_block, next_pow2, num_sms, soft_cap, upcast_dots

# Each split covers at least this many tokens of the longest possible context, so short
# contexts are not shredded into splits that each do a single block.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 32


@triton.jit
def _decode_partial_kernel(
    Q,
    K,
    V,
    ReqToToken,
    RowIndex,
    SeqLens,
    Out,
    PartOut,
    PartLse,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_row,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    scale,
    logit_cap,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    row = tl.load(RowIndex + b).to(tl.int64)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    start = seq_len * 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(seq_len - start, NUM_SPLITS)
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    h_offs = tl.arange(0, BLOCK_H)
    h_mask = h_offs < GROUP
    heads = kv_head * GROUP + h_offs
    d_offs = tl.arange(0, BLOCK_D)
    d_mask = d_offs < HEAD_DIM
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d_offs[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < hi
        slots = tl.load(ReqToToken + row * stride_row + pos, mask=p_mask, other=0).to(tl.int64)
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(
            K + slots[:, None] * stride_kt + kv_head * stride_kh + d_offs[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            V + slots[:, None] * stride_vt + kv_head * stride_vh + d_offs[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if UPCAST:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        if HAS_CAP:
            scores = soft_cap(scores, logit_cap)
        scores = tl.where(p_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_keys = l_i > 0.0
    safe_l = tl.where(has_keys, l_i, 1.0)
    result = acc / safe_l[:, None]
    out_mask = h_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d_offs[None, :],
            result.to(Out.dtype.element_ty),
            mask=out_mask,
        )
    else:
        part = b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + split * stride_ps
        tl.store(PartOut + part + d_offs[None, :], result, mask=out_mask)
        lse = tl.where(has_keys, m_i + tl.log(safe_l), float("-inf"))
        tl.store(PartLse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    PartOut,
    PartLse,
    Out,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s_offs = tl.arange(0, BLOCK_S)
    s_mask = s_offs < NUM_SPLITS
    d_offs = tl.arange(0, BLOCK_D)
    d_mask = d_offs < HEAD_DIM
    lse = tl.load(
        PartLse + b * stride_lb + h * stride_lh + s_offs, mask=s_mask, other=float("-inf")
    )
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lse - top)
    parts = tl.load(
        PartOut + b * stride_pb + h * stride_ph + s_offs[:, None] * stride_ps + d_offs[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(weights, 0)
    total = tl.where(total > 0.0, total, 1.0)
    merged = tl.sum(parts * weights[:, None], 0) / total
    tl.store(
        Out + b * stride_ob + h * stride_oh + d_offs, merged.to(Out.dtype.element_ty), mask=d_mask
    )


def default_num_kv_splits(
    batch: int, num_kv_heads: int, max_context: int, device: torch.device
) -> int:
    """Enough splits to give every SM a few programs, never below 256 tokens per split.

    Depends only on shapes (no device values), so the call stays CUDA-graph friendly.
    """
    programs = max(1, batch * num_kv_heads)
    wanted = math.ceil(4 * num_sms(device) / programs)
    longest = max(1, math.ceil(max_context / _MIN_TOKENS_PER_SPLIT))
    return max(1, min(wanted, longest, _MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`radixlm.kernels.decode_attention`."""
    batch, num_heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if req_pool_indices is None:
        req_pool_indices = torch.arange(batch, device=q.device, dtype=torch.int32)
    splits = num_kv_splits or default_num_kv_splits(
        batch, kv_heads, req_to_token.shape[1], q.device
    )
    block_d = dot_block(head_dim)
    block_n = 16 if head_dim > 128 else 32
    if splits > 1:
        part_out = torch.empty(
            (batch, num_heads, splits, head_dim), device=q.device, dtype=torch.float32
        )
        part_lse = torch.empty((batch, num_heads, splits), device=q.device, dtype=torch.float32)
    else:  # the partial buffers are never touched; pass the output to keep the signature
        part_out = out
        part_lse = out
    _decode_partial_kernel[(batch, kv_heads, splits)](
        q,
        k_pool,
        v_pool,
        req_to_token,
        req_pool_indices,
        seq_lens,
        out,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        req_to_token.stride(0),
        out.stride(0),
        out.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2) if splits > 1 else 0,
        part_lse.stride(0),
        part_lse.stride(1),
        scale if scale is not None else 1.0 / math.sqrt(head_dim),
        float(logit_cap or 0.0),
        int(sliding_window or 0),
        GROUP=group,
        HEAD_DIM=head_dim,
        NUM_SPLITS=splits,
        BLOCK_H=dot_block(group),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        HAS_CAP=bool(logit_cap and logit_cap > 0),
        HAS_WINDOW=bool(sliding_window and sliding_window > 0),
        UPCAST=upcast_dots(q.dtype),
        num_warps=4,
    )
    if splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            part_out,
            part_lse,
            out,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            NUM_SPLITS=splits,
            BLOCK_S=next_pow2(splits),
            BLOCK_D=next_pow2(head_dim),
            num_warps=4,
        )
    return out
