"""Torch references for the token bitmask and for sampling from probabilities."""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed int32 rows ``[rows, words]`` -> bool ``[rows, vocab_size]`` (True = allowed).

    Bit ``j`` of word ``i`` covers token ``32 * i + j``; tokens past ``32 * words`` are not
    allowed.
    """
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.to(torch.int32)[..., None] >> shifts) & 1
    allowed = bits.flatten(-2).bool()
    covered = allowed.shape[-1]
    if covered >= vocab_size:
        return allowed[..., :vocab_size]
    pad = allowed.new_zeros((*allowed.shape[:-1], vocab_size - covered))
    return torch.cat((allowed, pad), dim=-1)


def apply_token_bitmask_inplace(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    indices: torch.Tensor | None = None,
) -> None:
    """Reference of :func:`radixlm.kernels.apply_token_bitmask_inplace`."""
    if indices is None:
        allowed = unpack_bitmask(bitmask, logits.shape[-1])
        logits.masked_fill_(~allowed, float("-inf"))
        return
    rows = indices.long()
    allowed = unpack_bitmask(bitmask[rows], logits.shape[-1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def sampling_thresholds(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Per row, the smallest probability a token needs to stay in the candidate set.

    A token survives when ``p >= threshold``: ``threshold`` is the largest of the k-th largest
    probability (top-k), the nucleus cut-off computed over the top-k survivors (top-p) and
    ``min_p * max(p)`` (min-p). Ties at the threshold all survive.
    """
    vocab = probs.shape[1]
    pf = probs.float()
    ordered, _ = torch.sort(pf, dim=-1, descending=True)
    k = top_k.long()
    k_on = (k > 0) & (k < vocab)
    kth = ordered.gather(1, (k.clamp(1, vocab) - 1)[:, None]).squeeze(1)
    t_k = torch.where(k_on, kth, torch.zeros_like(kth))
    # Nucleus over the top-k survivors: the first sorted position whose cumulative mass reaches
    # top_p of the survivors' mass; its probability is the cut-off.
    kept = torch.where(ordered >= t_k[:, None], ordered, torch.zeros_like(ordered))
    cumulative = kept.cumsum(dim=-1)
    target = top_p.float() * kept.sum(dim=-1)
    first = (cumulative < target[:, None]).sum(dim=-1).clamp(max=vocab - 1)
    t_p = ordered.gather(1, first[:, None]).squeeze(1)
    t_p = torch.where(top_p.float() < 1.0, t_p, torch.zeros_like(t_p))
    t_m = min_p.float().clamp(min=0.0) * ordered[:, 0]
    return torch.maximum(torch.maximum(t_k, t_p), t_m)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's first token (in id order) whose running mass exceeds ``uniforms`` x the row's
    total mass (``probs`` ``[batch, vocab]``, not necessarily normalised); int64 ``[batch]``."""
    cumulative = probs.cumsum(dim=-1)
    target = uniforms * cumulative[:, -1]
    chosen = torch.searchsorted(cumulative, target[:, None], right=True)[:, 0]
    return chosen.clamp_(max=probs.shape[1] - 1)


def sample_tokens(
    logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.sample_tokens`."""
    probs = torch.softmax(logits.float() / temperatures[:, None], dim=-1).nan_to_num_(0.0)
    return inverse_cdf(probs, uniforms)


def sample_from_probs(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """Reference of :func:`radixlm.kernels.sample_from_probs`."""
    vocab = probs.shape[1]
    pf = probs.float()
    threshold = sampling_thresholds(pf, top_k, top_p, min_p)
    weights = torch.where(pf >= threshold[:, None], pf, torch.zeros_like(pf))
    cumulative = weights.cumsum(dim=-1)
    target = uniform.float() * cumulative[:, -1]
    chosen = (cumulative <= target[:, None]).sum(dim=-1)
    ids = torch.arange(vocab, device=probs.device)
    last_nonzero = torch.where(weights > 0, ids, torch.zeros_like(ids)).amax(dim=-1)
    return torch.minimum(chosen, last_nonzero).long()
