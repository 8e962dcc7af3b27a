"""Public weight-only quantized linears (int8, int4, fp8) and their (de)quantizers.

The linears keep activations in x's dtype and accumulate in fp32; only the weight is stored
quantized, as in GPTQ / AWQ (int4 per group), int8 per output channel and FP8 checkpoints.
The quantizers, dequantizers and int4 packing are plain torch on any device.
"""

from __future__ import annotations

import torch

from radixlm.kernels import _checks, reference
from radixlm.kernels._backend import use_triton

INT4_GROUP_SIZES = (32, 64, 128)


def _fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def _dtype(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, shape: str) -> None:
    if t.dtype != dtype:
        _fail(op, f"{name} must be {dtype} {shape}, got {t.dtype}")


def _shape(op: str, name: str, t: torch.Tensor, want: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != want:
        listed = ", ".join(str(d) for d in want)
        _fail(op, f"{name} must have shape {what} = [{listed}], got {tuple(t.shape)}")


def _x_width(op: str, x: torch.Tensor, k: int, source: str) -> None:
    _checks.floating(op, "x", x)
    if x.dim() < 1 or x.shape[-1] != k:
        _fail(op, f"x must have shape [..., K] with K = {k} ({source}), got {tuple(x.shape)}")


def _bias(op: str, bias: torch.Tensor | None, n: int) -> None:
    if bias is not None:
        _checks.floating(op, "bias", bias)
        _shape(op, "bias", bias, (n,), "[N]")


def _group_size(op: str, group_size: int, k: int, source: str) -> None:
    if group_size not in INT4_GROUP_SIZES:
        _fail(op, f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    if k % group_size != 0:
        _fail(op, f"K = {k} ({source}) must be a multiple of group_size = {group_size}")


def _int8_weight(op: str, weight: torch.Tensor, scale: torch.Tensor) -> None:
    _checks.rank(op, "weight", weight, 2, "[N, K]")
    _dtype(op, "weight", weight, torch.int8, "[N, K]")
    _checks.floating(op, "scale", scale)
    _shape(op, "scale", scale, (weight.shape[0],), "[N]")


def _int4_weight(
    op: str, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> None:
    _checks.rank(op, "qweight", qweight, 2, "[N, K // 2]")
    _dtype(op, "qweight", qweight, torch.uint8, "[N, K // 2] (two 4-bit codes per byte)")
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    _group_size(op, group_size, k, "2 * qweight.shape[1]")
    _checks.floating(op, "scales", scales)
    _shape(op, "scales", scales, (n, k // group_size), "[N, K // group_size]")
    if zeros.shape != scales.shape or zeros.dtype != scales.dtype:
        _fail(
            op,
            f"zeros must match scales (shape {tuple(scales.shape)}, {scales.dtype}), got "
            f"shape {tuple(zeros.shape)}, {zeros.dtype}",
        )


def _fp8_weight(op: str, weight: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    _checks.rank(op, "weight", weight, 2, "[N, K]")
    _dtype(op, "weight", weight, torch.float8_e4m3fn, "[N, K]")
    _checks.floating(op, name, scale)
    n = weight.shape[0]
    if tuple(scale.shape) not in ((), (1,), (n,)):
        _fail(
            op,
            f"{name} must have shape [] or [1] (per tensor) or [N] = [{n}] (per output "
            f"channel), got {tuple(scale.shape)}",
        )


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T (+ bias)`` with an int8 weight, per output channel.

    Weight-only: x is not quantized. The Triton kernel converts each int8 weight tile to x's
    dtype in registers (exactly) and applies ``scale`` to the fp32 accumulator.

    Args:
        x: ``[..., K]`` float32 / float16 / bfloat16.
        weight: ``[N, K]`` torch.int8 (from :func:`quantize_int8` or a checkpoint).
        scale: ``[N]`` float (float32 as :func:`quantize_int8` returns; read in fp32).
        bias: ``[N]`` float, or None.

    Returns:
        A new ``[..., N]`` tensor in x's dtype, accumulated in fp32.
    """
    op = "int8_linear"
    _int8_weight(op, weight, scale)
    _x_width(op, x, weight.shape[1], "weight.shape[1]")
    _bias(op, bias, weight.shape[0])
    _checks.same_device(op, {"x": x, "weight": weight, "scale": scale, "bias": bias})
    if use_triton(x):
        from radixlm.kernels import triton_ops

        return triton_ops.int8_linear(x, weight, scale, bias)
    return reference.int8_linear(x, weight, scale, bias)


def _int8_grouped_weight(
    op: str, weight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> None:
    _checks.rank(op, "weight", weight, 2, "[N, K]")
    _dtype(op, "weight", weight, torch.int8, "[N, K]")
    _group_size(op, group_size, weight.shape[1], "weight.shape[1]")
    _checks.floating(op, "scales", scales)
    _shape(
        op,
        "scales",
        scales,
        (weight.shape[0], weight.shape[1] // group_size),
        "[N, K // group_size]",
    )


def int8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` with an int8 weight scaled per group of ``group_size`` along K:
    ``w[n, k] = weight[n, k] * scales[n, k // group_size]`` (llama.cpp's Q8_0 at 32).

    Weight-only: x is not quantized. The Triton kernel scales each weight tile in registers
    (a K tile lies inside one group) and accumulates in fp32.

    Args:
        x: ``[..., K]`` float32 / float16 / bfloat16.
        weight: ``[N, K]`` torch.int8.
        scales: ``[N, K // group_size]`` float.
        group_size: 32, 64 or 128; K must be a multiple of it.
        bias: ``[N]`` float, or None.

    Returns:
        A new ``[..., N]`` tensor in x's dtype, accumulated in fp32.
    """
    op = "int8_grouped_linear"
    _int8_grouped_weight(op, weight, scales, group_size)
    _x_width(op, x, weight.shape[1], "weight.shape[1]")
    _bias(op, bias, weight.shape[0])
    _checks.same_device(op, {"x": x, "weight": weight, "scales": scales, "bias": bias})
    if use_triton(x):
        from radixlm.kernels import triton_ops

        return triton_ops.int8_grouped_linear(x, weight, scales, group_size, bias)
    return reference.int8_grouped_linear(x, weight, scales, group_size, bias)


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` with a 4-bit weight quantized per group of ``group_size`` along K:
    ``w[n, k] = (q[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]``.

    Weight-only: x is not quantized. The Triton kernel unpacks and dequantizes each weight
    tile in registers (fp32, then x's dtype for the dot) and accumulates in fp32.

    Args:
        x: ``[..., K]`` float32 / float16 / bfloat16.
        qweight: ``[N, K // 2]`` torch.uint8, two codes 0..15 per byte: the low nibble holds
            column ``2j``, the high nibble column ``2j + 1`` (see :func:`pack_int4`).
        scales, zeros: ``[N, K // group_size]``, one float dtype for both. Zeros are in
            quantized units and may be fractional (GPTQ's / AWQ's integer zeros, or 8 for a
            symmetric quantization, all fit).
        group_size: 32, 64 or 128; K must be a multiple of it.
        bias: ``[N]`` float, or None.

    Returns:
        A new ``[..., N]`` tensor in x's dtype, accumulated in fp32.
    """
    op = "int4_linear"
    _int4_weight(op, qweight, scales, zeros, group_size)
    _x_width(op, x, 2 * qweight.shape[1], "2 * qweight.shape[1]")
    _bias(op, bias, qweight.shape[0])
    _checks.same_device(
        op, {"x": x, "qweight": qweight, "scales": scales, "zeros": zeros, "bias": bias}
    )
    if use_triton(x):
        from radixlm.kernels import triton_ops

        return triton_ops.int4_linear(x, qweight, scales, zeros, group_size, bias)
    return reference.int4_linear(x, qweight, scales, zeros, group_size, bias)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ (weight * weight_scale).T (+ bias)`` with a float8_e4m3fn weight.

    Weight-only: x stays in its dtype (no activation scale). The Triton kernel converts each
    fp8 tile to x's dtype in registers (exactly) and applies the scale to the fp32 accumulator;
    on GPUs without fp8 in Triton (before compute capability 8.9, e.g. A100) it decodes the
    bytes itself, so the same call runs there too.

    Args:
        x: ``[..., K]`` float32 / float16 / bfloat16.
        weight: ``[N, K]`` torch.float8_e4m3fn.
        weight_scale: float, shape ``[]`` or ``[1]`` (per tensor) or ``[N]`` (per output
            channel); read in fp32.
        bias: ``[N]`` float, or None.

    Returns:
        A new ``[..., N]`` tensor in x's dtype, accumulated in fp32.
    """
    op = "fp8_linear"
    _fp8_weight(op, weight, weight_scale, "weight_scale")
    _x_width(op, x, weight.shape[1], "weight.shape[1]")
    _bias(op, bias, weight.shape[0])
    _checks.same_device(op, {"x": x, "weight": weight, "weight_scale": weight_scale, "bias": bias})
    if use_triton(x):
        from radixlm.kernels import triton_ops

        return triton_ops.fp8_linear(x, weight, weight_scale, bias)
    return reference.fp8_linear(x, weight, weight_scale, bias)


def _float_matrix(op: str, w: torch.Tensor) -> None:
    _checks.rank(op, "w", w, 2, "[N, K]")
    _checks.floating(op, "w", w)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel, round to nearest.

    Returns:
        ``(weight, scale)``: ``[N, K]`` int8 in -127..127 and ``[N]`` float32 with
        ``scale = absmax(row) / 127`` (1 for an all-zero row). Elementwise
        ``|w - weight * scale| <= scale / 2``.
    """
    _float_matrix("quantize_int8", w)
    return reference.quantize_int8(w)


def quantize_int4(
    w: torch.Tensor, group_size: int, symmetric: bool = False, fit: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit quantization per group of ``group_size`` columns, round to nearest.

    Fitted (``fit=True``, as llama.cpp's Q4_1 / Q4_K): the zero point is a float, the range is
    the group's own ``[min, max]`` (not widened to hold 0), and scale and offset are the
    least-squares fit of the codes over 21 code spreads, the one of least squared error kept
    (so it is never worse than plain min/max). Scales and zeros come back in float32 whatever
    w's dtype. A constant group gets code 0, zero -1 and its value as the scale.

    Asymmetric (default): the group's range ``[min(w, 0), max(w, 0)]`` (widened to hold 0, as
    GPTQ's) maps onto 0..15, ``scale = range / 15``, ``zero = round(-min / scale)``.
    Symmetric: ``zero = 8`` and ``scale = absmax / 7``, so codes span 1..15 (-7..7 around the
    zero) and no value is clipped. All-zero groups get scale 1.

    Scales and zeros come back in w's dtype, the scales rounded up to it, and the codes are
    computed from the stored scales, so ``|w - dequantize_int4(...)| <= scale / 2`` holds for
    what is returned.

    Returns:
        ``(qweight, scales, zeros)``: ``[N, K // 2]`` uint8 packed as :func:`pack_int4`, and
        two ``[N, K // group_size]`` tensors in w's dtype.
    """
    op = "quantize_int4"
    _float_matrix(op, w)
    _group_size(op, group_size, w.shape[1], "w.shape[1]")
    if fit and symmetric:
        _fail(op, "fit and symmetric exclude each other (a fitted zero point is a float)")
    return reference.quantize_int4(w, group_size, symmetric, fit)


def quantize_fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn with ``scale = absmax / 448`` per output channel or per tensor.

    Returns:
        ``(weight, scale)``: ``[N, K]`` float8_e4m3fn and float32 scale of shape ``[N]``
        (per channel) or ``[]`` (per tensor); 1 where the absmax is 0. The relative error of a
        normal e4m3 value is at most 2**-4; below 2**-6 (subnormals) the error is at most
        ``2**-10 * scale``.
    """
    _float_matrix("quantize_fp8", w)
    return reference.quantize_fp8(w, per_channel)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` uint8 codes in 0..15 -> ``[N, K // 2]`` uint8: column ``2j`` in the low
    nibble of byte ``j``, column ``2j + 1`` in the high nibble. K must be even."""
    op = "pack_int4"
    _checks.rank(op, "q", q, 2, "[N, K]")
    _dtype(op, "q", q, torch.uint8, "[N, K]")
    if q.shape[1] % 2 != 0:
        _fail(op, f"q must have an even number of columns K, got shape {tuple(q.shape)}")
    # Packing is offline work, so reading the values (a device sync) is affordable here.
    if q.numel() and int(q.max()) > 15:
        _fail(op, f"q must hold 4-bit codes 0..15, got a maximum of {int(q.max())}")
    return reference.pack_int4(q)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[N, K // 2]`` uint8 -> ``[N, K]`` uint8 codes 0..15 (inverse of :func:`pack_int4`)."""
    op = "unpack_int4"
    _checks.rank(op, "packed", packed, 2, "[N, K // 2]")
    _dtype(op, "packed", packed, torch.uint8, "[N, K // 2]")
    return reference.unpack_int4(packed)


def dequantize_int8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight.float() * scale[:, None]``: float32 ``[N, K]``."""
    op = "dequantize_int8"
    _int8_weight(op, weight, scale)
    _checks.same_device(op, {"weight": weight, "scale": scale})
    return reference.dequantize_int8(weight, scale)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``(q - zeros) * scales`` per group: float32 ``[N, K]`` (see :func:`int4_linear`)."""
    op = "dequantize_int4"
    _int4_weight(op, qweight, scales, zeros, group_size)
    _checks.same_device(op, {"qweight": qweight, "scales": scales, "zeros": zeros})
    return reference.dequantize_int4(qweight, scales, zeros, group_size)


def quantize_int8_grouped(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 per group of ``group_size`` columns (llama.cpp's Q8_0 at 32): ``scale =
    absmax(group) / 127`` (1 for an all-zero group), round to nearest.

    Returns:
        ``(weight, scales)``: ``[N, K]`` int8 in -127..127 and ``[N, K // group_size]``
        float32. Elementwise ``|w - weight * scale| <= scale / 2``.
    """
    op = "quantize_int8_grouped"
    _float_matrix(op, w)
    _group_size(op, group_size, w.shape[1], "w.shape[1]")
    return reference.quantize_int8_grouped(w, group_size)


def dequantize_int8_grouped(
    weight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``weight * scales`` per group: float32 ``[N, K]`` (see :func:`int8_grouped_linear`)."""
    op = "dequantize_int8_grouped"
    _int8_grouped_weight(op, weight, scales, group_size)
    _checks.same_device(op, {"weight": weight, "scales": scales})
    return reference.dequantize_int8_grouped(weight, scales, group_size)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight.float() * scale`` (per tensor or per output channel): float32 ``[N, K]``."""
    op = "dequantize_fp8"
    _fp8_weight(op, weight, scale, "scale")
    _checks.same_device(op, {"weight": weight, "scale": scale})
    return reference.dequantize_fp8(weight, scale)
