"""Torch references of the mixture-of-experts ops: routing alignment, grouped matmul, fused MoE.

A router picks k experts for each of T tokens (``topk_ids`` ``[T, k]``, -1 for an expert that
lives on another rank). :func:`moe_align` sorts the T * k (token, choice) pairs by expert, so
that each expert's rows form one contiguous slice; :func:`grouped_matmul` multiplies each slice
by its expert's weight; :func:`moe_mlp` composes the whole gated MLP from these, and is shared
by both backends (only the grouped matmul and the activation differ). :func:`moe_per_expert_loop`
is the naive baseline, written the way transformers writes it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixlm.kernels.reference.elementwise import silu_and_mul

MoePlan = tuple[torch.Tensor, torch.Tensor]
"""``(order, expert_offsets)`` as :func:`moe_align` returns them."""


def moe_align(topk_ids: torch.Tensor, num_experts: int) -> MoePlan:
    """Reference (and only implementation) of :func:`radixlm.kernels.moe_align`."""
    return _align("moe_align", topk_ids, num_experts)


def _align(op: str, topk_ids: torch.Tensor, num_experts: int) -> MoePlan:
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=device), offsets
    # -1 (and, until the check below raises, any id out of range) sorts after every expert.
    keys = torch.where((flat < 0) | (flat >= num_experts), num_experts, flat)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    torch.cumsum(counts[:num_experts], 0, out=offsets[1:])
    # The result's length depends on the ids: one read from the device, which also brings the
    # id range for the check.
    low, high, pairs = torch.stack([flat.min(), flat.max(), offsets[-1]]).tolist()
    if low < -1 or high >= num_experts:
        bad = low if low < -1 else high
        raise ValueError(
            f"{op}: topk_ids must be -1 (not on this rank) or an expert in "
            f"0..{num_experts - 1}, got {bad}"
        )
    order = torch.argsort(keys, stable=True)[:pairs]
    return order, offsets


def _bounds(op: str, expert_offsets: torch.Tensor, rows: int) -> list[int]:
    bounds = [int(b) for b in expert_offsets.tolist()]
    steps_ok = all(a <= b for a, b in itertools.pairwise(bounds))
    if bounds[0] != 0 or bounds[-1] != rows or not steps_ok:
        raise ValueError(
            f"{op}: expert_offsets must be non-decreasing from 0 to the number of rows "
            f"M = {rows}, got expert_offsets[0] = {bounds[0]}, expert_offsets[-1] = {bounds[-1]}"
        )
    return bounds


def grouped_matmul(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    max_rows_per_expert: int | None = None,
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.grouped_matmul` (``max_rows_per_expert`` is
    ignored): one matmul per expert with rows, on its contiguous slice."""
    bounds = _bounds("grouped_matmul", expert_offsets, x.shape[0])
    out = torch.empty(x.shape[0], weights.shape[1], dtype=x.dtype, device=x.device)
    for e, (a, b) in enumerate(itertools.pairwise(bounds)):
        if a == b:
            continue
        if x.dtype == torch.float32:
            torch.mm(x[a:b], weights[e].T, out=out[a:b])
        else:
            out[a:b] = (x[a:b].float() @ weights[e].float().T).to(x.dtype)
    return out


def moe_mlp(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    plan: MoePlan | None,
    *,
    matmul: Callable[..., torch.Tensor],
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The fused-MoE composition both backends run, with their own ``matmul`` (a grouped
    matmul) and ``activation`` (SiLU-and-mul): align, gather, gate/up, activation, down,
    weight, scatter-add. Intermediates are in hidden's dtype; the sum over a token's experts is
    accumulated in fp32 and rounded once."""
    tokens, k = topk_ids.shape
    order, offsets = _align("fused_moe", topk_ids, w13.shape[0]) if plan is None else plan
    token_of_pair = order // k
    # A router sends each token to an expert at most once: a bound that sizes the tiles.
    most_rows = min(tokens, order.shape[0])
    x = hidden.index_select(0, token_of_pair)
    gate_up = matmul(x, w13, offsets, max_rows_per_expert=most_rows)
    down = matmul(activation(gate_up), w2, offsets, max_rows_per_expert=most_rows)
    pair_weights = topk_weights.reshape(-1).index_select(0, order).float()
    out = torch.zeros(tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    out.index_add_(0, token_of_pair, down.float() * pair_weights[:, None])
    return out.to(hidden.dtype)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    plan: MoePlan | None = None,
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.fused_moe`."""
    return moe_mlp(
        hidden,
        w13,
        w2,
        topk_weights,
        topk_ids,
        plan,
        matmul=grouped_matmul,
        activation=silu_and_mul,
    )


def moe_per_expert_loop(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    plan: MoePlan | None = None,
) -> torch.Tensor:
    """The naive MoE block of transformers' Mixtral / Qwen-MoE experts, the benchmark's
    baseline for :func:`fused_moe` (same arguments; ``plan`` is ignored).

    For each expert hit: find its (token, choice) pairs with ``where(topk_ids == e)``, run its
    gate and up projections separately on those tokens in hidden's dtype, the down projection,
    scale by the routing weights and ``index_add_`` into the output (accumulated in fp32 and
    rounded once, so that it matches :func:`fused_moe` to rounding).
    """
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    hit = torch.unique(topk_ids[topk_ids >= 0]).tolist()
    for e in hit:
        token, choice = torch.where(topk_ids == e)
        current = hidden[token]
        gate = F.linear(current, w13[e, :inter])
        up = F.linear(current, w13[e, inter:])
        h = F.linear(F.silu(gate) * up, w2[e])
        h = h * topk_weights[token, choice, None].to(h.dtype)
        out.index_add_(0, token, h.float())
    return out.to(hidden.dtype)
