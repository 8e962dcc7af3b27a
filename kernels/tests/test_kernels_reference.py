"""The torch references against plain, obviously correct code (no Triton involved)."""

from __future__ import annotations

import math

import pytest
import torch
from kernels_test_helpers import (
    build_req_to_token_by_hand,
    dense_attention,
    oracle_sample,
    paged_kv,
    softmax_probs,
)

from radixlm.kernels import reference

GQA_CASES = [(2, 2), (4, 2), (7, 1)]  # (num_heads, kv_heads): ratios 1, 2, 7


@pytest.mark.parametrize(("num_heads", "kv_heads"), GQA_CASES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_reference_matches_dense_softmax(
    num_heads: int, kv_heads: int, page_size: int
) -> None:
    lengths = [1, 17, 33]
    kv = paged_kv(lengths, kv_heads, 64, page_size, torch.float32)
    q = torch.randn(len(lengths), num_heads, 64)
    out = reference.decode_attention(
        q, kv.k_pool, kv.v_pool, kv.req_to_token, torch.tensor(lengths), kv.req_pool_indices
    )
    for b, n in enumerate(lengths):
        want = dense_attention(q[b : b + 1], [n - 1], kv, b, n, scale=1 / math.sqrt(64))
        torch.testing.assert_close(out[b : b + 1].double(), want, atol=1e-5, rtol=1e-5)


def test_decode_reference_applies_window_and_soft_cap() -> None:
    lengths = [5, 30]
    kv = paged_kv(lengths, 1, 64, 16, torch.float32)
    q = torch.randn(2, 2, 64) * 3
    out = reference.decode_attention(
        q,
        kv.k_pool,
        kv.v_pool,
        kv.req_to_token,
        torch.tensor(lengths),
        kv.req_pool_indices,
        scale=0.2,
        sliding_window=8,
        logit_cap=2.0,
    )
    for b, n in enumerate(lengths):
        want = dense_attention(
            q[b : b + 1], [n - 1], kv, b, n, scale=0.2, sliding_window=8, logit_cap=2.0
        )
        torch.testing.assert_close(out[b : b + 1].double(), want, atol=1e-5, rtol=1e-5)


def test_decode_reference_gives_zeros_for_an_empty_context() -> None:
    kv = paged_kv([4, 0], 1, 64, 1, torch.float32)
    q = torch.randn(2, 2, 64)
    out = reference.decode_attention(
        q, kv.k_pool, kv.v_pool, kv.req_to_token, torch.tensor([4, 0]), kv.req_pool_indices
    )
    assert torch.all(out[1] == 0)
    assert torch.all(torch.isfinite(out))


@pytest.mark.parametrize(("num_heads", "kv_heads"), GQA_CASES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_reference_matches_dense_causal_softmax(
    num_heads: int, kv_heads: int, page_size: int
) -> None:
    # empty prefix, a length-1 extend, the whole prompt cached but its last token, mixed.
    prefixes, extends = [0, 12, 15, 9, 4], [5, 1, 1, 17, 0]
    lengths = [p + e for p, e in zip(prefixes, extends, strict=True)]
    kv = paged_kv(lengths, kv_heads, 64, page_size, torch.float32)
    q = torch.randn(sum(extends), num_heads, 64)
    out = reference.extend_attention(
        q,
        kv.k_pool,
        kv.v_pool,
        kv.req_to_token,
        torch.tensor(prefixes),
        torch.tensor(extends),
        kv.req_pool_indices,
    )
    start = 0
    for b, (p, e) in enumerate(zip(prefixes, extends, strict=True)):
        rows = q[start : start + e]
        want = dense_attention(rows, list(range(p, p + e)), kv, b, p + e, scale=1 / 8)
        torch.testing.assert_close(out[start : start + e].double(), want, atol=1e-5, rtol=1e-5)
        start += e


def test_extend_reference_applies_window_and_soft_cap() -> None:
    prefixes, extends = [3, 0], [9, 6]
    lengths = [p + e for p, e in zip(prefixes, extends, strict=True)]
    kv = paged_kv(lengths, 2, 64, 1, torch.float32)
    q = torch.randn(sum(extends), 4, 64) * 3
    out = reference.extend_attention(
        q,
        kv.k_pool,
        kv.v_pool,
        kv.req_to_token,
        torch.tensor(prefixes),
        torch.tensor(extends),
        kv.req_pool_indices,
        scale=0.3,
        sliding_window=4,
        logit_cap=1.5,
    )
    start = 0
    for b, (p, e) in enumerate(zip(prefixes, extends, strict=True)):
        want = dense_attention(
            q[start : start + e],
            list(range(p, p + e)),
            kv,
            b,
            p + e,
            scale=0.3,
            sliding_window=4,
            logit_cap=1.5,
        )
        torch.testing.assert_close(out[start : start + e].double(), want, atol=1e-5, rtol=1e-5)
        start += e


def test_paged_table_builder_lays_slots_out_in_pages() -> None:
    table = build_req_to_token_by_hand([3, 5], page_size=2)
    assert table[0, :3].tolist() == [0, 1, 2]
    assert table[1, :5].tolist() == [4, 5, 6, 7, 8]


def test_store_kv_reference_writes_only_the_given_slots() -> None:
    k_pool = torch.zeros(10, 2, 4)
    v_pool = torch.zeros(10, 2, 4)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    reference.store_kv(k, v, k_pool, v_pool, torch.tensor([7, 2, 5]))
    assert torch.equal(k_pool[[7, 2, 5]], k)
    assert torch.equal(v_pool[[7, 2, 5]], v)
    untouched = [0, 1, 3, 4, 6, 8, 9]
    assert torch.all(k_pool[untouched] == 0) and torch.all(v_pool[untouched] == 0)


def test_rms_norm_reference_follows_the_formula() -> None:
    x, w = torch.randn(3, 16), torch.randn(16)
    for i in range(3):
        rms = math.sqrt(sum(float(t) ** 2 for t in x[i]) / 16 + 1e-6)
        want = torch.tensor([float(x[i, j]) / rms * (float(w[j]) + 1.0) for j in range(16)])
        got = reference.rms_norm(x, w, 1e-6, weight_offset=1.0)[i]
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


def test_fused_add_rms_norm_reference_equals_add_then_norm() -> None:
    x, r = torch.randn(4, 32).half(), torch.randn(4, 32).half()
    w = torch.randn(32)
    normed, summed = reference.fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(summed, x + r)
    assert torch.equal(normed, reference.rms_norm(x + r, w, 1e-5))


def _rope_by_complex(x: torch.Tensor, angles: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotation by multiplication with e^{i*angle}, pairing dims by layout."""
    half = angles.shape[-1]
    rot = 2 * half
    xd = x.double()
    if neox:
        pairs = torch.complex(xd[..., :half], xd[..., half:rot])
    else:
        pairs = torch.complex(xd[..., 0:rot:2], xd[..., 1:rot:2])
    turned = pairs * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    out = xd.clone()
    if neox:
        out[..., :half], out[..., half:rot] = turned.real, turned.imag
    else:
        out[..., 0:rot:2], out[..., 1:rot:2] = turned.real, turned.imag
    return out


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_reference_rotates_pairs_by_the_position_angle(neox: bool, rotary_dim: int) -> None:
    head_dim, positions = 64, torch.tensor([0, 5, 17, 3])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    table = torch.arange(32, dtype=torch.float64)[:, None] * inv_freq[None, :]
    q, k = torch.randn(4, 3, head_dim), torch.randn(4, 1, head_dim)
    q_out, k_out = reference.rotary_embedding(
        q, k, table.cos().float(), table.sin().float(), positions, neox_style=neox
    )
    angles = table[positions]
    torch.testing.assert_close(
        q_out.double(), _rope_by_complex(q, angles, neox), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        k_out.double(), _rope_by_complex(k, angles, neox), atol=1e-5, rtol=1e-5
    )


def test_silu_and_mul_reference_gates_the_second_half_by_the_first() -> None:
    x = torch.randn(3, 2, 10)
    gate, up = x[..., :5].double(), x[..., 5:].double()
    want = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(reference.silu_and_mul(x).double(), want, atol=1e-6, rtol=1e-6)


def test_bitmask_reference_masks_exactly_the_cleared_bits() -> None:
    vocab = 70  # three words, the last one partly used
    gen = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 3), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    logits = torch.randn(4, vocab)
    masked = logits.clone()
    reference.apply_token_bitmask_inplace(masked, bitmask)
    for r in range(4):
        for t in range(vocab):
            word = int(bitmask[r, t // 32]) & 0xFFFFFFFF
            allowed = (word >> (t % 32)) & 1
            assert masked[r, t] == (logits[r, t] if allowed else float("-inf"))


def test_bitmask_reference_masks_tokens_past_the_mask_and_skips_other_rows() -> None:
    logits = torch.zeros(3, 40)
    bitmask = torch.full((3, 1), -1, dtype=torch.int32)  # allows tokens 0..31
    reference.apply_token_bitmask_inplace(logits, bitmask, torch.tensor([2, 0]))
    assert torch.all(logits[[0, 2], :32] == 0)
    assert torch.all(logits[[0, 2], 32:] == float("-inf"))
    assert torch.all(logits[1] == 0)


SAMPLING_CASES = [  # top_k, top_p, min_p
    (0, 1.0, 0.0),
    (1, 1.0, 0.0),
    (5, 1.0, 0.0),
    (0, 0.5, 0.0),
    (0, 0.9, 0.0),
    (0, 1.0, 0.2),
    (20, 0.8, 0.05),
    (3, 0.1, 0.0),
    (1000, 0.95, 0.0),
]


def test_sampling_reference_matches_the_rule_spelled_out() -> None:
    vocab = 64
    probs = softmax_probs(len(SAMPLING_CASES) * 4, vocab, seed=11)
    params = SAMPLING_CASES * 4
    gen = torch.Generator().manual_seed(5)
    uniform = torch.rand(len(params), generator=gen)
    top_k = torch.tensor([p[0] for p in params])
    top_p = torch.tensor([p[1] for p in params])
    min_p = torch.tensor([p[2] for p in params])
    got = reference.sample_from_probs(probs, top_k, top_p, min_p, uniform)
    for i, (k, p, m) in enumerate(params):
        assert int(got[i]) == oracle_sample(probs[i].tolist(), k, p, m, float(uniform[i])), i


def test_sampling_reference_draws_in_proportion_to_the_kept_mass() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.05, 0.3, 0.15]])
    draws = 1000
    uniform = (torch.arange(draws, dtype=torch.float32) + 0.5) / draws
    tokens = reference.sample_from_probs(
        probs.expand(draws, -1),
        torch.full((draws,), 3),
        torch.ones(draws),
        torch.zeros(draws),
        uniform,
    )
    counts = torch.bincount(tokens, minlength=5).double() / draws
    # top-3 keeps 0.4, 0.3, 0.15 -> renormalised over 0.85.
    want = torch.tensor([0.0, 0.4, 0.0, 0.3, 0.15], dtype=torch.float64) / 0.85
    torch.testing.assert_close(counts, want, atol=2e-3, rtol=0)


def test_sampling_reference_never_draws_a_zero_probability_token() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 3)
    uniform = torch.tensor([0.0, 0.9999999, 0.5])
    tokens = reference.sample_from_probs(
        probs, torch.zeros(3, dtype=torch.long), torch.ones(3), torch.zeros(3), uniform
    )
    assert tokens.tolist() == [1, 3, 3]


def test_sampling_thresholds_keep_ties_at_the_cut() -> None:
    probs = torch.tensor([[0.3, 0.2, 0.2, 0.2, 0.1]])
    threshold = reference.sampling_thresholds(
        probs, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0])
    )
    assert threshold.tolist() == pytest.approx([0.2])
