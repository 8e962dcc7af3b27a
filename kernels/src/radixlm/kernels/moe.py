"""Public mixture-of-experts ops: route alignment, grouped matmul and the fused MoE MLP.

A router gives each of T tokens k experts (``topk_ids`` ``[T, k]``) and weights
(``topk_weights``). :func:`moe_align` sorts the T * k (token, choice) pairs by expert;
:func:`grouped_matmul` multiplies each expert's contiguous rows by that expert's weight;
:func:`fused_moe` is the whole gated MLP of Mixtral / Qwen2-MoE / Qwen3-MoE experts built from
the two, as in SGLang's and vLLM's fused MoE. An id of -1 marks an expert that is not on this
rank (expert parallelism): that choice adds nothing.
"""

from __future__ import annotations

import torch

from radixlm.kernels import _checks, reference
from radixlm.kernels._backend import use_triton
from radixlm.kernels.reference.moe import MoePlan

__all__ = ["MoePlan", "fused_moe", "grouped_matmul", "moe_align"]


def _fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def _num_experts(op: str, num_experts: int) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        _fail(op, f"num_experts must be an int >= 1, got {num_experts!r}")


def _routing(op: str, topk_ids: torch.Tensor) -> None:
    _checks.rank(op, "topk_ids", topk_ids, 2, "[T, k]")
    _checks.integer(op, "topk_ids", topk_ids)


def _offsets(op: str, name: str, offsets: torch.Tensor, experts: int, source: str) -> None:
    _checks.integer(op, name, offsets)
    if offsets.dim() != 1 or offsets.shape[0] != experts + 1:
        _fail(
            op,
            f"{name} must have shape [E + 1] = [{experts + 1}] (E = {source}), got "
            f"{tuple(offsets.shape)}",
        )


def moe_align(topk_ids: torch.Tensor, num_experts: int) -> MoePlan:
    """Sort a batch's (token, choice) pairs by expert.

    Args:
        topk_ids: ``[T, k]`` int32 / int64, each token's k experts in ``0 .. num_experts - 1``,
            or -1 for an expert that is not on this rank.
        num_experts: E, the experts on this rank.

    Returns:
        ``(order, expert_offsets)``: ``order`` int64 ``[P]``, indices into the T * k pairs
        flattened row by row (token ``order // k``, choice ``order % k``), grouped by expert
        and in their original order within an expert, pairs of id -1 left out (so
        ``P <= T * k``); ``expert_offsets`` int64 ``[E + 1]``, expert e's pairs being
        ``order[expert_offsets[e]:expert_offsets[e + 1]]``. Plain torch on any device. P
        depends on the ids, so on a GPU this reads one small tensor from the device (a
        synchronisation), which also brings the ids' range: an id below -1 or >= E raises
        ``ValueError``.
    """
    op = "moe_align"
    _routing(op, topk_ids)
    _num_experts(op, num_experts)
    return reference.moe_align(topk_ids, num_experts)


def grouped_matmul(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    max_rows_per_expert: int | None = None,
) -> torch.Tensor:
    """``out[a:b] = x[a:b] @ weights[e].T`` for every expert e, with ``a, b =
    expert_offsets[e], expert_offsets[e + 1]``: the rows of x grouped by expert, each group
    times its expert's weight.

    Args:
        x: ``[M, K]`` float32 / float16 / bfloat16; any strides.
        weights: ``[E, N, K]`` in x's dtype (nn.Linear's ``[out, in]`` per expert); any
            strides.
        expert_offsets: ``[E + 1]`` int32 / int64, non-decreasing from 0 to M (empty experts
            allowed), e.g. from :func:`moe_align`.
        max_rows_per_expert: the most rows one expert has, if the caller knows it (a fused MoE
            knows T); only the Triton tile size follows it, so a wrong value costs speed, never
            correctness. Without it the tiles follow M / E. The reference ignores it.

    Returns:
        A new ``[M, N]`` tensor in x's dtype, accumulated in fp32. On the Triton path
        ``expert_offsets`` is not read on the host (no synchronisation) nor checked: rows
        outside ``expert_offsets[0] .. expert_offsets[E]`` are left unwritten there, while the
        reference raises ``ValueError``.
    """
    op = "grouped_matmul"
    _checks.rank(op, "x", x, 2, "[M, K]")
    _checks.floating(op, "x", x)
    _checks.rank(op, "weights", weights, 3, "[E, N, K]")
    if weights.dtype != x.dtype:
        _fail(op, f"weights must have x's dtype {x.dtype}, got {weights.dtype}")
    if weights.shape[0] < 1 or weights.shape[2] != x.shape[1]:
        _fail(
            op,
            f"weights must have shape [E, N, K] with E >= 1 and K = {x.shape[1]} (x.shape[1]), "
            f"got {tuple(weights.shape)}",
        )
    _offsets(op, "expert_offsets", expert_offsets, weights.shape[0], "weights.shape[0]")
    if max_rows_per_expert is not None and max_rows_per_expert < 0:
        _fail(op, f"max_rows_per_expert must be >= 0 (or None), got {max_rows_per_expert}")
    _checks.same_device(op, {"x": x, "weights": weights, "expert_offsets": expert_offsets})
    if use_triton(x):
        from radixlm.kernels import triton_ops

        impl = triton_ops.grouped_matmul
    else:
        impl = reference.grouped_matmul
    return impl(x, weights, expert_offsets, max_rows_per_expert=max_rows_per_expert)


def _plan(op: str, plan: MoePlan, pairs: int, experts: int) -> None:
    if (
        not isinstance(plan, tuple)
        or len(plan) != 2
        or not all(isinstance(t, torch.Tensor) for t in plan)
    ):
        _fail(op, "plan must be the (order, expert_offsets) pair that moe_align returns")
    order, offsets = plan
    _checks.integer(op, "plan's order", order)
    if order.dim() != 1 or order.shape[0] > pairs:
        _fail(
            op,
            f"plan's order must have shape [P] with P <= T * k = {pairs}, got "
            f"{tuple(order.shape)}: build the plan with moe_align(topk_ids, E)",
        )
    _offsets(op, "plan's expert_offsets", offsets, experts, "w13.shape[0]")


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    plan: MoePlan | None = None,
) -> torch.Tensor:
    """The MoE MLP: ``out[t] = sum over t's choices c with an id e >= 0 of topk_weights[t, c]
    * (w2[e] @ (silu(g) * u))``, where ``[g; u] = w13[e] @ hidden[t]``.

    Composed from :func:`moe_align`, a gather of each pair's hidden row, :func:`grouped_matmul`
    with w13, :func:`silu_and_mul`, :func:`grouped_matmul` with w2, the pair's weight and a
    scatter-add back to the tokens; the backends differ only in the grouped matmul and the
    activation.

    Args:
        hidden: ``[T, H]`` float32 / float16 / bfloat16; any strides.
        w13: ``[E, 2 * I, H]`` in hidden's dtype, each expert's gate rows then its up rows
            (transformers' stacked ``gate_up_proj``; Mixtral's w1 over w3).
        w2: ``[E, H, I]`` in hidden's dtype, each expert's down projection.
        topk_weights: ``[T, k]`` float32 / float16 / bfloat16, the routing weights (already
            normalised, if the model normalises them).
        topk_ids: ``[T, k]`` int32 / int64, each choice's expert in ``0 .. E - 1`` or -1 (not
            on this rank).
        plan: ``moe_align(topk_ids, E)`` if the caller already has it; otherwise built here.

    Returns:
        A new ``[T, H]`` tensor in hidden's dtype: the per-pair intermediates are in hidden's
        dtype (fp32 accumulation inside each matmul), the sum over a token's choices is
        accumulated in fp32 and rounded once. Tokens whose choices are all -1 get zeros.
        Building the plan reads one small tensor from the device (see :func:`moe_align`).
    """
    op = "fused_moe"
    _checks.rank(op, "hidden", hidden, 2, "[T, H]")
    _checks.floating(op, "hidden", hidden)
    tokens, width = hidden.shape
    _checks.rank(op, "w13", w13, 3, "[E, 2 * I, H]")
    _checks.rank(op, "w2", w2, 3, "[E, H, I]")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != hidden.dtype:
            _fail(op, f"{name} must have hidden's dtype {hidden.dtype}, got {w.dtype}")
    experts, inter2, _ = w13.shape
    if experts < 1 or inter2 % 2 != 0 or w13.shape[2] != width:
        _fail(
            op,
            f"w13 must have shape [E, 2 * I, H] with E >= 1, an even 2 * I and H = {width} "
            f"(hidden.shape[1]), got {tuple(w13.shape)}",
        )
    if tuple(w2.shape) != (experts, width, inter2 // 2):
        _fail(
            op,
            f"w2 must have shape [E, H, I] = [{experts}, {width}, {inter2 // 2}] (from w13 and "
            f"hidden), got {tuple(w2.shape)}",
        )
    _routing(op, topk_ids)
    if topk_ids.shape[0] != tokens:
        _fail(
            op, f"topk_ids must have T = {tokens} rows (hidden.shape[0]), got {topk_ids.shape[0]}"
        )
    _checks.rank(op, "topk_weights", topk_weights, 2, "[T, k]")
    _checks.floating(op, "topk_weights", topk_weights)
    if topk_weights.shape != topk_ids.shape:
        _fail(
            op,
            f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got "
            f"{tuple(topk_weights.shape)}",
        )
    tensors: dict[str, torch.Tensor | None] = {
        "hidden": hidden,
        "w13": w13,
        "w2": w2,
        "topk_weights": topk_weights,
        "topk_ids": topk_ids,
    }
    if plan is not None:
        _plan(op, plan, topk_ids.numel(), experts)
        tensors.update({"plan's order": plan[0], "plan's expert_offsets": plan[1]})
    _checks.same_device(op, tensors)
    if use_triton(hidden):
        from radixlm.kernels import triton_ops

        impl = triton_ops.fused_moe
    else:
        impl = reference.fused_moe
    return impl(hidden, w13, w2, topk_weights, topk_ids, plan=plan)
