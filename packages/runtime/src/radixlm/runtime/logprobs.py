"""Log-probabilities of chosen tokens, the top-k alternatives and requested token ids."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probabilities: the token's own, the top alternatives (most likely
    first) and those of the token ids the request asked for, as (token id, logprob) pairs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    requested: tuple[tuple[int, float], ...] = ()


def collect_logprobs(
    logprobs: torch.Tensor,
    token_ids: torch.Tensor,
    top_nums: Sequence[int],
    requested: Sequence[Sequence[int] | None],
) -> list[TokenLogprob]:
    """Per row of `logprobs` [N, V]: the logprob of `token_ids[row]`, the `top_nums[row]` best
    tokens and the `requested[row]` ids. One device-to-host transfer per kind of value."""
    rows = logprobs.shape[0]
    chosen = logprobs.gather(1, token_ids.long()[:, None])[:, 0].tolist()
    ids = token_ids.tolist()
    max_top = max(top_nums, default=0)
    top_values: list[list[float]] = [[] for _ in range(rows)]
    top_ids: list[list[int]] = [[] for _ in range(rows)]
    if max_top > 0:
        values, indices = logprobs.topk(min(max_top, logprobs.shape[1]), dim=-1)
        top_values, top_ids = values.tolist(), indices.tolist()
    wanted_rows = [r for r in range(rows) if requested[r]]
    wanted: dict[int, list[float]] = {}
    if wanted_rows:
        flat_rows = [r for r in wanted_rows for _ in requested[r] or ()]
        flat_ids = [t for r in wanted_rows for t in requested[r] or ()]
        picked = logprobs[
            torch.tensor(flat_rows, device=logprobs.device),
            torch.tensor(flat_ids, device=logprobs.device),
        ].tolist()
        cursor = 0
        for r in wanted_rows:
            count = len(requested[r] or ())
            wanted[r] = picked[cursor : cursor + count]
            cursor += count
    out: list[TokenLogprob] = []
    for r in range(rows):
        k = top_nums[r]
        top = tuple(zip(top_ids[r][:k], top_values[r][:k], strict=True)) if k else ()
        asked = tuple(zip(requested[r] or (), wanted.get(r, ()), strict=True))
        out.append(TokenLogprob(int(ids[r]), float(chosen[r]), top, asked))
    return out
