"""Torch references for paged attention and the KV store (the CPU path of the runtime)."""

from __future__ import annotations

import math

import torch


def _row_indices(
    req_pool_indices: torch.Tensor | None, batch: int, like: torch.Tensor
) -> torch.Tensor:
    if req_pool_indices is None:
        return torch.arange(batch, device=like.device)
    return req_pool_indices.long()


def _soft_cap(scores: torch.Tensor, logit_cap: float | None) -> torch.Tensor:
    if logit_cap is not None and logit_cap > 0:
        return logit_cap * torch.tanh(scores / logit_cap)
    return scores


def _masked_softmax_av(scores: torch.Tensor, mask: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(scores | mask) @ v in fp32; rows with no allowed key give zeros."""
    scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    weights = weights / torch.where(denom > 0, denom, torch.ones_like(denom))
    return weights @ v


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.decode_attention` (``num_kv_splits`` is ignored)."""
    del num_kv_splits  # the reference never splits
    batch, num_heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    group = num_heads // kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if batch == 0:
        return torch.empty_like(q)
    lens = seq_lens.long()
    max_len = int(lens.max().item())
    out_dtype = q.dtype
    if max_len == 0:
        return torch.zeros_like(q)
    rows = _row_indices(req_pool_indices, batch, q)
    positions = torch.arange(max_len, device=q.device)
    valid = positions[None, :] < lens[:, None]  # [batch, max_len]
    if sliding_window is not None and sliding_window > 0:
        valid &= positions[None, :] >= (lens[:, None] - sliding_window)
    slots = req_to_token[rows, :max_len].long().masked_fill(~valid, 0)
    k = k_pool[slots].float()  # [batch, max_len, kv_heads, head_dim]
    v = v_pool[slots].float()
    qg = q.float().view(batch, kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    scores = _soft_cap(scores, logit_cap)
    mask = valid[:, None, None, :]
    out = _masked_softmax_av(scores, mask.expand_as(scores), v.permute(0, 2, 1, 3))
    return out.reshape(batch, num_heads, head_dim).to(out_dtype)


def extend_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_pool_indices: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.extend_attention` (``max_extend_len`` is ignored)."""
    del max_extend_len
    _, num_heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    group = num_heads // kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    batch = prefix_lens.shape[0]
    rows = _row_indices(req_pool_indices, batch, q).tolist()
    prefixes = prefix_lens.tolist()
    extends = extend_lens.tolist()
    out = torch.empty_like(q)
    start = 0
    for row, prefix, extend in zip(rows, prefixes, extends, strict=True):
        if extend == 0:
            continue
        total = prefix + extend
        slots = req_to_token[row, :total].long()
        k = k_pool[slots].float().permute(1, 0, 2)[:, None]  # [kv_heads, 1, total, head_dim]
        v = v_pool[slots].float().permute(1, 0, 2)[:, None]
        qr = q[start : start + extend].float().view(extend, kv_heads, group, head_dim)
        qr = qr.permute(1, 2, 0, 3)  # [kv_heads, group, extend, head_dim]
        scores = _soft_cap(qr @ k.transpose(-1, -2) * scale, logit_cap)
        q_pos = torch.arange(prefix, total, device=q.device)[:, None]
        k_pos = torch.arange(total, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None and sliding_window > 0:
            mask &= k_pos > q_pos - sliding_window
        o = _masked_softmax_av(scores, mask.expand_as(scores), v)  # [kv_heads, group, extend, d]
        out[start : start + extend] = o.permute(2, 0, 1, 3).reshape(extend, num_heads, head_dim)
        start += extend
    return out


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Reference of :func:`radixlm.kernels.store_kv`."""
    index = slots.long()
    k_pool[index] = k.to(k_pool.dtype)
    v_pool[index] = v.to(v_pool.dtype)
