"""Row-wise Triton kernels: KV store, RMSNorm (+ residual), rotary embedding, SiLU-and-mul."""

# Triton reads kernel parameter annotations itself, so @triton.jit functions stay unannotated.
# mypy: disable-error-code="untyped-decorator, no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.triton_ops._common import next_pow2


def _rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as ``[rows, last]`` with a unit stride on the last dimension."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x
    return x.reshape(-1, x.shape[-1])


@triton.jit
def _store_kv_kernel(
    K,
    V,
    KPool,
    VPool,
    Slots,
    stride_kt,
    stride_vt,
    stride_kpt,
    stride_vpt,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WIDTH
    slot = tl.load(Slots + t).to(tl.int64)
    t64 = t.to(tl.int64)
    k = tl.load(K + t64 * stride_kt + offs, mask=mask)
    tl.store(KPool + slot * stride_kpt + offs, k.to(KPool.dtype.element_ty), mask=mask)
    v = tl.load(V + t64 * stride_vt + offs, mask=mask)
    tl.store(VPool + slot * stride_vpt + offs, v.to(VPool.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Triton version of :func:`radixlm.kernels.store_kv`."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    width = k.shape[1] * k.shape[2]
    # Heads and head_dim must be dense inside a token; the token stride may be anything.
    if k.stride(2) != 1 or k.stride(1) != k.shape[2]:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != v.shape[2]:
        v = v.contiguous()
    block = min(next_pow2(width), 1024)
    _store_kv_kernel[(num_tokens, triton.cdiv(width, block))](
        k,
        v,
        k_pool,
        v_pool,
        slots,
        k.stride(0),
        v.stride(0),
        k_pool.stride(0),
        v_pool.stride(0),
        WIDTH=width,
        BLOCK=block,
    )


@triton.jit
def _rms_norm_kernel(
    X,
    Residual,
    Weight,
    Out,
    ResidualOut,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    weight_offset,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
        # The new residual stream is rounded to the activation dtype, as an unfused add would.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResidualOut + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32) + weight_offset
    tl.store(Out + row * stride_o + offs, (xf * inv_rms * w).to(Out.dtype.element_ty), mask=mask)


def _rms_norm_launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = _rows(residual)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ro2 = res_out.view(-1, hidden)
    else:
        r2, res_out, ro2 = x2, None, out2
    if x2.shape[0] == 0:
        return out, res_out
    block = next_pow2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight,
        out2,
        ro2,
        x2.stride(0),
        r2.stride(0),
        out2.stride(0),
        ro2.stride(0),
        float(eps),
        float(weight_offset),
        HIDDEN=hidden,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, res_out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """Triton version of :func:`radixlm.kernels.rms_norm`."""
    out, _ = _rms_norm_launch(x, None, weight, eps, weight_offset)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`radixlm.kernels.fused_add_rms_norm`."""
    out, res_out = _rms_norm_launch(x, residual, weight, eps, weight_offset)
    assert res_out is not None
    return out, res_out


@triton.jit
def _rotary_kernel(
    X,
    Out,
    Cos,
    Sin,
    Positions,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_cos,
    stride_sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NEOX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h_offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i_offs = tl.arange(0, BLOCK_HALF)
    mask = (h_offs < NUM_HEADS)[:, None] & (i_offs < HALF)[None, :]
    pos = tl.load(Positions + t).to(tl.int64)
    cos = tl.load(Cos + pos * stride_cos + i_offs, mask=i_offs < HALF, other=0.0).to(tl.float32)
    sin = tl.load(Sin + pos * stride_sin + i_offs, mask=i_offs < HALF, other=0.0).to(tl.float32)
    if NEOX:
        first = i_offs
        second = i_offs + HALF
    else:
        first = 2 * i_offs
        second = 2 * i_offs + 1
    x_base = X + t * stride_xt + h_offs[:, None] * stride_xh
    o_base = Out + t * stride_ot + h_offs[:, None] * stride_oh
    x1 = tl.load(x_base + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + second[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(o_base + first[None, :], o1.to(Out.dtype.element_ty), mask=mask)
    tl.store(o_base + second[None, :], o2.to(Out.dtype.element_ty), mask=mask)


def _rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    neox_style: bool,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    half = cos.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    # Dimensions past the rotary part pass through unchanged: start from a copy then.
    out = torch.empty_like(x) if 2 * half == head_dim else x.clone()
    if num_tokens == 0 or num_heads == 0:
        return out
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    block_half = next_pow2(half)
    block_h = max(1, min(next_pow2(num_heads), 4096 // block_half))
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x,
        out,
        cos,
        sin,
        positions,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_HEADS=num_heads,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        NEOX=neox_style,
    )
    return out


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`radixlm.kernels.rotary_embedding`."""
    return _rotate(q, cos, sin, positions, neox_style), _rotate(k, cos, sin, positions, neox_style)


@triton.jit
def _silu_and_mul_kernel(
    X,
    Out,
    stride_x,
    stride_o,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HALF
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Out + row * stride_o + offs, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`radixlm.kernels.silu_and_mul`."""
    half = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], half), dtype=x.dtype, device=x.device)
    x2 = _rows(x)
    out2 = out.view(-1, half)
    if x2.shape[0] == 0 or half == 0:
        return out
    block = min(next_pow2(half), 2048)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(half, block))](
        x2, out2, x2.stride(0), out2.stride(0), HALF=half, BLOCK=block
    )
    return out
