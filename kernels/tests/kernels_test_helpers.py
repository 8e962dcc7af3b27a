"""Builders and plain oracles shared by the kernel tests (obviously correct, slow code)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@dataclass
class PagedKV:
    """A KV pool with requests laid out page by page, in shuffled pages."""

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor


def paged_kv(
    lengths: list[int],
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> PagedKV:
    """Random K/V for requests of the given total lengths, allocated in pages of
    ``page_size`` slots from a shuffled free list; rows of ``req_to_token`` are shuffled too."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = [math.ceil(n / page_size) for n in lengths]
    num_pages = sum(pages_per_req) + 3  # a few pages nobody owns
    num_slots = num_pages * page_size
    k_pool = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    free_pages = torch.randperm(num_pages, generator=gen).tolist()
    rows = len(lengths) + 2
    max_context = max([*lengths, 1]) + page_size + 3
    req_to_token = torch.zeros(rows, max_context, dtype=torch.int32)
    req_pool_indices = torch.randperm(rows, generator=gen)[: len(lengths)]
    for b, n in enumerate(lengths):
        pages = [free_pages.pop() for _ in range(pages_per_req[b])]
        slots = [p * page_size + i for p in pages for i in range(page_size)][:n]
        req_to_token[req_pool_indices[b], :n] = torch.tensor(slots, dtype=torch.int32)
    return PagedKV(
        k_pool.to(device),
        v_pool.to(device),
        req_to_token.to(device),
        req_pool_indices.to(device=device, dtype=torch.int32),
    )


def dense_attention(
    q_rows: torch.Tensor,
    q_positions: list[int],
    kv: PagedKV,
    request: int,
    context_len: int,
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
) -> torch.Tensor:
    """Masked dense softmax over the gathered K/V of one request, head by head, in float64.

    ``q_rows``: ``[n, num_heads, head_dim]`` at absolute ``q_positions``.
    """
    row = int(kv.req_pool_indices[request])
    slots = kv.req_to_token[row, :context_len].long().cpu()
    k = kv.k_pool.cpu()[slots].double()  # [context, kv_heads, d]
    v = kv.v_pool.cpu()[slots].double()
    num_heads = q_rows.shape[1]
    group = num_heads // k.shape[1]
    out = torch.zeros(q_rows.shape, dtype=torch.float64)
    for i, pos in enumerate(q_positions):
        for h in range(num_heads):
            keys = [
                j
                for j in range(context_len)
                if j <= pos and (not sliding_window or j > pos - sliding_window)
            ]
            if not keys:
                continue
            scores = torch.stack([q_rows[i, h].cpu().double() @ k[j, h // group] for j in keys])
            scores = scores * scale
            if logit_cap:
                scores = logit_cap * torch.tanh(scores / logit_cap)
            weights = torch.softmax(scores, dim=0)
            out[i, h] = sum(w * v[j, h // group] for w, j in zip(weights, keys, strict=True))
    return out


def build_req_to_token_by_hand(lengths: list[int], page_size: int) -> torch.Tensor:
    """Pages handed out in order: request 0 gets pages 0.., request 1 the next ones..."""
    table = torch.zeros(len(lengths), max([*lengths, 1]), dtype=torch.int64)
    next_page = 0
    for b, n in enumerate(lengths):
        for i in range(n):
            if i % page_size == 0:
                page = next_page
                next_page += 1
            table[b, i] = page * page_size + i % page_size
    return table


def softmax_probs(rows: int, vocab: int, seed: int, sharpness: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=gen) * sharpness, dim=-1)


def oracle_sample(
    probs: list[float], top_k: int, top_p: float, min_p: float, uniform: float
) -> int:
    """One row, the documented rule spelled out in Python floats."""
    vocab = len(probs)
    ordered = sorted(probs, reverse=True)
    t_k = ordered[top_k - 1] if 0 < top_k < vocab else 0.0
    survivors = sorted((p for p in probs if p >= t_k), reverse=True)
    t_p = 0.0
    if top_p < 1.0:
        target = top_p * sum(survivors)
        running = 0.0
        for p in survivors:
            running += p
            if running >= target:
                t_p = p
                break
    threshold = max(t_k, t_p, max(min_p, 0.0) * ordered[0])
    kept = [p if p >= threshold else 0.0 for p in probs]
    draw = uniform * sum(kept)
    running = 0.0
    last = 0
    for i, p in enumerate(kept):
        if p > 0:
            last = i
        running += p
        if running > draw and p > 0:
            return i
    return last
