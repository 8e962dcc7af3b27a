"""How a quantized weight is multiplied, per device: a callable `[M, K] -> [M, N]` per layer.

On CUDA the Triton kernels of `radixlm.kernels` dequantize inside the GEMM. On x86 CPUs the
int8 formats run on fbgemm's int8 x int8 dynamic linear: `w8a8_int8` quantizes each row of
activations to 7 bits (per token, independent of the batch), and weight-only `int8` carries
activations to ~14 bits by sending each row's 7-bit part and its remainder as two rows of
one call; inputs of 128 rows or more (prefill) multiply a dequantized float copy instead.
Measured on a 2-core AVX2 EPYC, one thread, M=8 (decode), Qwen2.5-0.5B's gate/up projection
896 -> 9728: float32 8.6 ms, `int8` 3.2 ms, `w8a8_int8` 1.7 ms, torch's own weight-only
`_weight_int8pack_mm` 6.2 ms; the 151,936-row LM head: 105 / 43 / 20 / 88 ms. int4 runs on
torch's `_weight_int4pack_mm_for_cpu`, fast with bfloat16 activations only (0.68 ms against
1.1 ms float32 at M=1 for 896 -> 4864; 4-20x slower than float32 with float32 activations),
so activations are cast to bfloat16 for the product. Without fbgemm (non-x86 CPUs) int8 uses
`_weight_int8pack_mm` and w8a8_int8 `torch._int_mm`.

Every path is checked once against the torch reference at build time on a tiny input; a path
that cannot run (an op missing from this torch build, a shape it refuses) falls back to the
reference, which dequantizes at each call (correct, slow) and says so in the log.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from radixlm import kernels

logger = logging.getLogger("radixlm.runtime.quant")

Matmul = Callable[[torch.Tensor], torch.Tensor]


def _bf16_scale_ones(out_features: int, device: torch.device) -> torch.Tensor:
    return torch.ones(out_features, dtype=torch.bfloat16, device=device)


def int8_weight_only(qweight: torch.Tensor, scale: torch.Tensor) -> Matmul:
    """x @ (qweight * scale).T; activations stay unquantized (to within ~1e-4 of each row's
    largest value on CPU, see `_fbgemm_two_pass`), except decode rows on one intra-op CPU
    thread, which run radixlm's C kernel with activations rounded to int8 per 32 columns
    (llama.cpp's Q8_0 arithmetic; 2.5x fbgemm's two passes at one row)."""
    if qweight.device.type == "cuda":
        return lambda x: kernels.int8_linear(x, qweight, scale)
    general = _int8_weight_only_torch(qweight, scale)
    few_rows = _int8_c_kernel(qweight, scale)
    if few_rows is None:
        return general

    def c_or_torch(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= kernels.cpu.MAX_ROWS:
            return few_rows(x)
        return general(x)

    return c_or_torch


def _int8_c_kernel(qweight: torch.Tensor, scale: torch.Tensor) -> Matmul | None:
    """radixlm's C kernel for few rows, when it is built here, takes the shape and agrees
    with the torch reference; None otherwise."""
    if qweight.shape[1] % kernels.cpu.BLOCK or not kernels.cpu.available():
        return None
    weight = qweight.contiguous()
    scale32 = scale.to(torch.float32).contiguous()

    def few_rows(x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32).contiguous()
        return kernels.cpu.int8_linear(x32, weight, scale32).to(x.dtype)

    def reference(x: torch.Tensor) -> torch.Tensor:
        return kernels.reference.int8_linear(x, qweight, scale)

    return few_rows if _works(few_rows, reference, qweight, rtol=0.02) else None


#: The most rows `int8_grouped` runs through the C kernel (in calls of MAX_ROWS), beyond
#: which dequantizing the weight once costs less than reading it once per call.
_C_CHUNKED_ROWS = 64


def int8_grouped(values: torch.Tensor, scales: torch.Tensor, group_size: int) -> Matmul:
    """x @ (values * scales per group of columns).T (a GGUF file's Q8_0, the int8 LM head):
    Triton's `int8_grouped_linear` on CUDA. On the CPU decode rows run
    radixlm's C kernel (Q8_0 x Q8_0, llama.cpp's arithmetic; up to `_C_CHUNKED_ROWS` rows in
    calls of MAX_ROWS); other inputs the weight dequantized into their dtype at the call (for
    a prefill that is one more pass over the weight, which keeps it 8-bit in memory)."""
    if values.device.type == "cuda":
        return lambda x: kernels.int8_grouped_linear(x, values, scales, group_size)
    weight = values.contiguous()
    scales32 = scales.to(torch.float32).contiguous()

    def dense(x: torch.Tensor) -> torch.Tensor:
        full = kernels.dequantize_int8_grouped(weight, scales32, group_size).to(x.dtype)
        return torch.nn.functional.linear(x, full)

    if group_size % kernels.cpu.BLOCK or not kernels.cpu.available():
        return dense

    def few_rows(x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32).contiguous()
        return kernels.cpu.int8_linear(x32, weight, scales32).to(x.dtype)

    if not _works(few_rows, dense, weight):
        return dense

    def c_or_dense(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows > _C_CHUNKED_ROWS:
            return dense(x)
        if rows <= kernels.cpu.MAX_ROWS:
            return few_rows(x)
        step = kernels.cpu.MAX_ROWS  # a decode batch of a few calls still beats dequantizing
        return torch.cat([few_rows(x[i : i + step]) for i in range(0, rows, step)])

    return c_or_dense


def _int8_weight_only_torch(qweight: torch.Tensor, scale: torch.Tensor) -> Matmul:
    """fbgemm's two passes (or a dequantized copy for prefill), else torch's own kernel."""

    def reference(x: torch.Tensor) -> torch.Tensor:
        return kernels.reference.int8_linear(x, qweight, scale)

    two_pass = _fbgemm_two_pass(qweight, scale)
    if two_pass is not None and _works(two_pass, reference, qweight, rtol=2e-3):
        dense_ok = qweight.numel() <= _MAX_DEQUANTIZED_ELEMENTS

        def fbgemm_or_dense(x: torch.Tensor) -> torch.Tensor:
            if dense_ok and x.shape[0] >= _DENSE_ROWS:
                # Prefill-sized inputs: dequantizing costs N x K once per call, the float32
                # GEMM then runs at its full rate (faster than two int8 passes there).
                weight = kernels.dequantize_int8(qweight, scale).to(x.dtype)
                return torch.nn.functional.linear(x, weight)
            return two_pass(x)

        return fbgemm_or_dense
    op = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    if op is not None:
        ones = _bf16_scale_ones(qweight.shape[0], qweight.device)
        scale32 = scale.to(torch.float32)

        def packed(x: torch.Tensor) -> torch.Tensor:
            # Scales of one keep the bf16 output unscaled; the float32 scale is applied after,
            # so the per-channel scale is not rounded to bfloat16.
            out: torch.Tensor = op(x.to(torch.bfloat16).contiguous(), qweight, ones)
            return (out.to(torch.float32) * scale32).to(x.dtype)

        if _works(packed, reference, qweight):
            return packed
    return _reference("int8", lambda x: kernels.int8_linear(x, qweight, scale))


# Inputs of at least this many rows multiply a dequantized float copy of the weight (CPU int8),
# unless the weight is larger than this many elements (a large vocabulary's LM head).
_DENSE_ROWS = 128
_MAX_DEQUANTIZED_ELEMENTS = 1 << 26
# fbgemm's 7-bit activations over [-1, 1]: step 2 / 127; grid points -63..63 are exact
# whichever of the two nearest zero points it picks.
_STEP = 2.0 / 127.0


def _fbgemm_prepack(qweight: torch.Tensor, scale: torch.Tensor) -> Any | None:
    quantized = getattr(torch.ops, "quantized", None)
    if quantized is None or not hasattr(quantized, "linear_dynamic"):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            weight = torch._make_per_channel_quantized_tensor(
                qweight.contiguous(),
                scale.to(torch.float64),
                torch.zeros(qweight.shape[0], dtype=torch.int64),
                0,
            )
            return quantized.linear_prepack(weight, None)
    except (RuntimeError, NotImplementedError):
        return None


def _unit_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float32) with each row divided by its largest magnitude, and those magnitudes."""
    x32 = x.to(torch.float32)
    row_max = x32.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)
    return x32 / row_max, row_max


def _sentinel(in_features: int) -> torch.Tensor:
    """A row [1, -1, 0, ...]: with it, fbgemm's per-call range is exactly [-1, 1]."""
    sentinel = torch.zeros(1, in_features, dtype=torch.float32)
    sentinel[0, 0] = 1.0
    if in_features > 1:
        sentinel[0, 1] = -1.0
    return sentinel


def _fbgemm_two_pass(qweight: torch.Tensor, scale: torch.Tensor) -> Matmul | None:
    """Weight-only int8 through fbgemm's int8 x int8 GEMM, with activations split in two.

    Each row is divided by its largest magnitude; its 7-bit grid part `hi` and the rest
    (`x - hi`, again scaled to [-1, 1]) go through one fbgemm call as separate rows (rows are
    independent, see `_fbgemm_dynamic`), and the two results are added back: activations are
    carried to ~14 bits, an error of ~1e-4 of the row's largest value, at about twice the cost
    of w8a8_int8 (still 2-5x faster than float32 and than torch's weight-only int8 GEMM on an
    AVX2 CPU at decode batch sizes).
    """
    packed = _fbgemm_prepack(qweight, scale)
    if packed is None:
        return None
    sentinel = _sentinel(qweight.shape[1])
    linear_dynamic = torch.ops.quantized.linear_dynamic

    def two_pass(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        normed, row_max = _unit_rows(x)
        high = torch.round(normed / _STEP).clamp_(-63, 63).mul_(_STEP)
        rest = normed.sub_(high)
        rest, rest_max = _unit_rows(rest)
        stacked = torch.cat([high, rest, sentinel])
        out: torch.Tensor = linear_dynamic(stacked, packed, True)
        combined = out[:rows] + out[rows : 2 * rows] * rest_max
        return (combined * row_max).to(x.dtype)

    return two_pass


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
    packed = _fbgemm_prepack(qweight, scale)
    if packed is None:
        return None
    sentinel = _sentinel(qweight.shape[1])
    linear_dynamic = torch.ops.quantized.linear_dynamic

    def dynamic(x: torch.Tensor) -> torch.Tensor:
        normed, row_max = _unit_rows(x)
        scaled = torch.cat([normed, sentinel])
        out: torch.Tensor = linear_dynamic(scaled, packed, True)[:-1]
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
    fallback = _int4_torch_cpu(qweight, scales, zeros, group_size)
    few_rows = _int4_c_kernel(qweight, scales, zeros, group_size)
    if few_rows is None:
        return fallback

    def c_or_torch(x: torch.Tensor) -> torch.Tensor:
        # Decode-sized inputs: radixlm's C kernel (int8 activations per 32 columns, as
        # llama.cpp's 4-bit blocks; on one thread 1.2-1.9x torch's kernel at 1-16 rows);
        # prefill-sized ones: torch's kernel.
        if x.shape[0] <= kernels.cpu.MAX_ROWS:
            return few_rows(x)
        return fallback(x)

    return c_or_torch


def _int4_c_kernel(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> Matmul | None:
    """radixlm's AVX2 kernel for few rows (`radixlm.kernels.cpu`), when it is built here and
    agrees with the torch reference; None otherwise."""
    in_features = qweight.shape[1] * 2
    if group_size % kernels.cpu.BLOCK or in_features % group_size or not kernels.cpu.available():
        return None
    scale32 = scales.to(torch.float32).contiguous()
    zeros32 = zeros.to(torch.float32).contiguous()
    weight = qweight.contiguous()

    def few_rows(x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32).contiguous()
        return kernels.cpu.int4_linear(x32, weight, scale32, zeros32, group_size).to(x.dtype)

    def reference(x: torch.Tensor) -> torch.Tensor:
        return kernels.reference.int4_linear(x, qweight, scales, zeros, group_size)

    return few_rows if _works(few_rows, reference, qweight, rtol=0.03) else None


def _int4_torch_cpu(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> Matmul:
    """torch's own CPU int4 kernel (bfloat16 activations), else the reference."""
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
