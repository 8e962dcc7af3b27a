"""Weight-only quantized GEMMs in Triton: int8 / fp8 per channel (or tensor), int4 per group."""

# Triton reads kernel parameter annotations itself, so @triton.jit functions stay unannotated.
# mypy: disable-error-code="untyped-decorator, no-untyped-def"

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixlm.kernels.triton_ops._common import INTERPRETED, num_sms, upcast_dots


@dataclass(frozen=True, slots=True)
class Blocks:
    """Tile sizes and launch settings of one quantized GEMM call."""

    m: int
    n: int
    k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def choose_blocks(m: int, n: int, x: torch.Tensor, max_k: int | None = None) -> Blocks:
    """Tile sizes from the number of rows M (and, for decode, N against the SM count).

    Decode (``m <= 16``) is a weight-streaming GEMV: one 16-row tile, long K steps, and narrow
    N tiles when wide ones would leave SMs idle. Prefill grows the M and N tiles so that each
    weight tile loaded (and dequantized) serves more rows. ``max_k`` caps the K step (an int4
    tile must lie inside one quantization group). fp32 activations take twice the shared
    memory per stage, so they get fewer stages.
    """
    if INTERPRETED:  # small tiles keep the tests quick; group_m=2 gives them partial groups
        blocks = Blocks(16, 32, 32, num_warps=4, num_stages=1, group_m=2)
    elif m <= 16:
        narrow = triton.cdiv(n, 64) < 2 * num_sms(x.device)
        blocks = Blocks(16, 32 if narrow else 64, 256, num_warps=4, num_stages=4)
    elif m <= 64:
        blocks = Blocks(32 if m <= 32 else 64, 64, 128, num_warps=4, num_stages=4)
    elif m <= 256:
        blocks = Blocks(64, 128, 64, num_warps=4, num_stages=4)
    else:
        blocks = Blocks(128, 128, 64, num_warps=8, num_stages=3)
    k = blocks.k if max_k is None else min(blocks.k, max_k)
    stages = min(blocks.num_stages, 2) if x.dtype == torch.float32 else blocks.num_stages
    return Blocks(blocks.m, blocks.n, k, blocks.num_warps, stages, blocks.group_m)


def native_fp8(device: torch.device) -> bool:
    """Whether Triton can load float8_e4m3fn (``fp8e4nv``) on this device: NVIDIA GPUs from
    compute capability 8.9 (Ada, Hopper) and the interpreter. Elsewhere the kernel reads the
    bytes and decodes them itself."""
    if device.type != "cuda":
        return True
    if torch.version.hip is not None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


@triton.jit
def _e4m3_from_bits(b):
    """float8_e4m3fn bytes -> float16, exactly. The exponent and mantissa bits moved into a
    float16's (whose exponent bias is 8 more) give the value times 2**-8, subnormals included;
    multiplying by 256 is exact. NaN bytes (never written by the quantizer) are not kept."""
    b16 = b.to(tl.uint16)
    bits = ((b16 & 0x7F) << 7) | ((b16 & 0x80) << 8)
    return bits.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (M tile, N tile), walking GROUP_M row tiles per column of N tiles so that
    programs running together share weight tiles (and x tiles) in L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    return pid_m, pid_n


@triton.jit
def _epilogue(acc, Bias, Out, offs_m, offs_n, M, N, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(ptrs, acc.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _scaled_linear_kernel(
    X,
    W,
    Scale,
    Bias,
    Out,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    E4M3_BITS: tl.constexpr,
):
    """``out = (x @ w.T) * scale (+ bias)`` for int8 or float8e4nv ``w``: each weight tile is
    converted to x's dtype in registers (exactly: every int8 and e4m3 value is a bf16/fp16
    value), and the per-channel (or per-tensor) scale, constant along K, is applied once to
    the fp32 accumulator. With ``E4M3_BITS`` the fp8 weight arrives as its bytes (uint8) and
    is decoded here, for GPUs whose Triton has no fp8e4nv."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge read row 0 / column 0 again (valid memory, never stored),
    # so only K needs a load mask.
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    x_ptrs = X + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + cols[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_in = offs_k < K - k0
            x = tl.load(x_ptrs, mask=k_in[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_in[:, None], other=0.0)
        if E4M3_BITS:
            w = _e4m3_from_bits(w)
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(X.dtype.element_ty))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PER_CHANNEL:
        scale = tl.load(Scale + cols).to(tl.float32)
        acc = acc * scale[None, :]
    else:
        acc = acc * tl.load(Scale).to(tl.float32)
    _epilogue(acc, Bias, Out, offs_m, offs_n, M, N, stride_om, HAS_BIAS)


@triton.jit
def _int4_linear_kernel(
    X,
    QW,
    Scales,
    Zeros,
    Bias,
    Out,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``out = x @ ((q - zeros) * scales).T (+ bias)`` with two 4-bit codes per byte.

    A K tile lies inside one quantization group (``GROUP % BLOCK_K == 0``, so no K mask
    either), hence one scale and zero per output column per tile. The packed tile is loaded
    as stored, ``[BLOCK_N, BLOCK_K // 2]`` bytes contiguous along K (so the loads vectorize and
    pipeline), split into low nibbles (even columns) and high nibbles (odd columns),
    dequantized in fp32 and interleaved back into ``[BLOCK_N, BLOCK_K]`` for one dot.
    """
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // 2)  # byte j of the tile holds columns 2j and 2j + 1
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    x_ptrs = X + rows[:, None] * stride_xm + offs_k[None, :]
    q_ptrs = QW + cols[:, None] * stride_qn + offs_b[None, :]  # [BLOCK_N, BLOCK_K // 2]
    s_ptrs = Scales + cols * stride_sn
    z_ptrs = Zeros + cols * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // GROUP
        s = tl.load(s_ptrs + g).to(tl.float32)[:, None]
        z = tl.load(z_ptrs + g).to(tl.float32)[:, None]
        packed = tl.load(q_ptrs).to(tl.int32)
        w_even = ((packed & 0xF).to(tl.float32) - z) * s
        w_odd = ((packed >> 4).to(tl.float32) - z) * s
        w = tl.trans(tl.interleave(w_even, w_odd))  # [BLOCK_K, BLOCK_N]
        x = tl.load(x_ptrs)
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(X.dtype.element_ty))
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // 2
    _epilogue(acc, Bias, Out, offs_m, offs_n, M, N, stride_om, HAS_BIAS)


@triton.jit
def _int8_grouped_linear_kernel(
    X,
    W,
    Scales,
    Bias,
    Out,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``out = x @ (w * scales).T (+ bias)`` with one scale per output column and group of
    ``GROUP`` along K. A K tile lies inside one group (``GROUP % BLOCK_K == 0``, so no K mask
    either): the int8 tile is scaled in fp32 in registers, then one dot."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    x_ptrs = X + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + cols[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    s_ptrs = Scales + cols * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        s = tl.load(s_ptrs + k0 // GROUP).to(tl.float32)[None, :]
        w = tl.load(w_ptrs).to(tl.float32) * s
        x = tl.load(x_ptrs)
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(X.dtype.element_ty))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _epilogue(acc, Bias, Out, offs_m, offs_n, M, N, stride_om, HAS_BIAS)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[M, K]`` with a unit stride on K."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _grid(m: int, n: int, blocks: Blocks) -> tuple[int]:
    return (triton.cdiv(m, blocks.m) * triton.cdiv(n, blocks.n),)


def _scaled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    per_channel: bool,
) -> torch.Tensor:
    n, k = weight.shape
    x2 = _rows(x)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    e4m3_bits = weight.dtype == torch.float8_e4m3fn and not native_fp8(x.device)
    if e4m3_bits:
        weight = weight.view(torch.uint8)
    blocks = choose_blocks(m, n, x)
    _scaled_linear_kernel[_grid(m, n, blocks)](
        x2,
        weight,
        _dense(scale),
        _dense(bias) if bias is not None else out,
        out,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=blocks.m,
        BLOCK_N=blocks.n,
        BLOCK_K=blocks.k,
        GROUP_M=blocks.group_m,
        PER_CHANNEL=per_channel,
        HAS_BIAS=bias is not None,
        EVEN_K=k % blocks.k == 0,
        UPCAST=upcast_dots(x.dtype),
        E4M3_BITS=e4m3_bits,
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
    return out.view(*x.shape[:-1], n)


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`radixlm.kernels.int8_linear`."""
    return _scaled_linear(x, weight, scale, bias, per_channel=True)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`radixlm.kernels.fp8_linear`."""
    # Validated to be [] or [1] (per tensor) or [N]; with N == 1 both readings agree.
    per_channel = weight_scale.numel() != 1
    return _scaled_linear(x, weight, weight_scale.reshape(-1), bias, per_channel=per_channel)


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`radixlm.kernels.int4_linear`."""
    n = qweight.shape[0]
    k = 2 * qweight.shape[1]
    x2 = _rows(x)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    qweight = _dense(qweight)
    scales, zeros = _dense(scales), _dense(zeros)
    blocks = choose_blocks(m, n, x, max_k=group_size)
    _int4_linear_kernel[_grid(m, n, blocks)](
        x2,
        qweight,
        scales,
        zeros,
        _dense(bias) if bias is not None else out,
        out,
        m,
        n,
        k,
        x2.stride(0),
        qweight.stride(0),
        scales.stride(0),
        out.stride(0),
        GROUP=group_size,
        BLOCK_M=blocks.m,
        BLOCK_N=blocks.n,
        BLOCK_K=blocks.k,
        GROUP_M=blocks.group_m,
        HAS_BIAS=bias is not None,
        UPCAST=upcast_dots(x.dtype),
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
    return out.view(*x.shape[:-1], n)


def int8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`radixlm.kernels.int8_grouped_linear`."""
    n, k = weight.shape
    x2 = _rows(x)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    weight, scales = _dense(weight), _dense(scales)
    blocks = choose_blocks(m, n, x, max_k=group_size)
    _int8_grouped_linear_kernel[_grid(m, n, blocks)](
        x2,
        weight,
        scales,
        _dense(bias) if bias is not None else out,
        out,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        scales.stride(0),
        out.stride(0),
        GROUP=group_size,
        BLOCK_M=blocks.m,
        BLOCK_N=blocks.n,
        BLOCK_K=blocks.k,
        GROUP_M=blocks.group_m,
        HAS_BIAS=bias is not None,
        UPCAST=upcast_dots(x.dtype),
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )
    return out.view(*x.shape[:-1], n)
