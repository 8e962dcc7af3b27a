"""Extend (prefill) attention in Triton over a cached prefix, ragged batch, causal new tokens."""

# Triton reads kernel parameter annotations itself, so @triton.jit functions stay unannotated.
# mypy: disable-error-code="untyped-decorator, no-untyped-def"

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from radixlm.kernels.triton_ops._common import INTERPRETED, dot_block, soft_cap, upcast_dots


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    ReqToToken,
    RowIndex,
    PrefixLens,
    ExtendLens,
    ExtendStarts,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_row,
    scale,
    logit_cap,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    row = tl.load(RowIndex + b).to(tl.int64)
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    extend = tl.load(ExtendLens + b).to(tl.int32)
    q_start = tl.load(ExtendStarts + b).to(tl.int64)

    m_offs = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m_offs < extend
    q_pos = prefix + m_offs
    d_offs = tl.arange(0, BLOCK_D)
    d_mask = d_offs < HEAD_DIM
    tokens = q_start + m_offs
    q = tl.load(
        Q + tokens[:, None] * stride_qt + head * stride_qh + d_offs[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this block of queries can see: [lo, hi). An empty block (past the request's new
    # tokens) gets an empty range and stores nothing.
    hi = prefix + tl.minimum(extend, (m_block + 1) * BLOCK_M)
    hi = tl.where(m_block * BLOCK_M < extend, hi, 0)
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = k_pos < hi
        slots = tl.load(ReqToToken + row * stride_row + k_pos, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
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
        allowed = n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row may see no key in this block (window, or a padding row): keep it finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc / safe_l[:, None]
    tl.store(
        Out + tokens[:, None] * stride_ot + head * stride_oh + d_offs[None, :],
        result.to(Out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_pool_indices: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`radixlm.kernels.extend_attention`."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    batch = prefix_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or batch == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if req_pool_indices is None:
        req_pool_indices = torch.arange(batch, device=q.device, dtype=torch.int32)
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max().item())
    starts = torch.cumsum(extend_lens, 0) - extend_lens
    if INTERPRETED:
        block_m, block_n = 16, 16
    else:
        block_m = 64 if head_dim <= 128 else 32
        block_n = 64 if head_dim <= 64 else 32
    grid = (batch, triton.cdiv(max(max_extend_len, 1), block_m), num_heads)
    _extend_kernel[grid](
        q,
        k_pool,
        v_pool,
        out,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        starts,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        scale if scale is not None else 1.0 / math.sqrt(head_dim),
        float(logit_cap or 0.0),
        int(sliding_window or 0),
        GROUP=num_heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=dot_block(head_dim),
        HAS_CAP=bool(logit_cap and logit_cap > 0),
        HAS_WINDOW=bool(sliding_window and sliding_window > 0),
        UPCAST=upcast_dots(q.dtype),
        num_warps=4,
        num_stages=1 if INTERPRETED else 2,
    )
    return out
