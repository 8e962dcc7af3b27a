"""Torch references for RMSNorm, rotary embedding and SiLU-and-mul."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.rms_norm`."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * (weight.float() + weight_offset)).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`radixlm.kernels.fused_add_rms_norm`."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(summed, weight, eps, weight_offset=weight_offset), summed


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox_style: bool
) -> torch.Tensor:
    rot = 2 * cos.shape[-1]
    xf = x.float()
    rotary, rest = xf[..., :rot], xf[..., rot:]
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    if neox_style:
        x1, x2 = rotary[..., : rot // 2], rotary[..., rot // 2 :]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rotary[..., 0::2], rotary[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, rest), dim=-1).to(x.dtype)


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`radixlm.kernels.rotary_embedding`."""
    index = positions.long()
    cos_t, sin_t = cos[index].float(), sin[index].float()
    return _rotate(q, cos_t, sin_t, neox_style), _rotate(k, cos_t, sin_t, neox_style)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.silu_and_mul`."""
    half = x.shape[-1] // 2
    gate, up = x[..., :half].float(), x[..., half:].float()
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
