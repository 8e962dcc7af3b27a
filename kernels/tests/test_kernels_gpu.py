"""Triton kernels on CUDA at serving shapes against their references (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from kernels_test_helpers import TOLERANCES, paged_kv, softmax_probs

import radixlm.kernels as rk

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("needs_triton")]

HEAD_CONFIGS = {"llama3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128)}


def _both(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    with rk.use_backend("triton"):
        got = fn(*args, **kwargs)
    with rk.use_backend("reference"):
        want = fn(*args, **kwargs)
    return got, want


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[want.dtype])


def test_auto_picks_triton_for_cuda_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixlm.kernels import reference

    monkeypatch.setattr(reference, "silu_and_mul", lambda x: pytest.fail("reference was called"))
    with rk.use_backend("auto"):
        rk.silu_and_mul(torch.randn(4, 64, device="cuda"))


@pytest.mark.parametrize("model", list(HEAD_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_at_serving_shapes(model: str, dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim = HEAD_CONFIGS[model]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 4096, (32,), generator=gen).tolist()
    kv = paged_kv(lengths, kv_heads, head_dim, 16, dtype, "cuda")
    q = torch.randn(32, heads, head_dim, device="cuda", dtype=dtype)
    seq_lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    got, want = _both(
        rk.decode_attention, q, kv.k_pool, kv.v_pool, kv.req_to_token, seq_lens, kv.req_pool_indices
    )
    _close(got, want)


def test_decode_long_context_split_k() -> None:
    heads, kv_heads, head_dim = HEAD_CONFIGS["llama3-8b"]
    kv = paged_kv([32768], kv_heads, head_dim, 16, torch.bfloat16, "cuda")
    q = torch.randn(1, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor([32768], device="cuda")
    for splits in (None, 16):
        got, want = _both(
            rk.decode_attention,
            q,
            kv.k_pool,
            kv.v_pool,
            kv.req_to_token,
            seq_lens,
            kv.req_pool_indices,
            num_kv_splits=splits,
            sliding_window=4096,
            logit_cap=50.0,
        )
        _close(got, want)


@pytest.mark.parametrize("model", list(HEAD_CONFIGS))
def test_extend_at_serving_shapes(model: str) -> None:
    heads, kv_heads, head_dim = HEAD_CONFIGS[model]
    prefixes, extends = [0, 1000, 517, 2047], [512, 1, 300, 129]
    lengths = [p + e for p, e in zip(prefixes, extends, strict=True)]
    kv = paged_kv(lengths, kv_heads, head_dim, 16, torch.bfloat16, "cuda")
    q = torch.randn(sum(extends), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    got, want = _both(
        rk.extend_attention,
        q,
        kv.k_pool,
        kv.v_pool,
        kv.req_to_token,
        torch.tensor(prefixes, device="cuda"),
        torch.tensor(extends, device="cuda"),
        kv.req_pool_indices,
    )
    _close(got, want)


def test_elementwise_at_serving_shapes() -> None:
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
    _close(*_both(rk.rms_norm, x, w))
    (a, b), (c, d) = _both(rk.fused_add_rms_norm, x, r, w)
    _close(a, c)
    _close(b, d)
    _close(
        *_both(rk.silu_and_mul, torch.randn(4096, 2 * 14336, device="cuda", dtype=torch.bfloat16))
    )
    inv = 1.0 / (500000 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    angles = torch.arange(8192, device="cuda").float()[:, None] * inv[None, :]
    q = torch.randn(4096, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (4096,), device="cuda")
    (qa, ka), (qb, kb) = _both(rk.rotary_embedding, q, k, angles.cos(), angles.sin(), pos)
    _close(qa, qb)
    _close(ka, kb)


def test_logits_ops_at_vocab_128k() -> None:
    vocab, batch = 128256, 64
    logits = torch.randn(batch, vocab, device="cuda")
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), device="cuda").int()
    outs = []
    for backend in ("triton", "reference"):
        out = logits.clone()
        with rk.use_backend(backend):  # type: ignore[arg-type]
            rk.apply_token_bitmask_inplace(out, bitmask)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    probs = softmax_probs(batch, vocab, seed=0, sharpness=4.0).cuda()
    top_k = torch.randint(0, 100, (batch,), device="cuda")
    top_p = torch.rand(batch, device="cuda") * 0.5 + 0.5
    min_p = torch.rand(batch, device="cuda") * 0.1
    uniform = torch.rand(batch, device="cuda")
    got, want = _both(rk.sample_from_probs, probs, top_k, top_p, min_p, uniform)
    # Summation order may move a draw that sits on a boundary; allow a stray row.
    assert (got != want).sum().item() <= 1
