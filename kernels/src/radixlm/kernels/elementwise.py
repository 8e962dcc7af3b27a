"""Public row-wise entry points: RMSNorm (+ residual), rotary embedding, SiLU-and-mul."""

from __future__ import annotations

import torch

from radixlm.kernels import _checks, reference
from radixlm.kernels._backend import use_triton


def _norm_args(op: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    _checks.floating(op, "x", x)
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{op}: weight must have shape [hidden] = [{x.shape[-1] if x.dim() else '?'}], "
            f"got {tuple(weight.shape)}"
        )
    if weight.stride(0) != 1:
        raise ValueError(f"{op}: weight must be contiguous")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2) + eps) * (weight + weight_offset)``.

    Args:
        x: ``[..., hidden]``, float32 / float16 / bfloat16.
        weight: ``[hidden]``, any float dtype.
        eps: added to the mean square.
        weight_offset: added to the weight (1.0 for Gemma's ``(1 + w)`` convention).

    Returns:
        A new tensor shaped and typed like ``x``; computed in fp32.
    """
    _norm_args("rms_norm", x, weight)
    _checks.same_device("rms_norm", {"x": x, "weight": weight})
    if use_triton(x):
        from radixlm.kernels import triton_ops

        return triton_ops.rms_norm(x, weight, eps, weight_offset=weight_offset)
    return reference.rms_norm(x, weight, eps, weight_offset=weight_offset)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm in one pass: ``s = x + residual``; ``(rms_norm(s), s)``.

    Args:
        x, residual: ``[..., hidden]``, same shape and dtype.
        weight, eps, weight_offset: as in :func:`rms_norm`.

    Returns:
        ``(normed, new_residual)``: two new tensors shaped and typed like ``x``. ``new_residual``
        is ``x + residual`` rounded to x's dtype, and the norm is taken of that rounded sum,
        exactly as an unfused add followed by :func:`rms_norm`.
    """
    op = "fused_add_rms_norm"
    _norm_args(op, x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"{op}: residual must match x (shape {tuple(x.shape)}, {x.dtype}), got "
            f"shape {tuple(residual.shape)}, {residual.dtype}"
        )
    _checks.same_device(op, {"x": x, "residual": residual, "weight": weight})
    if use_triton(x):
        from radixlm.kernels import triton_ops

        return triton_ops.fused_add_rms_norm(x, residual, weight, eps, weight_offset=weight_offset)
    return reference.fused_add_rms_norm(x, residual, weight, eps, weight_offset=weight_offset)


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of queries and keys from precomputed cos/sin tables.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``.
        k: ``[num_tokens, num_kv_heads, head_dim]`` (same head_dim as q).
        cos, sin: ``[max_position, rotary_dim // 2]`` (fp32 recommended); row ``p`` holds
            ``cos(p * inv_freq)``. Rope-scaling variants (linear, NTK, YaRN, Llama-3) are
            applied when building these tables. ``rotary_dim <= head_dim``: dimensions past
            ``rotary_dim`` pass through unchanged (partial rotary).
        positions: ``[num_tokens]`` int, each token's position (row of cos/sin).
        neox_style: True for the NeoX / Llama layout (rotate the two halves of the rotary
            part), False for the GPT-J layout (rotate interleaved pairs ``(2i, 2i+1)``).

    Returns:
        ``(q_rotated, k_rotated)``: new tensors shaped and typed like ``q`` and ``k``.
    """
    op = "rotary_embedding"
    _checks.rank(op, "q", q, 3, "[num_tokens, num_heads, head_dim]")
    _checks.rank(op, "k", k, 3, "[num_tokens, num_kv_heads, head_dim]")
    _checks.floating(op, "q", q)
    _checks.floating(op, "k", k)
    _checks.rank(op, "cos", cos, 2, "[max_position, rotary_dim // 2]")
    if sin.shape != cos.shape:
        raise ValueError(f"{op}: sin shape {tuple(sin.shape)} != cos shape {tuple(cos.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"{op}: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on tokens or head_dim"
        )
    if 2 * cos.shape[1] > q.shape[2] or cos.shape[1] == 0:
        raise ValueError(
            f"{op}: rotary_dim = 2 * cos.shape[1] = {2 * cos.shape[1]} must be in (0, head_dim={q.shape[2]}]"
        )
    _checks.integer(op, "positions", positions)
    _checks.length(op, "positions", positions, q.shape[0], "num_tokens")
    _checks.same_device(op, {"q": q, "k": k, "cos": cos, "sin": sin, "positions": positions})
    if use_triton(q):
        from radixlm.kernels import triton_ops

        return triton_ops.rotary_embedding(q, k, cos, sin, positions, neox_style=neox_style)
    return reference.rotary_embedding(q, k, cos, sin, positions, neox_style=neox_style)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gated-MLP activation: ``silu(x[..., :d]) * x[..., d:]`` for ``x`` of shape ``[..., 2d]``.

    Returns:
        A new ``[..., d]`` tensor in x's dtype; computed in fp32.
    """
    op = "silu_and_mul"
    _checks.floating(op, "x", x)
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"{op}: the last dimension of x must be even, got shape {tuple(x.shape)}")
    if use_triton(x):
        from radixlm.kernels import triton_ops

        return triton_ops.silu_and_mul(x)
    return reference.silu_and_mul(x)
