"""Public entry points on logits and probabilities: token bitmask, greedy tokens, sampling."""

from __future__ import annotations

import torch

from radixlm.kernels import _checks, reference
from radixlm.kernels._backend import use_triton


def apply_token_bitmask_inplace(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | None = None,
) -> None:
    """Set disallowed logits to ``-inf``, in place, from packed bitmask rows.

    The layout is xgrammar's: bit ``j`` (least significant first) of word ``i`` of a row
    covers token ``32 * i + j``; a set bit means allowed. Tokens past ``32 * words`` (a logits
    row wider than the mask) are disallowed.

    Args:
        logits: ``[batch, vocab]`` float32 / float16 / bfloat16, unit stride on vocab; mutated.
        bitmask: ``[batch, words]`` int32 with ``words == ceil(vocab / 32)`` normally.
        indices: ``[n]`` int rows to mask (row ``r`` of ``bitmask`` applies to row ``r`` of
            ``logits``); ``None`` masks every row. Other rows are left unchanged.
    """
    op = "apply_token_bitmask_inplace"
    _checks.rank(op, "logits", logits, 2, "[batch, vocab]")
    _checks.floating(op, "logits", logits)
    _checks.rank(op, "bitmask", bitmask, 2, "[batch, words]")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"{op}: bitmask must be int32, got {bitmask.dtype}")
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"{op}: bitmask has {bitmask.shape[0]} rows, logits {logits.shape[0]}")
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
        raise ValueError(f"{op}: logits and bitmask need a unit stride on their last dimension")
    if indices is not None:
        _checks.integer(op, "indices", indices)
        _checks.rank(op, "indices", indices, 1, "[n]")
    _checks.same_device(op, {"logits": logits, "bitmask": bitmask, "indices": indices})
    if use_triton(logits):
        from radixlm.kernels import triton_ops

        triton_ops.apply_token_bitmask_inplace(logits, bitmask, indices)
    else:
        reference.apply_token_bitmask_inplace(logits, bitmask, indices)


def _cpu_rows(logits: torch.Tensor) -> bool:
    """Whether radixlm's C kernels take these rows: float32 on the CPU, at least one value,
    a unit stride along a row, and the kernels built here."""
    if not (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.shape[1] > 0
        and logits.stride(1) == 1
    ):
        return False
    from radixlm.kernels import cpu

    return cpu.available()


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: ``logits.argmax(dim=-1)``, the same ids (the first of equal largest
    values; a row's first NaN where it has one).

    On the CPU, float32 rows with a unit stride go through radixlm's C kernel
    (`kernels.cpu.argmax_rows`, sixteen values at a time: torch's CPU argmax compares one at a
    time, about 4 ms for 32 rows of a 151,936-token vocabulary on one thread); elsewhere it is
    torch's argmax.

    Args:
        logits: ``[batch, vocab]`` floating point.

    Returns:
        ``[batch]`` int64 token ids.
    """
    op = "greedy_tokens"
    _checks.rank(op, "logits", logits, 2, "[batch, vocab]")
    _checks.floating(op, "logits", logits)
    if _cpu_rows(logits):
        from radixlm.kernels import cpu

        return cpu.argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample_tokens(
    logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """One token per row drawn from ``softmax(logits / temperatures[:, None])`` by inverse
    CDF: the first token, in id order, whose running mass exceeds ``uniforms`` x the row's
    total mass (no top-k, top-p or min-p: see `sample_from_probs`).

    On the CPU, float32 rows with a unit stride go through radixlm's C kernel
    (`kernels.cpu.sample_rows`: two passes over a row, where torch's softmax, cumsum and
    searchsorted make five, 10 ms for 32 rows of a 151,936-token vocabulary on one
    thread); elsewhere torch's. The two compute the same draw up to float32 rounding (the
    exponentials and the order of the sums): a uniform within a rounding of a boundary
    between two tokens may pick the other one. A -inf logit is never drawn; a row without
    mass (all -inf or NaN) gives the last token.

    Args:
        logits: ``[batch, vocab]`` floating point.
        temperatures: ``[batch]`` float32, each > 0.
        uniforms: ``[batch]`` float32 in [0, 1).

    Returns:
        ``[batch]`` int64 token ids.
    """
    op = "sample_tokens"
    _checks.rank(op, "logits", logits, 2, "[batch, vocab]")
    _checks.floating(op, "logits", logits)
    _checks.rank(op, "temperatures", temperatures, 1, "[batch]")
    _checks.rank(op, "uniforms", uniforms, 1, "[batch]")
    if temperatures.shape[0] != logits.shape[0] or uniforms.shape[0] != logits.shape[0]:
        raise ValueError(
            f"{op}: {logits.shape[0]} rows of logits, {temperatures.shape[0]} temperatures, "
            f"{uniforms.shape[0]} uniforms"
        )
    if _cpu_rows(logits):
        from radixlm.kernels import cpu

        return cpu.sample_rows(logits, temperatures.float(), uniforms.float())
    return reference.sample_tokens(logits, temperatures, uniforms)


def sample_from_probs(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """Draw one token per row from probabilities filtered by top-k, top-p and min-p.

    The filters keep the tokens with ``p >= threshold``, where the threshold is the largest of
    the k-th largest probability (top-k), the nucleus cut-off computed over the top-k
    survivors (the smallest probability among the most likely tokens whose mass reaches
    ``top_p`` of the survivors' mass), and ``min_p * max(p)``. Tokens tied at the threshold all
    stay. The token is then found by inverse CDF in token-id order: the first token whose
    running kept mass exceeds ``uniform * kept_mass``. The same draws give the same tokens on
    both backends (up to float rounding at a boundary).

    Args:
        probs: ``[batch, vocab]`` non-negative (normalised or not; computed in fp32).
        top_k: ``[batch]`` int; ``<= 0`` or ``>= vocab`` disables it.
        top_p: ``[batch]`` float in ``(0, 1]``; ``1`` disables it.
        min_p: ``[batch]`` float in ``[0, 1]``; ``0`` disables it.
        uniform: ``[batch]`` float draws in ``[0, 1)`` (the caller owns the RNG and the seeds).

    Returns:
        ``[batch]`` int64 token ids. A token of zero probability is never drawn (an all-zero
        row returns 0).
    """
    op = "sample_from_probs"
    _checks.rank(op, "probs", probs, 2, "[batch, vocab]")
    _checks.floating(op, "probs", probs)
    batch = probs.shape[0]
    _checks.integer(op, "top_k", top_k)
    for name, t in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p), ("uniform", uniform)):
        _checks.length(op, name, t, batch, "batch")
    for name, t in (("top_p", top_p), ("min_p", min_p), ("uniform", uniform)):
        _checks.floating(op, name, t)
    _checks.same_device(
        op, {"probs": probs, "top_k": top_k, "top_p": top_p, "min_p": min_p, "uniform": uniform}
    )
    if use_triton(probs):
        from radixlm.kernels import triton_ops

        return triton_ops.sample_from_probs(probs, top_k, top_p, min_p, uniform)
    return reference.sample_from_probs(probs, top_k, top_p, min_p, uniform)
