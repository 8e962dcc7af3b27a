"""Triton attention kernels against their torch references (interpreter on CPU, native on GPU)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_test_helpers import TOLERANCES, paged_kv

from radixlm.kernels import decode_attention, extend_attention, store_kv, use_backend

pytestmark = pytest.mark.usefixtures("needs_triton")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GQA = [(2, 2), (4, 2), (7, 1)]  # (num_heads, kv_heads): ratios 1, 2, 7
HEAD_DIMS = [64, 128]
# Every dtype x GQA ratio x head_dim; page sizes alternate so both appear with each ratio.
MATRIX = [
    pytest.param(
        dtype,
        heads,
        kv_heads,
        head_dim,
        16 if i % 2 else 1,
        id=f"{str(dtype)[6:]}-{heads}/{kv_heads}-d{head_dim}-p{16 if i % 2 else 1}",
    )
    for i, (dtype, (heads, kv_heads), head_dim) in enumerate(
        itertools.product(DTYPES, GQA, HEAD_DIMS)
    )
]


def both_backends(
    fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    with use_backend("triton"):
        got = fn(*args, **kwargs)
    with use_backend("reference"):
        want = fn(*args, **kwargs)
    return got, want


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[want.dtype])


@pytest.mark.parametrize(("dtype", "num_heads", "kv_heads", "head_dim", "page_size"), MATRIX)
def test_decode_triton_matches_reference(
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
) -> None:
    lengths = [1, 19, 40]
    kv = paged_kv(lengths, kv_heads, head_dim, page_size, dtype, device)
    q = torch.randn(len(lengths), num_heads, head_dim).to(device=device, dtype=dtype)
    args = (q, kv.k_pool, kv.v_pool, kv.req_to_token, torch.tensor(lengths, device=device))
    assert_close(*both_backends(decode_attention, *args, kv.req_pool_indices))


@pytest.mark.parametrize("num_kv_splits", [1, 2, 5])
def test_decode_triton_split_k_matches_reference(device: torch.device, num_kv_splits: int) -> None:
    lengths = [3, 47, 64, 1]  # some splits of the short requests are empty
    kv = paged_kv(lengths, 2, 64, 16, torch.float32, device)
    q = torch.randn(4, 4, 64, device=device)
    got, want = both_backends(
        decode_attention,
        q,
        kv.k_pool,
        kv.v_pool,
        kv.req_to_token,
        torch.tensor(lengths, device=device),
        kv.req_pool_indices,
        num_kv_splits=num_kv_splits,
    )
    assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_decode_triton_window_and_soft_cap_match_reference(
    device: torch.device, dtype: torch.dtype, num_kv_splits: int
) -> None:
    lengths = [5, 37, 50]
    kv = paged_kv(lengths, 1, 64, 1, dtype, device)
    q = (torch.randn(3, 7, 64) * 3).to(device=device, dtype=dtype)
    got, want = both_backends(
        decode_attention,
        q,
        kv.k_pool,
        kv.v_pool,
        kv.req_to_token,
        torch.tensor(lengths, device=device),
        kv.req_pool_indices,
        scale=0.2,
        sliding_window=16,
        logit_cap=3.0,
        num_kv_splits=num_kv_splits,
    )
    assert_close(got, want)


def test_decode_triton_gives_zeros_for_an_empty_context(device: torch.device) -> None:
    kv = paged_kv([6, 0], 2, 64, 1, torch.float32, device)
    q = torch.randn(2, 2, 64, device=device)
    with use_backend("triton"):
        out = decode_attention(
            q,
            kv.k_pool,
            kv.v_pool,
            kv.req_to_token,
            torch.tensor([6, 0], device=device),
            kv.req_pool_indices,
            num_kv_splits=2,
        )
    assert torch.all(out[1] == 0)
    assert torch.all(torch.isfinite(out))


def test_decode_triton_reads_row_b_without_req_pool_indices(device: torch.device) -> None:
    lengths = [9, 20]
    kv = paged_kv(lengths, 1, 64, 16, torch.float16, device)
    table = kv.req_to_token[kv.req_pool_indices.long()]  # row b for request b
    q = torch.randn(2, 2, 64).to(device=device, dtype=torch.float16)
    got, want = both_backends(
        decode_attention, q, kv.k_pool, kv.v_pool, table, torch.tensor(lengths, device=device)
    )
    assert_close(got, want)


# Ragged: empty prefix, length-1 extend, whole prompt cached but the last token, mixed lengths.
PREFIXES, EXTENDS = [0, 12, 15, 9], [5, 1, 1, 21]


@pytest.mark.parametrize(("dtype", "num_heads", "kv_heads", "head_dim", "page_size"), MATRIX)
def test_extend_triton_matches_reference(
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
) -> None:
    lengths = [p + e for p, e in zip(PREFIXES, EXTENDS, strict=True)]
    kv = paged_kv(lengths, kv_heads, head_dim, page_size, dtype, device)
    q = torch.randn(sum(EXTENDS), num_heads, head_dim).to(device=device, dtype=dtype)
    got, want = both_backends(
        extend_attention,
        q,
        kv.k_pool,
        kv.v_pool,
        kv.req_to_token,
        torch.tensor(PREFIXES, device=device),
        torch.tensor(EXTENDS, device=device),
        kv.req_pool_indices,
    )
    assert_close(got, want)


def test_extend_triton_handles_a_request_with_nothing_new(device: torch.device) -> None:
    prefixes, extends = [4, 10, 0], [3, 0, 2]
    kv = paged_kv([7, 10, 2], 2, 64, 1, torch.float32, device)
    q = torch.randn(5, 4, 64, device=device)
    got, want = both_backends(
        extend_attention,
        q,
        kv.k_pool,
        kv.v_pool,
        kv.req_to_token,
        torch.tensor(prefixes, device=device),
        torch.tensor(extends, device=device),
        kv.req_pool_indices,
        max_extend_len=3,
    )
    assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_extend_triton_window_and_soft_cap_match_reference(
    device: torch.device, dtype: torch.dtype
) -> None:
    prefixes, extends = [20, 0], [19, 7]
    kv = paged_kv([39, 7], 1, 64, 16, dtype, device)
    q = (torch.randn(26, 2, 64) * 3).to(device=device, dtype=dtype)
    got, want = both_backends(
        extend_attention,
        q,
        kv.k_pool,
        kv.v_pool,
        kv.req_to_token,
        torch.tensor(prefixes, device=device),
        torch.tensor(extends, device=device),
        kv.req_pool_indices,
        scale=0.25,
        sliding_window=6,
        logit_cap=4.0,
    )
    assert_close(got, want)


def _store_both(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, pool_dtype: torch.dtype
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    pools = {}
    for backend in ("triton", "reference"):
        k_pool = torch.zeros(32, *k.shape[1:], device=k.device, dtype=pool_dtype)
        v_pool = torch.zeros(32, *k.shape[1:], device=k.device, dtype=pool_dtype)
        with use_backend(backend):  # type: ignore[arg-type]
            store_kv(k, v, k_pool, v_pool, slots)
        pools[backend] = (k_pool, v_pool)
    return pools


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_triton_matches_reference(device: torch.device, dtype: torch.dtype) -> None:
    k = torch.randn(5, 2, 64).to(device=device, dtype=dtype)
    v = torch.randn(5, 2, 64).to(device=device, dtype=dtype)
    slots = torch.tensor([9, 0, 31, 4, 17], device=device, dtype=torch.int32)
    pools = _store_both(k, v, slots, dtype)
    assert torch.equal(pools["triton"][0], pools["reference"][0])
    assert torch.equal(pools["triton"][1], pools["reference"][1])
    assert torch.equal(pools["triton"][0][slots.long()], k)


def test_store_kv_triton_casts_to_the_pool_dtype(device: torch.device) -> None:
    k = torch.randn(3, 1, 32, device=device)
    v = torch.randn(3, 1, 32, device=device)
    pools = _store_both(k, v, torch.tensor([1, 2, 3], device=device), torch.float16)
    assert torch.equal(pools["triton"][0], pools["reference"][0])
    assert torch.equal(pools["triton"][1], pools["reference"][1])


def test_store_kv_triton_accepts_a_strided_view_of_fused_qkv(device: torch.device) -> None:
    qkv = torch.randn(3, 4 + 2 + 2, 16, device=device)  # q heads, k heads, v heads
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    k_pool = torch.zeros(8, 2, 16, device=device)
    v_pool = torch.zeros(8, 2, 16, device=device)
    with use_backend("triton"):
        store_kv(k, v, k_pool, v_pool, torch.tensor([5, 1, 2], device=device))
    assert torch.equal(k_pool[[5, 1, 2]], k)
    assert torch.equal(v_pool[[5, 1, 2]], v)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    data=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 20)), min_size=1, max_size=4),
    ratio=st.sampled_from([1, 2, 7]),
    window=st.sampled_from([None, 1, 9]),
    page_size=st.sampled_from([1, 16]),
)
def test_extend_triton_matches_reference_on_random_ragged_batches(
    data: list[tuple[int, int]], ratio: int, window: int | None, page_size: int
) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    prefixes = [p for p, _ in data]
    extends = [e for _, e in data]
    lengths = [p + e for p, e in data]
    kv = paged_kv(lengths, 1, 64, page_size, torch.float32, device)
    q = torch.randn(sum(extends), ratio, 64, device=device)
    got, want = both_backends(
        extend_attention,
        q,
        kv.k_pool,
        kv.v_pool,
        kv.req_to_token,
        torch.tensor(prefixes, device=device),
        torch.tensor(extends, device=device),
        kv.req_pool_indices,
        sliding_window=window,
    )
    assert_close(got, want)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    lengths=st.lists(st.integers(0, 90), min_size=1, max_size=4),
    ratio=st.sampled_from([1, 2, 7]),
    splits=st.integers(1, 6),
    window=st.sampled_from([None, 1, 20]),
)
def test_decode_triton_matches_reference_on_random_lengths(
    lengths: list[int], ratio: int, splits: int, window: int | None
) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kv = paged_kv(lengths, 1, 64, 16, torch.float32, device)
    q = torch.randn(len(lengths), ratio, 64, device=device)
    got, want = both_backends(
        decode_attention,
        q,
        kv.k_pool,
        kv.v_pool,
        kv.req_to_token.long(),
        torch.tensor(lengths, device=device),
        kv.req_pool_indices.long(),
        num_kv_splits=splits,
        sliding_window=window,
    )
    assert_close(got, want)


def test_decode_triton_reads_q_as_a_strided_view(device: torch.device) -> None:
    lengths = [7, 30]
    kv = paged_kv(lengths, 2, 64, 1, torch.float16, device)
    qkv = torch.randn(2, 4 + 2 + 2, 64).to(device=device, dtype=torch.float16)
    q = qkv[:, :4]
    got, want = both_backends(
        decode_attention,
        q,
        kv.k_pool,
        kv.v_pool,
        kv.req_to_token,
        torch.tensor(lengths, device=device),
        kv.req_pool_indices,
    )
    assert_close(got, want)
