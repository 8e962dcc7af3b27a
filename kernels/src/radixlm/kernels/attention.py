"""Public attention entry points: paged decode, extend over a cached prefix, and the KV store."""

from __future__ import annotations

import torch

from radixlm.kernels import _checks, reference
from radixlm.kernels._backend import use_triton


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
    """Attention of one new query token per request over its K/V in a paged pool.

    Args:
        q: ``[batch, num_heads, head_dim]``, float32 / float16 / bfloat16.
        k_pool, v_pool: ``[num_slots, num_kv_heads, head_dim]``, q's dtype; the token-granular
            KV pool. ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA, any ratio).
        req_to_token: ``[rows, max_context]`` int32/int64; ``req_to_token[row, i]`` is the slot
            of the request's token at position ``i``. Pages of any size are just runs of slots.
        seq_lens: ``[batch]`` int; tokens in the context of each request, the current one
            included (its K/V must already be stored, see :func:`store_kv`). 0 gives zeros.
        req_pool_indices: ``[batch]`` int, the row of ``req_to_token`` of each request;
            ``None`` means row ``b`` for request ``b``.
        scale: softmax scale; ``None`` means ``1 / sqrt(head_dim)``.
        sliding_window: attend only to the last ``sliding_window`` tokens (the current token
            included); ``None`` or 0 disables it.
        logit_cap: soft-cap ``cap * tanh(score / cap)`` applied to the scaled scores
            (Gemma-2 style); ``None`` or 0 disables it.
        num_kv_splits: split-K factor of the Triton kernel (``None`` picks one from the shapes);
            the reference ignores it.

    Returns:
        ``[batch, num_heads, head_dim]`` in q's dtype (a new tensor). Softmax runs in fp32.
        Performs no host synchronisation on the Triton path.
    """
    batch = q.shape[0] if q.dim() == 3 else -1
    _checks.attention(
        "decode_attention",
        q,
        k_pool,
        v_pool,
        req_to_token,
        {"seq_lens": seq_lens},
        req_pool_indices,
        batch,
    )
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"decode_attention: num_kv_splits must be >= 1, got {num_kv_splits}")
    if use_triton(q):
        from radixlm.kernels import triton_ops

        impl = triton_ops.decode_attention
    else:
        impl = reference.decode_attention
    return impl(
        q,
        k_pool,
        v_pool,
        req_to_token,
        seq_lens,
        req_pool_indices,
        scale=scale,
        sliding_window=sliding_window,
        logit_cap=logit_cap,
        num_kv_splits=num_kv_splits,
    )


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
    """Attention of a ragged batch of new tokens over a cached prefix (prefill / extend).

    Request ``b`` has ``prefix_lens[b]`` tokens already in the pool and ``extend_lens[b]`` new
    tokens whose queries are rows ``sum(extend_lens[:b]) ...`` of ``q``. A new token at
    position ``prefix_len + i`` attends to every prefix token and causally to new tokens
    ``0..i``. The K/V of *all* ``prefix_len + extend_len`` tokens must already be in the pool
    (call :func:`store_kv` for the new ones first).

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` with ``num_tokens == sum(extend_lens)``.
        k_pool, v_pool: ``[num_slots, num_kv_heads, head_dim]``, q's dtype.
        req_to_token: ``[rows, max_context]`` int32/int64 position -> slot table.
        prefix_lens, extend_lens: ``[batch]`` int. A prefix may be empty; an extend may be 0.
        req_pool_indices: ``[batch]`` int rows of ``req_to_token``; ``None`` means row ``b``.
        scale, sliding_window, logit_cap: as in :func:`decode_attention` (the window is
            counted back from each query's own position).
        max_extend_len: ``max(extend_lens)`` if the caller knows it; otherwise the Triton path
            reads it from the device (one synchronisation). The reference ignores it.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in q's dtype (a new tensor).
    """
    batch = prefix_lens.shape[0] if prefix_lens.dim() == 1 else -1
    _checks.attention(
        "extend_attention",
        q,
        k_pool,
        v_pool,
        req_to_token,
        {"prefix_lens": prefix_lens, "extend_lens": extend_lens},
        req_pool_indices,
        batch,
    )
    if use_triton(q):
        from radixlm.kernels import triton_ops

        impl = triton_ops.extend_attention
    else:
        impl = reference.extend_attention
    return impl(
        q,
        k_pool,
        v_pool,
        req_to_token,
        prefix_lens,
        extend_lens,
        req_pool_indices,
        scale=scale,
        sliding_window=sliding_window,
        logit_cap=logit_cap,
        max_extend_len=max_extend_len,
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write new keys and values into the KV pool, in place: ``k_pool[slots[t]] = k[t]``.

    Args:
        k, v: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype (cast to the pool's).
        k_pool, v_pool: ``[num_slots, num_kv_heads, head_dim]``, contiguous; mutated.
        slots: ``[num_tokens]`` int32/int64, distinct slot ids.

    Returns:
        None. Only the rows named by ``slots`` change.
    """
    op = "store_kv"
    _checks.rank(op, "k", k, 3, "[num_tokens, num_kv_heads, head_dim]")
    _checks.rank(op, "k_pool", k_pool, 3, "[num_slots, num_kv_heads, head_dim]")
    if v.shape != k.shape:
        raise ValueError(f"{op}: v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    if v_pool.shape != k_pool.shape:
        raise ValueError(
            f"{op}: v_pool shape {tuple(v_pool.shape)} != k_pool's {tuple(k_pool.shape)}"
        )
    if k.shape[1:] != k_pool.shape[1:]:
        raise ValueError(
            f"{op}: k rows {tuple(k.shape[1:])} != pool rows {tuple(k_pool.shape[1:])}"
        )
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError(f"{op}: k_pool and v_pool must be contiguous")
    _checks.integer(op, "slots", slots)
    _checks.length(op, "slots", slots, k.shape[0], "num_tokens")
    _checks.same_device(op, {"k": k, "v": v, "k_pool": k_pool, "v_pool": v_pool, "slots": slots})
    if use_triton(k_pool):
        from radixlm.kernels import triton_ops

        triton_ops.store_kv(k, v, k_pool, v_pool, slots)
    else:
        reference.store_kv(k, v, k_pool, v_pool, slots)
