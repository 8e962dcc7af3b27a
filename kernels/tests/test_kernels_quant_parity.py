"""Quantized linears: the references against dequantize-then-F.linear written out here, the
quantizers' error bounds, int4 packing, the Triton kernels against the references (in the
interpreter on CPU; at serving shapes on a GPU), and the argument checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from kernels_test_helpers import TOLERANCES

import radixlm.kernels as rk

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
needs_triton = pytest.mark.usefixtures("needs_triton")

# (x's leading dims, N, K): M = 1, a 3-D x, odd N, N = 1, K not a multiple of any tile.
LINEAR_SHAPES = [((1,), 7, 64), ((3, 5), 33, 128), ((9,), 1, 256)]
INT8_FP8_SHAPES = [*LINEAR_SHAPES, ((4,), 20, 100)]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[want.dtype])


def _x(
    lead: tuple[int, ...], k: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    return torch.randn(*lead, k).to(device=device, dtype=dtype)


def _bias(n: int, with_bias: bool, device: torch.device | str = "cpu") -> torch.Tensor | None:
    return torch.randn(n, device=device) if with_bias else None


def _oracle(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear in float64 with an explicitly dequantized weight, rounded to x's dtype."""
    b = None if bias is None else bias.double()
    return F.linear(x.double(), w.double(), b).to(x.dtype)


def _int4_by_hand(
    n: int, k: int, group_size: int, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes packed with arithmetic (not bit operations) and their dequantized weight."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    packed = (codes[:, 0::2].int() + 16 * codes[:, 1::2].int()).to(torch.uint8)
    groups = k // group_size
    scales = ((torch.rand(n, groups) + 0.5) / (8 * k**0.5)).to(scale_dtype)
    zeros = torch.randint(0, 16, (n, groups)).to(scale_dtype)
    column_group = torch.arange(k) // group_size
    w = (codes.double() - zeros.double()[:, column_group]) * scales.double()[:, column_group]
    return packed, scales, zeros, w


# --- references against dequantize-then-F.linear -------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("lead", "n", "k"), INT8_FP8_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_reference_is_f_linear_with_the_dequantized_weight(
    dtype: torch.dtype, lead: tuple[int, ...], n: int, k: int, with_bias: bool
) -> None:
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = (torch.rand(n) + 0.5) / (127 * k**0.5)
    x, bias = _x(lead, k, dtype), _bias(n, with_bias)
    want = _oracle(x, codes.double() * scale.double()[:, None], bias)
    _close(rk.reference.int8_linear(x, codes, scale, bias), want)
    _close(rk.int8_linear(x, codes, scale, bias), want)  # CPU tensors: the reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("lead", "n", "k"), LINEAR_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_reference_is_f_linear_with_the_dequantized_weight(
    dtype: torch.dtype, lead: tuple[int, ...], n: int, k: int, with_bias: bool
) -> None:
    packed, scales, zeros, w = _int4_by_hand(n, k, 32)
    x, bias = _x(lead, k, dtype), _bias(n, with_bias)
    _close(rk.int4_linear(x, packed, scales, zeros, 32, bias), _oracle(x, w, bias))


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", DTYPES)
def test_int4_reference_reads_each_group_size_and_scale_dtype(
    group_size: int, scale_dtype: torch.dtype
) -> None:
    packed, scales, zeros, w = _int4_by_hand(12, 256, group_size, scale_dtype)
    x = _x((5,), 256, torch.float32)
    _close(rk.int4_linear(x, packed, scales, zeros, group_size), _oracle(x, w, None))


def test_int4_reference_accepts_fractional_zeros() -> None:
    packed, scales, _, _ = _int4_by_hand(6, 64, 32)
    zeros = torch.rand(6, 2) * 15
    codes = torch.stack((packed % 16, packed // 16), dim=-1).reshape(6, 64).double()
    w = (codes - zeros.double().repeat_interleave(32, 1)) * scales.double().repeat_interleave(32, 1)
    x = _x((3,), 64, torch.float32)
    _close(rk.int4_linear(x, packed, scales, zeros, 32), _oracle(x, w, None))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("lead", "n", "k"), INT8_FP8_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("scale_shape", ["[]", "[1]", "[N]"])
def test_fp8_reference_is_f_linear_with_the_dequantized_weight(
    dtype: torch.dtype,
    lead: tuple[int, ...],
    n: int,
    k: int,
    with_bias: bool,
    scale_shape: str,
) -> None:
    weight = (torch.randn(n, k) * 100).to(torch.float8_e4m3fn)
    scale = {"[]": torch.tensor(0.01 / k**0.5), "[1]": torch.tensor([0.02 / k**0.5])}.get(
        scale_shape, (torch.rand(n) + 0.5) / (100 * k**0.5)
    )
    x, bias = _x(lead, k, dtype), _bias(n, with_bias)
    w = weight.double() * (scale.double() if scale.numel() == 1 else scale.double()[:, None])
    _close(rk.fp8_linear(x, weight, scale, bias), _oracle(x, w, bias))


def test_dequantizers_return_float32_weights() -> None:
    packed, scales, zeros, w4 = _int4_by_hand(4, 64, 32, torch.bfloat16)
    assert rk.dequantize_int4(packed, scales, zeros, 32).dtype == torch.float32
    torch.testing.assert_close(rk.dequantize_int4(packed, scales, zeros, 32).double(), w4)
    codes = torch.randint(-127, 128, (4, 8), dtype=torch.int8)
    scale = torch.rand(4)
    torch.testing.assert_close(rk.dequantize_int8(codes, scale), codes.float() * scale[:, None])
    fp8 = torch.randn(4, 8).to(torch.float8_e4m3fn)
    assert rk.dequantize_fp8(fp8, torch.tensor(2.0)).dtype == torch.float32
    torch.testing.assert_close(rk.dequantize_fp8(fp8, scale), fp8.float() * scale[:, None])


def test_linears_of_an_empty_batch_are_empty() -> None:
    q, s = rk.quantize_int8(torch.randn(5, 64))
    assert rk.int8_linear(torch.randn(0, 64), q, s).shape == (0, 5)
    assert rk.int8_linear(torch.randn(2, 0, 64), q, s).shape == (2, 0, 5)


# --- quantizers, packing ---------------------------------------------------------------------


def _rows_of_mixed_scale(n: int, k: int) -> torch.Tensor:
    w = torch.randn(n, k) * torch.logspace(-3, 1, n)[:, None]
    w[0] = 0.0  # an all-zero row
    w[1, 3] = 50.0  # an outlier
    return w


def test_quantize_int8_is_within_half_a_step_per_channel() -> None:
    w = _rows_of_mixed_scale(6, 96)
    q, scale = rk.quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (6,)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    error = (w - rk.dequantize_int8(q, scale)).abs()
    assert (error <= scale[:, None] / 2 * (1 + 1e-5)).all()
    assert (q.abs() <= 127).all() and (q[1:].abs().amax(dim=1) == 127).all()
    assert (q[0] == 0).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_int4_is_within_half_a_step_per_group(
    group_size: int, symmetric: bool, dtype: torch.dtype
) -> None:
    w = _rows_of_mixed_scale(5, 256).to(dtype)
    w[2] = w[2].abs() + 0.1  # a row of positive values only: zero point 0
    qweight, scales, zeros = rk.quantize_int4(w, group_size, symmetric=symmetric)
    groups = 256 // group_size
    assert qweight.dtype == torch.uint8 and qweight.shape == (5, 128)
    assert scales.dtype == zeros.dtype == dtype and scales.shape == zeros.shape == (5, groups)
    assert torch.isfinite(scales).all() and (scales > 0).all()
    assert torch.equal(zeros, zeros.round()) and (zeros >= 0).all() and (zeros <= 15).all()
    if symmetric:
        assert (zeros == 8).all() and (rk.unpack_int4(qweight) >= 1).all()
    step = scales.float().repeat_interleave(group_size, dim=1)
    error = (w.float() - rk.dequantize_int4(qweight, scales, zeros, group_size)).abs()
    assert (error <= step / 2 * (1 + 1e-5)).all()
    assert (rk.dequantize_int4(qweight, scales, zeros, group_size)[0] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fitted_int4_has_less_squared_error_than_the_range_holding_zero(
    dtype: torch.dtype,
) -> None:
    w = _rows_of_mixed_scale(6, 256).to(dtype)
    plain = rk.dequantize_int4(*rk.quantize_int4(w, 32), 32)
    qweight, scales, zeros = rk.quantize_int4(w, 32, fit=True)
    assert scales.dtype == zeros.dtype == torch.float32
    fitted = rk.dequantize_int4(qweight, scales, zeros, 32)
    error = lambda d: float(((d - w.float()) ** 2).sum())  # noqa: E731
    assert error(fitted) < error(plain)


def test_fitted_int4_reproduces_values_already_on_a_4bit_grid() -> None:
    # Each group holds 16 evenly spaced levels between its own min and max (as Q4_1 blocks).
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4, 128), generator=generator).float()
    codes[:, ::32], codes[:, 1::32] = 0, 15  # every group spans the whole grid
    low = torch.randn(4, 4, generator=generator).repeat_interleave(32, dim=1)
    step = torch.rand(4, 4, generator=generator).add(0.01).repeat_interleave(32, dim=1)
    w = low + codes * step
    got = rk.dequantize_int4(*rk.quantize_int4(w, 32, fit=True), 32)
    assert torch.allclose(got, w, atol=1e-5)


def test_fitted_int4_keeps_constant_groups() -> None:
    w = torch.zeros(3, 64)
    w[1, :32] = 2.5
    got = rk.dequantize_int4(*rk.quantize_int4(w, 32, fit=True), 32)
    assert torch.equal(got, w)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantize_int8_grouped_is_within_half_a_step_per_group(group_size: int) -> None:
    w = _rows_of_mixed_scale(5, 256)
    weight, scales = rk.quantize_int8_grouped(w, group_size)
    assert weight.dtype == torch.int8 and scales.shape == (5, 256 // group_size)
    step = scales.repeat_interleave(group_size, dim=1)
    error = (w - rk.dequantize_int8_grouped(weight, scales, group_size)).abs()
    assert (error <= step / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_grouped_reference_is_f_linear_with_the_dequantized_weight(
    dtype: torch.dtype,
) -> None:
    weight = torch.randint(-127, 128, (9, 96), dtype=torch.int8)
    scales = torch.rand(9, 3) * 0.01
    w = weight.double() * scales.double().repeat_interleave(32, dim=1)
    x, bias = _x((2, 3), 96, dtype), _bias(9, True)
    _close(rk.int8_grouped_linear(x, weight, scales, 32, bias), _oracle(x, w, bias))


@pytest.mark.parametrize("per_channel", [False, True])
def test_quantize_fp8_is_within_e4m3_rounding(per_channel: bool) -> None:
    w = _rows_of_mixed_scale(6, 80)
    weight, scale = rk.quantize_fp8(w, per_channel=per_channel)
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == ((6,) if per_channel else ())
    deq = rk.dequantize_fp8(weight, scale)
    assert torch.isfinite(deq).all()
    step = scale[:, None] if per_channel else scale
    # 3 mantissa bits: half an ulp is 2**-4 relative; subnormals step by 2**-9 (times scale).
    bound = torch.maximum(w.abs() * 2**-4, 2**-10 * step * torch.ones_like(w))
    assert ((w - deq).abs() <= bound * (1 + 1e-5)).all()
    assert deq.abs().amax() == pytest.approx(w.abs().amax().item(), rel=1e-6)


def test_pack_int4_puts_even_columns_in_the_low_nibble() -> None:
    q = torch.tensor([[1, 2, 15, 0], [0, 15, 7, 8]], dtype=torch.uint8)
    assert rk.pack_int4(q).tolist() == [[0x21, 0x0F], [0xF0, 0x87]]


def test_unpack_int4_inverts_pack_int4() -> None:
    q = torch.randint(0, 16, (7, 66), dtype=torch.uint8)
    packed = rk.pack_int4(q)
    assert packed.shape == (7, 33) and packed.dtype == torch.uint8
    assert torch.equal(rk.unpack_int4(packed), q)
    every_byte = torch.arange(256, dtype=torch.uint8)[None, :]
    assert torch.equal(rk.pack_int4(rk.unpack_int4(every_byte)), every_byte)


def test_quantize_then_linear_is_close_to_the_float_linear() -> None:
    w = torch.randn(64, 256) / 16
    x = torch.randn(4, 256)
    exact = F.linear(x, w)
    q8 = rk.int8_linear(x, *rk.quantize_int8(w))
    q4 = rk.int4_linear(x, *rk.quantize_int4(w, 64), 64)
    f8 = rk.fp8_linear(x, *rk.quantize_fp8(w, per_channel=True))
    for got, rel in ((q8, 0.02), (q4, 0.2), (f8, 0.1)):
        assert (got - exact).norm() / exact.norm() < rel


# --- Triton against the references -----------------------------------------------------------


def both_backends(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    with rk.use_backend("triton"):
        got = fn(*args, **kwargs)
    with rk.use_backend("reference"):
        want = fn(*args, **kwargs)
    return got, want


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("lead", "n", "k", "with_bias"), [((1,), 33, 100, True), ((2, 3), 48, 128, False), ((40,), 70, 64, True)])  # fmt: skip
def test_int8_triton_matches_reference(
    device: torch.device,
    dtype: torch.dtype,
    lead: tuple[int, ...],
    n: int,
    k: int,
    with_bias: bool,
) -> None:
    q, scale = rk.quantize_int8(torch.randn(n, k, device=device) / k**0.5)
    x, bias = _x(lead, k, dtype, device), _bias(n, with_bias, device)
    _close(*both_backends(rk.int8_linear, x, q, scale, bias))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_triton_matches_reference(
    device: torch.device, dtype: torch.dtype, group_size: int, symmetric: bool
) -> None:
    n, k = 35, 256
    qweight, scales, zeros = rk.quantize_int4(
        torch.randn(n, k, device=device) / k**0.5, group_size, symmetric=symmetric
    )
    x, bias = _x((2, 9), k, dtype, device), _bias(n, symmetric, device)
    _close(*both_backends(rk.int4_linear, x, qweight, scales, zeros, group_size, bias))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 64])
def test_int8_grouped_triton_matches_reference(
    device: torch.device, dtype: torch.dtype, group_size: int
) -> None:
    n, k = 35, 128
    weight, scales = rk.quantize_int8_grouped(torch.randn(n, k, device=device), group_size)
    x, bias = _x((2, 9), k, dtype, device), _bias(n, group_size == 32, device)
    _close(*both_backends(rk.int8_grouped_linear, x, weight, scales, group_size, bias))


@needs_triton
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_int4_triton_reads_fractional_zeros_and_half_scales(
    device: torch.device, scale_dtype: torch.dtype
) -> None:
    packed, scales, _, _ = _int4_by_hand(20, 128, 64, scale_dtype)
    zeros = (torch.rand(20, 2) * 15).to(scale_dtype)
    x = _x((1,), 128, torch.float16, device)
    args = (x, packed.to(device), scales.to(device), zeros.to(device), 64)
    _close(*both_backends(rk.int4_linear, *args))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize(("lead", "n", "k", "with_bias"), [((1,), 33, 100, False), ((3, 6), 40, 64, True)])  # fmt: skip
def test_fp8_triton_matches_reference(
    device: torch.device,
    dtype: torch.dtype,
    per_channel: bool,
    lead: tuple[int, ...],
    n: int,
    k: int,
    with_bias: bool,
) -> None:
    weight, scale = rk.quantize_fp8(torch.randn(n, k, device=device) / k**0.5, per_channel)
    x, bias = _x(lead, k, dtype, device), _bias(n, with_bias, device)
    _close(*both_backends(rk.fp8_linear, x, weight, scale, bias))


@needs_triton
def test_fp8_triton_reads_a_one_element_scale_and_subnormal_weights(device: torch.device) -> None:
    weight = (torch.randn(16, 64, device=device) * 2**-7).to(torch.float8_e4m3fn)  # subnormals
    x = _x((3,), 64, torch.float32, device)
    _close(*both_backends(rk.fp8_linear, x, weight, torch.tensor([3.0], device=device)))


def _every_finite_e4m3(rows: int) -> torch.Tensor:
    """All 254 finite float8_e4m3fn bit patterns (and two zeros), shuffled into ``[rows, -1]``."""
    codes = torch.arange(256, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, 0, codes)  # the two NaN patterns -> 0
    codes = codes[torch.randperm(256)].to(torch.uint8)
    return codes.view(torch.float8_e4m3fn).reshape(rows, -1)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_triton_decodes_the_bytes_itself_where_triton_has_no_fp8(
    device: torch.device, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from radixlm.kernels.triton_ops import quant as triton_quant

    monkeypatch.setattr(triton_quant, "native_fp8", lambda device: False)
    weight = _every_finite_e4m3(16).to(device)  # [16, 16]: subnormals, both signs, +-448
    scale = torch.rand(16, device=device) / 448
    x = _x((5,), 16, dtype, device)
    _close(*both_backends(rk.fp8_linear, x, weight, scale, torch.randn(16, device=device)))


@needs_triton
def test_triton_linears_read_strided_views(device: torch.device) -> None:
    x = torch.randn(5, 96, device=device)[:, :64]  # row stride 96
    q8, s8 = rk.quantize_int8(torch.randn(24, 80, device=device))
    _close(*both_backends(rk.int8_linear, x, q8[:, :64], s8))  # weight row stride 80
    qw, sc, z = rk.quantize_int4(torch.randn(24, 64, device=device), 32)
    _close(*both_backends(rk.int4_linear, x, qw, sc, z, 32, torch.randn(48, device=device)[::2]))


@needs_triton
def test_triton_linears_of_an_empty_batch_are_empty(device: torch.device) -> None:
    q, s = rk.quantize_int8(torch.randn(5, 64, device=device))
    with rk.use_backend("triton"):
        assert rk.int8_linear(torch.randn(0, 64, device=device), q, s).shape == (0, 5)


# --- bad arguments -----------------------------------------------------------------------------


def _int8_args(**change: Any) -> dict[str, Any]:
    weight = torch.zeros(8, 64, dtype=torch.int8)
    return {"x": torch.randn(2, 64), "weight": weight, "scale": torch.ones(8), **change}


def _int4_args(**change: Any) -> dict[str, Any]:
    qweight = torch.zeros(8, 32, dtype=torch.uint8)
    scales, zeros = torch.ones(8, 2), torch.zeros(8, 2)
    args = {"x": torch.randn(2, 64), "qweight": qweight, "scales": scales, "zeros": zeros}
    return {**args, "group_size": 32, **change}


def _fp8_args(**change: Any) -> dict[str, Any]:
    weight = torch.zeros(8, 64, dtype=torch.float8_e4m3fn)
    return {"x": torch.randn(2, 64), "weight": weight, "weight_scale": torch.tensor(1.0), **change}


BAD_ARGUMENTS: dict[str, tuple[Callable[..., Any], dict[str, Any], str]] = {
    "int8 x of ints": (rk.int8_linear, _int8_args(x=torch.ones(2, 64, dtype=torch.int32)), r"x must be float32"),
    "int8 x of the wrong K": (rk.int8_linear, _int8_args(x=torch.randn(2, 63)), r"x must have shape \[\.\.\., K\] with K = 64"),
    "int8 float weight": (rk.int8_linear, _int8_args(weight=torch.zeros(8, 64)), r"weight must be torch\.int8 \[N, K\]"),
    "int8 1-D weight": (rk.int8_linear, _int8_args(weight=torch.zeros(64, dtype=torch.int8)), r"weight must be \[N, K\]"),
    "int8 scale per tensor": (rk.int8_linear, _int8_args(scale=torch.ones(1)), r"scale must have shape \[N\] = \[8\]"),
    "int8 integer scale": (rk.int8_linear, _int8_args(scale=torch.ones(8, dtype=torch.int32)), r"scale must be float32"),
    "int8 bias of the wrong N": (rk.int8_linear, _int8_args(bias=torch.ones(7)), r"bias must have shape \[N\] = \[8\]"),
    "int8 tensors on two devices": (rk.int8_linear, _int8_args(x=torch.randn(2, 64, device="meta")), r"one device.*x on meta"),
    "int4 group size 16": (rk.int4_linear, _int4_args(group_size=16), r"group_size must be one of \(32, 64, 128\), got 16"),
    "int4 K not a multiple of the group": (rk.int4_linear, _int4_args(group_size=128), r"K = 64 .* multiple of group_size = 128"),
    "int4 int8 qweight": (rk.int4_linear, _int4_args(qweight=torch.zeros(8, 32, dtype=torch.int8)), r"qweight must be torch\.uint8 \[N, K // 2\]"),
    "int4 unpacked qweight": (rk.int4_linear, _int4_args(qweight=torch.zeros(8, 64, dtype=torch.uint8), scales=torch.ones(8, 4), zeros=torch.zeros(8, 4)), r"x must have shape \[\.\.\., K\] with K = 128"),
    "int4 scales of the wrong shape": (rk.int4_linear, _int4_args(scales=torch.ones(8, 4)), r"scales must have shape \[N, K // group_size\] = \[8, 2\]"),
    "int4 zeros in another dtype": (rk.int4_linear, _int4_args(zeros=torch.zeros(8, 2, dtype=torch.float16)), r"zeros must match scales"),
    "int4 integer scales": (rk.int4_linear, _int4_args(scales=torch.ones(8, 2, dtype=torch.int32)), r"scales must be float32"),
    "fp8 int8 weight": (rk.fp8_linear, _fp8_args(weight=torch.zeros(8, 64, dtype=torch.int8)), r"weight must be torch\.float8_e4m3fn \[N, K\]"),
    "fp8 scale of two": (rk.fp8_linear, _fp8_args(weight_scale=torch.ones(2)), r"weight_scale must have shape \[\] or \[1\] \(per tensor\) or \[N\] = \[8\]"),
    "fp8 bias 2-D": (rk.fp8_linear, _fp8_args(bias=torch.ones(1, 8)), r"bias must have shape \[N\]"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_linears_reject_bad_arguments_naming_them(case: str) -> None:
    fn, kwargs, message = BAD_ARGUMENTS[case]
    with pytest.raises(ValueError, match=message):
        fn(**kwargs)


@pytest.mark.parametrize(
    ("fn", "args", "message"),
    [
        (rk.quantize_int8, (torch.randn(64),), r"quantize_int8: w must be \[N, K\]"),
        (rk.quantize_int8, (torch.ones(2, 4, dtype=torch.int8),), r"w must be float32"),
        (rk.quantize_int4, (torch.randn(4, 64), 48), r"group_size must be one of"),
        (rk.quantize_int4, (torch.randn(4, 96), 64), r"K = 96 \(w\.shape\[1\]\) must be a multiple"),
        (rk.quantize_fp8, (torch.randn(2, 3, 4), True), r"w must be \[N, K\]"),
        (rk.pack_int4, (torch.zeros(2, 3, dtype=torch.uint8),), r"q must have an even number"),
        (rk.pack_int4, (torch.full((2, 4), 16, dtype=torch.uint8),), r"q must hold 4-bit codes 0\.\.15"),
        (rk.pack_int4, (torch.zeros(2, 4, dtype=torch.int32),), r"q must be torch\.uint8"),
        (rk.unpack_int4, (torch.zeros(4, dtype=torch.uint8),), r"packed must be \[N, K // 2\]"),
        (rk.dequantize_fp8, (torch.zeros(4, 8, dtype=torch.float8_e4m3fn), torch.ones(3)), r"scale must have shape"),
        (rk.dequantize_int4, (torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 1), torch.zeros(4, 1), 64), r"K = 32 .* group_size = 64"),
    ],
)  # fmt: skip
def test_helpers_reject_bad_arguments_naming_them(
    fn: Callable[..., Any], args: tuple[Any, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        fn(*args)


# --- GPU: serving shapes -----------------------------------------------------------------------

SERVING = [(m, k, n) for m in (1, 16, 512) for k, n in ((4096, 4096), (4096, 14336))]


def _serving_weights(fmt: str, n: int, k: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    w = torch.randn(n, k, device="cuda") / k**0.5
    if fmt == "int8":
        return rk.int8_linear, rk.quantize_int8(w)
    if fmt == "int4":
        return rk.int4_linear, (*rk.quantize_int4(w.half(), 128), 128)
    return rk.fp8_linear, rk.quantize_fp8(w, per_channel=True)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize(("m", "k", "n"), [*SERVING, (2048, 14336, 4096)])
def test_quantized_linears_at_serving_shapes(fmt: str, m: int, k: int, n: int) -> None:
    fn, weights = _serving_weights(fmt, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    _close(*both_backends(fn, x, *weights))


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_quantized_linears_on_cuda_in_every_activation_dtype(fmt: str, dtype: torch.dtype) -> None:
    fn, weights = _serving_weights(fmt, 4096 + 96, 4096)
    x = torch.randn(3, 7, 4096, device="cuda", dtype=dtype)
    _close(*both_backends(fn, x, *weights, torch.randn(4096 + 96, device="cuda")))


@pytest.mark.gpu
@needs_triton
def test_auto_picks_triton_for_cuda_quantized_linears(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rk.reference, "int8_linear", lambda *a: pytest.fail("reference called"))
    q, s = rk.quantize_int8(torch.randn(64, 128, device="cuda"))
    with rk.use_backend("auto"):
        rk.int8_linear(torch.randn(4, 128, device="cuda", dtype=torch.bfloat16), q, s)
