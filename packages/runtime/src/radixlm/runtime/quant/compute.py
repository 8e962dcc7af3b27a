"""How a quantized weight is multiplied, per device: a callable `[M, K] -> [M, N]` per layer.

On CUDA the Triton kernels of `radixlm.kernels` dequantize inside the GEMM. On CPUs torch has
packed int8 / int4 GEMMs (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) that are fast
with bfloat16 activations only (measured on an AVX2 EPYC at a 896 x 4864 projection, one
thread: int8 0.42 ms and int4 0.68 ms at M=1 against 1.1 ms for float32 `F.linear`; with
float32 activations they run 4-20x slower than float32), so activations are cast to bfloat16
for the product and the result back. `w8a8_int8` quantizes activations per token as well and
multiplies int8 by int8: through fbgemm's dynamic linear on x86 CPUs (0.21 ms at M=1, 29 ms
against 43 ms at M=256) and `torch._int_mm` elsewhere.

Every path is checked once against the torch reference at build time on a tiny input; a path
that cannot run (an op missing from this torch build, a shape it refuses) falls back to the
reference, which dequantizes at each call (correct, slow) and says so in the log.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import torch

from radixlm import kernels

logger = logging.getLogger("radixlm.runtime.quant")

Matmul = Callable[[torch.Tensor], torch.Tensor]


def _bf16_scale_ones(out_features: int, device: torch.device) -> torch.Tensor:
    return torch.ones(out_features, dtype=torch.bfloat16, device=device)


def int8_weight_only(qweight: torch.Tensor, scale: torch.Tensor) -> Matmul:
    """x @ (qweight * scale).T; activations stay unquantized."""
    if qweight.device.type == "cuda":
        return lambda x: kernels.int8_linear(x, qweight, scale)
    op = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    if op is not None:
        ones = _bf16_scale_ones(qweight.shape[0], qweight.device)
        scale32 = scale.to(torch.float32)

        def packed(x: torch.Tensor) -> torch.Tensor:
            # Scales of one keep the bf16 output unscaled; the float32 scale is applied after,
            # so the per-channel scale is not rounded to bfloat16.
            out: torch.Tensor = op(x.to(torch.bfloat16).contiguous(), qweight, ones)
            return (out.to(torch.float32) * scale32).to(x.dtype)

        if _works(packed, lambda x: kernels.reference.int8_linear(x, qweight, scale), qweight):
            return packed
    return _reference("int8", lambda x: kernels.int8_linear(x, qweight, scale))


def w8a8_int8(qweight: torch.Tensor, scale: torch.Tensor) -> Matmul:
    """x quantized to int8 per token (row), times the int8 weight, in integer arithmetic."""
    if qweight.device.type == "cpu":
        fbgemm = _fbgemm_dynamic(qweight, scale)
        if fbgemm is not None:
            return fbgemm
    return _int_mm(qweight, scale)


def _fbgemm_dynamic(qweight: torch.Tensor, scale: torch.Tensor) -> Matmul | None:
    """fbgemm's dynamic int8 linear, made per-token and batch-invariant.

    fbgemm picks one activation scale per call from the whole input's min and max. Each row is
    first divided by its own absolute maximum, and a sentinel row [1, -1, 0, ...] is appended,
    so the range is [-1, 1] whatever the batch holds: each row's quantization (and so its
    result) does not depend on the other rows. fbgemm uses 7-bit activations (reduce_range)
    to keep its 16-bit pairwise sums from saturating.
    """
    quantized = getattr(torch.ops, "quantized", None)
    if quantized is None or not hasattr(quantized, "linear_dynamic"):
        return None
    out_features, in_features = qweight.shape
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            weight = torch._make_per_channel_quantized_tensor(
                qweight.contiguous(),
                scale.to(torch.float64),
                torch.zeros(out_features, dtype=torch.int64),
                0,
            )
            packed = quantized.linear_prepack(weight, None)
    except (RuntimeError, NotImplementedError):
        return None
    sentinel = torch.zeros(1, in_features, dtype=torch.float32)
    sentinel[0, 0] = 1.0
    if in_features > 1:
        sentinel[0, 1] = -1.0

    def dynamic(x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        row_max = x32.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)
        scaled = torch.cat([x32 / row_max, sentinel])
        out: torch.Tensor = quantized.linear_dynamic(scaled, packed, True)[:-1]
        return (out * row_max).to(x.dtype)

    def reference(x: torch.Tensor) -> torch.Tensor:
        return _w8a8_reference(x, qweight, scale)

    return dynamic if _works(dynamic, reference, qweight, rtol=0.05) else None


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x.to(torch.float32)
    row_scale = x32.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30) / 127.0
    return torch.round(x32 / row_scale).clamp_(-127, 127).to(torch.int8), row_scale


def _w8a8_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    xq, row_scale = _quantize_rows(x)
    acc = xq.to(torch.float32) @ qweight.to(torch.float32).t()
    return (acc * row_scale * scale.to(torch.float32)).to(x.dtype)


def _int_mm(qweight: torch.Tensor, scale: torch.Tensor) -> Matmul:
    """Per-token int8 activations times int8 weights through `torch._int_mm` (int32 sums)."""
    weight_t = qweight.t()
    scale32 = scale.to(torch.float32)
    # cuBLASLt's int8 GEMM needs more than 16 rows; short batches are padded with zero rows.
    min_rows = 17 if qweight.device.type == "cuda" else 1

    def int_mm(x: torch.Tensor) -> torch.Tensor:
        xq, row_scale = _quantize_rows(x)
        rows = xq.shape[0]
        if rows < min_rows:
            xq = torch.cat([xq, xq.new_zeros(min_rows - rows, xq.shape[1])])
        acc = torch._int_mm(xq, weight_t)[:rows]
        return (acc.to(torch.float32) * row_scale * scale32).to(x.dtype)

    if _works(int_mm, lambda x: _w8a8_reference(x, qweight, scale), qweight, rtol=1e-3):
        return int_mm
    return _reference("w8a8_int8", lambda x: _w8a8_reference(x, qweight, scale))


def int4_grouped(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> Matmul:
    """x @ dequant(qweight).T with int4 values in groups of `group_size` along the input."""
    if qweight.device.type == "cuda":
        return lambda x: kernels.int4_linear(x, qweight, scales, zeros, group_size)
    convert = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    op = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
    if convert is not None and op is not None:
        try:
            values = kernels.unpack_int4(qweight).to(torch.int32).contiguous()
            packed_weight = convert(values, 1)
        except RuntimeError:
            packed_weight = None
        if packed_weight is not None:
            # torch's layout dequantizes as (q - 8) * scale + zero; ours as (q - z) * scale.
            scale32, zeros32 = scales.to(torch.float32), zeros.to(torch.float32)
            scales_and_zeros = torch.stack([scale32.t(), ((8.0 - zeros32) * scale32).t()], dim=-1)
            scales_and_zeros = scales_and_zeros.to(torch.bfloat16).contiguous()

            def packed(x: torch.Tensor) -> torch.Tensor:
                x16 = x.to(torch.bfloat16).contiguous()
                out: torch.Tensor = op(x16, packed_weight, group_size, scales_and_zeros)
                return out.to(x.dtype)

            def reference(x: torch.Tensor) -> torch.Tensor:
                return kernels.reference.int4_linear(x, qweight, scales, zeros, group_size)

            if _works(packed, reference, qweight, rtol=0.03):
                return packed
    return _reference("int4", lambda x: kernels.int4_linear(x, qweight, scales, zeros, group_size))


def _works(
    candidate: Matmul,
    reference: Matmul,
    qweight: torch.Tensor,
    rtol: float = 0.02,
) -> bool:
    """Whether `candidate` runs here and agrees with `reference` on a small random input."""
    in_features = qweight.shape[1] * (2 if qweight.dtype == torch.uint8 else 1)
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, in_features, generator=generator).to(qweight.device)
    try:
        got = candidate(x).to(torch.float32)
    except (RuntimeError, NotImplementedError) as error:
        logger.debug("quantized matmul path unavailable: %s", error)
        return False
    want = reference(x).to(torch.float32)
    spread = want.abs().max().clamp_min(1e-6)
    return bool(((got - want).abs().max() / spread) <= rtol)


_warned: set[str] = set()


def _reference(kind: str, matmul: Matmul) -> Matmul:
    if kind not in _warned:
        _warned.add(kind)
        logger.warning(
            "no fast %s matmul on this device: the torch reference dequantizes the weight at "
            "every call (correct, but slower than the unquantized model)",
            kind,
        )
    return matmul
