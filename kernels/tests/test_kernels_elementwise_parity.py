"""Triton RMSNorm, rotary embedding and SiLU-and-mul against their torch references."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from kernels_test_helpers import TOLERANCES

from radixlm.kernels import (
    fused_add_rms_norm,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    use_backend,
)

pytestmark = pytest.mark.usefixtures("needs_triton")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def both_backends(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    with use_backend("triton"):
        got = fn(*args, **kwargs)
    with use_backend("reference"):
        want = fn(*args, **kwargs)
    return got, want


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[want.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_triton_matches_reference(
    device: torch.device, dtype: torch.dtype, hidden: int
) -> None:
    x = torch.randn(2, 3, hidden).to(device=device, dtype=dtype)
    w = torch.randn(hidden, device=device).to(dtype)
    assert_close(*both_backends(rms_norm, x, w, 1e-5))


def test_rms_norm_triton_applies_the_weight_offset(device: torch.device) -> None:
    x = torch.randn(4, 32, device=device)
    w = torch.randn(32, device=device)
    assert_close(*both_backends(rms_norm, x, w, 1e-6, weight_offset=1.0))


def test_rms_norm_triton_reads_a_row_strided_view(device: torch.device) -> None:
    x = torch.randn(5, 80, device=device)[:, :64]  # row stride 80
    w = torch.randn(64, device=device)
    assert_close(*both_backends(rms_norm, x, w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_triton_matches_reference(
    device: torch.device, dtype: torch.dtype
) -> None:
    x = torch.randn(3, 128).to(device=device, dtype=dtype)
    r = torch.randn(3, 128).to(device=device, dtype=dtype)
    w = torch.rand(128, device=device)
    (normed, summed), (want_normed, want_summed) = both_backends(fused_add_rms_norm, x, r, w, 1e-6)
    assert_close(normed, want_normed)
    assert_close(summed, want_summed)


def _tables(
    max_pos: int, rotary_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos().to(device), angles.sin().to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox_style", [True, False])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (128, 128), (128, 64)])
def test_rotary_triton_matches_reference(
    device: torch.device, dtype: torch.dtype, neox_style: bool, head_dim: int, rotary_dim: int
) -> None:
    cos, sin = _tables(64, rotary_dim, device)
    positions = torch.tensor([0, 1, 33, 63, 7], device=device)
    q = torch.randn(5, 7, head_dim).to(device=device, dtype=dtype)
    k = torch.randn(5, 1, head_dim).to(device=device, dtype=dtype)
    (q_got, k_got), (q_want, k_want) = both_backends(
        rotary_embedding, q, k, cos, sin, positions, neox_style=neox_style
    )
    assert_close(q_got, q_want)
    assert_close(k_got, k_want)


def test_rotary_triton_reads_views_of_fused_qkv_and_leaves_them_alone(device: torch.device) -> None:
    cos, sin = _tables(16, 32, device)
    qkv = torch.randn(3, 4 + 2 + 2, 32, device=device)
    before = qkv.clone()
    q, k = qkv[:, :4], qkv[:, 4:6]
    positions = torch.tensor([2, 9, 15], device=device)
    (q_got, k_got), (q_want, k_want) = both_backends(rotary_embedding, q, k, cos, sin, positions)
    assert_close(q_got, q_want)
    assert_close(k_got, k_want)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 2 * 100])
def test_silu_and_mul_triton_matches_reference(
    device: torch.device, dtype: torch.dtype, width: int
) -> None:
    x = (torch.randn(2, 3, width) * 4).to(device=device, dtype=dtype)
    assert_close(*both_backends(silu_and_mul, x))
