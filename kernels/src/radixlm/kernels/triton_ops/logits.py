"""Triton kernels on the logits: token bitmask, and sampling with top-k / top-p / min-p."""

# Triton reads kernel parameter annotations itself, so @triton.jit functions stay unannotated.
# mypy: disable-error-code="untyped-decorator, no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.triton_ops._common import INTERPRETED, next_pow2


@triton.jit
def _bitmask_kernel(
    Logits,
    Bitmask,
    Rows,
    stride_l,
    stride_b,
    VOCAB: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    i = tl.program_id(0)
    row = i.to(tl.int64)
    if HAS_ROWS:
        row = tl.load(Rows + i).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < VOCAB
    words = tokens // 32
    covered = words < WORDS
    packed = tl.load(Bitmask + row * stride_b + words, mask=in_vocab & covered, other=0)
    allowed = ((packed >> (tokens % 32)) & 1) != 0
    tl.store(Logits + row * stride_l + tokens, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask_inplace(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | None = None,
) -> None:
    """Triton version of :func:`radixlm.kernels.apply_token_bitmask_inplace`."""
    rows, vocab = logits.shape
    count = rows if indices is None else indices.shape[0]
    if count == 0 or vocab == 0:
        return
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1
    block = min(next_pow2(vocab), 4096)
    _bitmask_kernel[(count, triton.cdiv(vocab, block))](
        logits,
        bitmask,
        indices if indices is not None else bitmask,
        logits.stride(0),
        bitmask.stride(0),
        VOCAB=vocab,
        WORDS=bitmask.shape[-1],
        BLOCK=block,
        HAS_ROWS=indices is not None,
    )


@triton.jit
def _count_at_least(P, vocab, t_bits, floor, BLOCK: tl.constexpr):
    """How many probabilities are >= both the float with bits ``t_bits`` and ``floor``."""
    t = t_bits.to(tl.float32, bitcast=True)
    count = tl.zeros([BLOCK], tl.int32)
    for v0 in range(0, vocab, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        p = tl.load(P + offs, mask=offs < vocab, other=-1.0)
        count += ((p >= t) & (p >= floor)).to(tl.int32)
    return tl.sum(count, 0)


@triton.jit
def _mass_at_least(P, vocab, t_bits, floor, BLOCK: tl.constexpr):
    """Probability mass of the tokens >= both the float with bits ``t_bits`` and ``floor``."""
    t = t_bits.to(tl.float32, bitcast=True)
    mass = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, vocab, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        p = tl.load(P + offs, mask=offs < vocab, other=-1.0)
        mass += tl.where((p >= t) & (p >= floor), p, 0.0)
    return tl.sum(mass, 0)


@triton.jit
def _sample_kernel(
    Probs,
    TopK,
    TopP,
    MinP,
    Uniform,
    Out,
    stride_p,
    vocab,
    BLOCK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    row = tl.program_id(0)
    P = Probs + row.to(tl.int64) * stride_p
    top_k = tl.load(TopK + row).to(tl.int32)
    top_p = tl.load(TopP + row).to(tl.float32)
    min_p = tl.load(MinP + row).to(tl.float32)
    u = tl.load(Uniform + row).to(tl.float32)

    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for v0 in range(0, vocab, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.load(P + offs, mask=offs < vocab, other=float("-inf")))
    p_max = tl.max(top, 0)
    max_bits = p_max.to(tl.int32, bitcast=True)

    # Thresholds are found by bisection over the bit patterns of non-negative floats (which
    # sort like the floats), so each is exactly one of the row's probabilities: no sort needed.
    t_k = p_max * 0.0
    if (top_k > 0) & (top_k < vocab):
        lo = max_bits * 0
        hi = max_bits
        for _ in range(SEARCH_STEPS):
            mid = lo + (hi - lo + 1) // 2
            enough = _count_at_least(P, vocab, mid, 0.0, BLOCK) >= top_k
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid - 1)
        t_k = lo.to(tl.float32, bitcast=True)
    t_p = p_max * 0.0
    if top_p < 1.0:
        target = top_p * _mass_at_least(P, vocab, max_bits * 0, t_k, BLOCK)
        lo = t_k.to(tl.int32, bitcast=True)
        hi = max_bits
        for _ in range(SEARCH_STEPS):
            mid = lo + (hi - lo + 1) // 2
            enough = _mass_at_least(P, vocab, mid, t_k, BLOCK) >= target
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid - 1)
        t_p = lo.to(tl.float32, bitcast=True)
    threshold = tl.maximum(tl.maximum(t_k, t_p), tl.maximum(min_p, 0.0) * p_max)

    total = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, vocab, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        p = tl.load(P + offs, mask=offs < vocab, other=0.0)
        total += tl.where(p >= threshold, p, 0.0)
    draw = u * tl.sum(total, 0)

    # Inverse CDF in token order: the first token whose running mass passes the draw.
    running = p_max * 0.0
    chosen = tl.zeros([BLOCK], tl.int32)
    last = tl.zeros([BLOCK], tl.int32)
    for v0 in range(0, vocab, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        in_vocab = offs < vocab
        p = tl.load(P + offs, mask=in_vocab, other=0.0)
        w = tl.where(p >= threshold, p, 0.0)
        cumulative = running + tl.cumsum(w, 0)
        chosen += (in_vocab & (cumulative <= draw)).to(tl.int32)
        last = tl.maximum(last, tl.where(w > 0.0, offs, 0))
        running += tl.sum(w, 0)
    token = tl.minimum(tl.sum(chosen, 0), tl.max(last, 0))
    tl.store(Out + row, token.to(tl.int64))


def sample_from_probs(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """Triton version of :func:`radixlm.kernels.sample_from_probs`."""
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows == 0:
        return out
    if probs.stride(-1) != 1 or probs.dtype != torch.float32:
        probs = probs.float().contiguous()
    block = min(next_pow2(vocab), 256 if INTERPRETED else 4096)
    # 31 halvings cover every non-negative float below 2**31 bit patterns (all finite ones).
    _sample_kernel[(rows,)](
        probs,
        top_k,
        top_p,
        min_p,
        uniform,
        out,
        probs.stride(0),
        vocab,
        BLOCK=block,
        SEARCH_STEPS=31,
        num_warps=8 if block >= 2048 else 4,
    )
    return out
