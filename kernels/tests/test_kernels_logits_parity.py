"""Triton token-bitmask and sampling kernels against their torch references."""

from __future__ import annotations

import pytest
import torch
from kernels_test_helpers import softmax_probs

from radixlm.kernels import apply_token_bitmask_inplace, sample_from_probs, use_backend

pytestmark = pytest.mark.usefixtures("needs_triton")


def _random_bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=gen).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "words"), [(100, 4), (64, 2), (90, 2)])
def test_bitmask_triton_matches_reference(
    device: torch.device, dtype: torch.dtype, vocab: int, words: int
) -> None:
    logits = torch.randn(3, vocab).to(device=device, dtype=dtype)
    bitmask = _random_bitmask(3, words, seed=vocab).to(device)
    results = {}
    for backend in ("triton", "reference"):
        out = logits.clone()
        with use_backend(backend):  # type: ignore[arg-type]
            apply_token_bitmask_inplace(out, bitmask)
        results[backend] = out
    assert torch.equal(results["triton"], results["reference"])
    assert torch.isinf(results["triton"]).any() and torch.isfinite(results["triton"]).any()


def test_bitmask_triton_masks_only_the_indexed_rows(device: torch.device) -> None:
    logits = torch.randn(4, 70, device=device)
    bitmask = _random_bitmask(4, 3, seed=1).to(device)
    indices = torch.tensor([3, 1], device=device, dtype=torch.int32)
    results = {}
    for backend in ("triton", "reference"):
        out = logits.clone()
        with use_backend(backend):  # type: ignore[arg-type]
            apply_token_bitmask_inplace(out, bitmask, indices)
        results[backend] = out
    assert torch.equal(results["triton"], results["reference"])
    assert torch.equal(results["triton"][[0, 2]], logits[[0, 2]])


CASES = [  # top_k, top_p, min_p
    (0, 1.0, 0.0),
    (1, 1.0, 0.0),
    (7, 1.0, 0.0),
    (0, 0.6, 0.0),
    (0, 0.95, 0.0),
    (0, 1.0, 0.1),
    (40, 0.8, 0.02),
    (3, 0.2, 0.0),
    (500, 0.9, 0.0),
]


@pytest.mark.parametrize("vocab", [50, 300])
def test_sampling_triton_matches_reference(device: torch.device, vocab: int) -> None:
    params = CASES * 2
    probs = softmax_probs(len(params), vocab, seed=vocab).to(device)
    gen = torch.Generator().manual_seed(vocab + 1)
    uniform = torch.rand(len(params), generator=gen).to(device)
    top_k = torch.tensor([p[0] for p in params], device=device, dtype=torch.int32)
    top_p = torch.tensor([p[1] for p in params], device=device)
    min_p = torch.tensor([p[2] for p in params], device=device)
    with use_backend("triton"):
        got = sample_from_probs(probs, top_k, top_p, min_p, uniform)
    with use_backend("reference"):
        want = sample_from_probs(probs, top_k, top_p, min_p, uniform)
    assert got.dtype == torch.int64
    assert got.tolist() == want.tolist()


def test_sampling_triton_keeps_ties_and_skips_zero_probabilities(device: torch.device) -> None:
    probs = torch.tensor([[0.0, 0.3, 0.2, 0.0, 0.2, 0.2, 0.1]] * 4, device=device)
    uniform = torch.tensor([0.0, 0.4, 0.7, 0.9999], device=device)
    top_k = torch.full((4,), 2, device=device)  # ties at 0.2 all stay: 0.3, 0.2, 0.2, 0.2
    ones, zeros = torch.ones(4, device=device), torch.zeros(4, device=device)
    with use_backend("triton"):
        got = sample_from_probs(probs, top_k, ones, zeros, uniform)
    assert got.tolist() == [1, 2, 4, 5]
