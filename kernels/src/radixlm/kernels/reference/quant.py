"""Torch references for weight-only quantized linears, and the (de)quantizers and int4 packing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_MAX = 127
INT4_MAX = 15
INT4_SYMMETRIC_ZERO = 8
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.pack_int4`: column ``2j`` in the low nibble of byte
    ``j``, column ``2j + 1`` in its high nibble."""
    low = q[:, 0::2].to(torch.uint8)
    high = q[:, 1::2].to(torch.uint8)
    return low | (high << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.unpack_int4`."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])


def dequantize_int8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.dequantize_int8`."""
    return weight.float() * scale.float()[:, None]


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.dequantize_int4`."""
    q = unpack_int4(qweight).float()
    s = scales.float().repeat_interleave(group_size, dim=1)
    z = zeros.float().repeat_interleave(group_size, dim=1)
    return (q - z) * s


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.dequantize_fp8`."""
    s = scale.float()
    if s.numel() == 1:
        return weight.float() * s.reshape(())
    return weight.float() * s[:, None]


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.int8_linear`."""
    return _linear(x, dequantize_int8(weight, scale), bias)


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.int4_linear`."""
    return _linear(x, dequantize_int4(qweight, scales, zeros, group_size), bias)


def dequantize_int8_grouped(
    weight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.dequantize_int8_grouped`."""
    return weight.float() * scales.float().repeat_interleave(group_size, dim=1)


def int8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.int8_grouped_linear`."""
    return _linear(x, dequantize_int8_grouped(weight, scales, group_size), bias)


def quantize_int8_grouped(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`radixlm.kernels.quantize_int8_grouped`."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    scales = _safe_scale(groups.abs().amax(dim=2) / INT8_MAX)
    q = torch.round(groups / scales[:, :, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.reshape(n, k), scales


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.fp8_linear`."""
    return _linear(x, dequantize_fp8(weight, weight_scale), bias)


def _safe_scale(scale: torch.Tensor) -> torch.Tensor:
    # An all-zero row or group quantizes to zeros whatever the scale; 1 keeps it finite.
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`radixlm.kernels.quantize_int8`."""
    wf = w.float()
    scale = _safe_scale(wf.abs().amax(dim=1) / INT8_MAX)
    q = torch.round(wf / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def _round_up_to(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` in ``dtype``, rounded up rather than to nearest, so that codes computed from
    the stored scale never need clipping."""
    stored = scale.to(dtype)
    up = torch.nextafter(stored, torch.full_like(stored, float("inf")))
    return torch.where(stored.float() < scale, up, stored)


#: The code ranges tried per group by the fitted int4 quantizer: 15 + d for each d, spread
#: over the group's [min, max] before the least-squares fit (as llama.cpp's Q4_K search).
_FIT_STEPS = tuple(-1.0 + 0.1 * i for i in range(21))


def _fit_int4(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group of `groups` [n, g, G] (float32): codes, scale and float offset m with
    x ~ scale * code + m, the least-squares fit over several code spreads, the best kept."""
    low, high = groups.amin(dim=2, keepdim=True), groups.amax(dim=2, keepdim=True)
    spread = (high - low).clamp_min(1e-30)
    size = groups.shape[2]
    best_err = torch.full(low.shape, float("inf"))
    best_s, best_m = spread / INT4_MAX, low.clone()
    for step in _FIT_STEPS:
        codes = torch.round((groups - low) * ((INT4_MAX + step) / spread)).clamp_(0, INT4_MAX)
        sum_c, sum_cc = codes.sum(2, keepdim=True), (codes * codes).sum(2, keepdim=True)
        sum_x, sum_cx = groups.sum(2, keepdim=True), (codes * groups).sum(2, keepdim=True)
        det = size * sum_cc - sum_c * sum_c
        ok = det > 0
        safe = torch.where(ok, det, torch.ones_like(det))
        scale = torch.where(ok, (size * sum_cx - sum_c * sum_x) / safe, best_s)
        offset = torch.where(ok, (sum_cc * sum_x - sum_c * sum_cx) / safe, best_m)
        ok &= scale > 0
        scale, offset = torch.where(ok, scale, spread / INT4_MAX), torch.where(ok, offset, low)
        codes = torch.round((groups - offset) / scale).clamp_(0, INT4_MAX)
        err = ((codes * scale + offset - groups) ** 2).sum(2, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_m = torch.where(better, scale, best_s), torch.where(better, offset, best_m)
    return best_s.squeeze(2), best_m.squeeze(2), (high == low).squeeze(2)


def quantize_int4(
    w: torch.Tensor, group_size: int, symmetric: bool = False, fit: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of :func:`radixlm.kernels.quantize_int4`."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    if fit:
        scale, offset, constant = _fit_int4(groups)
        # A constant group: code 0 with zero -1 and the value as its scale.
        scales = torch.where(constant, offset, scale)
        zeros = torch.where(constant, -1.0, -offset / scale)
        s, z = scales[:, :, None], zeros[:, :, None]
        q = torch.round(groups / s + z).clamp(0, INT4_MAX)
        q = torch.where(constant[:, :, None], torch.zeros_like(q), q)
        return pack_int4(q.to(torch.uint8).reshape(n, k)), scales, zeros
    if symmetric:
        absmax = groups.abs().amax(dim=2)
        scales = _round_up_to(_safe_scale(absmax / (INT4_MAX - INT4_SYMMETRIC_ZERO)), w.dtype)
        zeros = torch.full_like(scales, INT4_SYMMETRIC_ZERO)
    else:
        # The range always holds 0 (as GPTQ's), so the zero point is a code in 0..15.
        low = groups.amin(dim=2).clamp(max=0.0)
        high = groups.amax(dim=2).clamp(min=0.0)
        scales = _round_up_to(_safe_scale((high - low) / INT4_MAX), w.dtype)
        zeros = torch.round(-low / scales.float()).clamp(0, INT4_MAX).to(w.dtype)
    s, z = scales.float()[:, :, None], zeros.float()[:, :, None]
    q = torch.round(groups / s + z).clamp(0, INT4_MAX).to(torch.uint8).reshape(n, k)
    return pack_int4(q), scales, zeros


def quantize_fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`radixlm.kernels.quantize_fp8`."""
    wf = w.float()
    if per_channel:
        scale = _safe_scale(wf.abs().amax(dim=1) / FP8_MAX)
        scaled = wf / scale[:, None]
    else:
        scale = _safe_scale(wf.abs().amax() / FP8_MAX)
        scaled = wf / scale
    # float8_e4m3fn has no infinity: a value past 448 would become NaN, so clamp first.
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale
