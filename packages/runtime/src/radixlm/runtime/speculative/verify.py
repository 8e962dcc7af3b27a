"""Verification of draft tokens against the target model's logits, keeping its distribution.

A request with drafts d1..dk has k + 1 rows of logits in the step: row i follows its last
token and d1..di. Each row is processed as the sampler would process that step (penalties,
bans, biases, grammar bitmask, temperature, top-k / top-p / min-p; the row's sampling inputs
see the drafts before it as output). Draft d(i+1) is accepted with probability p_i(d(i+1)) —
the ratio p/q of rejection sampling when the draft is a single proposed token (q = 1 on it) —
and the first rejected row draws its token from p_i with d(i+1) removed (the residual
max(p - q, 0) normalised); when every draft is accepted the last row draws a bonus token from
p_k. Every output token is then distributed exactly as without drafts. Greedy rows accept a
draft when it is the row's argmax and end with the argmax: the same tokens as without.

`exact` (deterministic inference): each row draws its token as the sampler draws a step's,
with the row's own uniform (a seeded row's from its seed and its position), and a draft is
accepted when it is that token. Each output token is then the one decoding without drafts
draws at its position (the batch-invariant kernels give the row the same logits), and a
draft is accepted with the same chance, p_i(d(i+1)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixlm.kernels import greedy_tokens, reference
from radixlm.kernels.reference import inverse_cdf
from radixlm.runtime.logprobs import TokenLogprob, collect_logprobs
from radixlm.runtime.sampler import Sampler
from radixlm.runtime.sampling_batch import SamplingBatch, seeded_uniform

#: Seeded rows draw their acceptance uniforms from (seed + this, step): apart from the draws.
_ACCEPT_SEED = 0x5EC0_DE11


@dataclass(frozen=True)
class Verified:
    """Per request (in order): how many of its drafts were accepted, the token after them, and
    the logprobs of the accepted drafts and that token (None unless it asked)."""

    accepted: list[int]
    tokens: list[int]
    logprobs: list[list[TokenLogprob] | None]


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    batch: SamplingBatch,
    drafts: Sequence[Sequence[int]],
    generator: torch.Generator | None = None,
    exact: bool = False,
) -> Verified:
    """Accept or reject each request's drafts. `logits` has `len(draft) + 1` rows per request,
    request after request; `batch` has one sampling row per logits row (row i of a request
    built with its drafts before i as output). `exact`: every row's token is the sampler's
    own draw, and a draft is accepted when it is that token (see the module docstring)."""
    counts = [len(d) + 1 for d in drafts]
    rows = sum(counts)
    if logits.shape[0] != rows or batch.size != rows:
        raise ValueError(f"{logits.shape[0]} rows of logits, {batch.size} sampling rows for {rows}")
    device = logits.device
    starts = [0]
    for count in counts[:-1]:
        starts.append(starts[-1] + count)
    # The draft each row verifies (-1 on a request's last row: nothing to verify there).
    proposed = [-1] * rows
    for start, draft in zip(starts, drafts, strict=True):
        proposed[start : start + len(draft)] = list(draft)
    proposed_t = torch.tensor(proposed, dtype=torch.int64, device=device)
    verifies = proposed_t >= 0
    safe = proposed_t.clamp(min=0)

    raw = logits.float()
    processed = sampler.process_logits(raw, batch)
    greedy_ids = greedy_tokens(processed)
    row_tokens = greedy_ids  # each row's token when its draft is refused or it is the last
    if batch.all_greedy:
        scaled = processed
        weights = None
        ok = greedy_ids == proposed_t
    elif exact:
        scaled = processed / batch.temperatures[:, None]
        weights = None
        row_tokens = sampler.draw(scaled, batch, greedy_ids)
        ok = row_tokens == proposed_t
    else:
        scaled = processed / batch.temperatures[:, None]
        probs = torch.softmax(scaled, dim=-1).nan_to_num_(0.0)
        if batch.needs_filter:
            threshold = reference.sampling_thresholds(
                probs, batch.top_ks, batch.top_ps, batch.min_ps
            )
            probs = torch.where(probs >= threshold[:, None], probs, torch.zeros_like(probs))
        weights = probs / probs.sum(dim=-1, keepdim=True).clamp(min=1e-30)
        chance = weights.gather(1, safe[:, None]).squeeze(1)
        ok = torch.where(
            batch.greedy, greedy_ids == proposed_t, _accept_uniforms(batch, generator) < chance
        )
    ok &= verifies
    passed = ok.tolist()
    accepted: list[int] = []
    final_rows: list[int] = []
    for start, draft in zip(starts, drafts, strict=True):
        count = 0
        while count < len(draft) and passed[start + count]:
            count += 1
        accepted.append(count)
        final_rows.append(start + count)
    final = torch.tensor(final_rows, dtype=torch.int64, device=device)
    tokens_t = row_tokens.index_select(0, final)
    if weights is not None:
        residual = weights.index_select(0, final)
        rejected = verifies.index_select(0, final)  # the row's draft was refused
        refused = safe.index_select(0, final)
        hit = torch.arange(len(final_rows), device=device)
        residual[hit[rejected], refused[rejected]] = 0.0
        # A draft refused on a row that gave it all the mass leaves nothing else to draw:
        # keep the draft then (the chance of this is below float rounding).
        empty = residual.sum(dim=-1) <= 0
        drawn = inverse_cdf(residual, batch.uniforms.index_select(0, final))
        drawn = torch.where(empty, refused, drawn)
        tokens_t = torch.where(batch.greedy.index_select(0, final), tokens_t, drawn)
    tokens = tokens_t.tolist()
    logprobs: list[list[TokenLogprob] | None] = [None] * len(drafts)
    if batch.return_logprob:
        logprobs = _logprobs(
            sampler, raw, scaled, batch, starts, drafts, accepted, tokens, final_rows
        )
    return Verified(accepted, tokens, logprobs)


def _accept_uniforms(batch: SamplingBatch, generator: torch.Generator | None) -> torch.Tensor:
    """One uniform per row for the acceptance tests: seeded rows from (seed, step) alone."""
    uniforms = torch.rand(batch.size, generator=generator)
    static = batch.static
    if static is not None and static.seeded:
        requests = static.requests
        rows = [row for row, _ in static.seeded]
        values = [
            seeded_uniform(seed + _ACCEPT_SEED, len(requests[row].output_ids))
            for row, seed in static.seeded
        ]
        uniforms[rows] = torch.tensor(values, dtype=torch.float32)
    return uniforms.to(batch.device)


def _logprobs(
    sampler: Sampler,
    raw: torch.Tensor,
    scaled: torch.Tensor,
    batch: SamplingBatch,
    starts: Sequence[int],
    drafts: Sequence[Sequence[int]],
    accepted: Sequence[int],
    tokens: Sequence[int],
    final_rows: Sequence[int],
) -> list[list[TokenLogprob] | None]:
    """The logprobs of each request's output tokens of this step (its accepted drafts and the
    token after them), from the rows that produced them, as the sampler reports them."""
    rows: list[int] = []
    chosen: list[int] = []
    for start, draft, count, token, last in zip(
        starts, drafts, accepted, tokens, final_rows, strict=True
    ):
        rows.extend(range(start, last + 1))
        chosen.extend([*draft[:count], token])
    index = torch.tensor(rows, dtype=torch.int64, device=raw.device)
    source = raw if sampler.config.logprobs_mode == "raw" else scaled
    found = collect_logprobs(
        torch.log_softmax(source.index_select(0, index), dim=-1),
        torch.tensor(chosen, dtype=torch.int64, device=raw.device),
        [batch.top_logprobs_nums[r] for r in rows],
        [batch.token_ids_logprob[r] for r in rows],
    )
    result: list[list[TokenLogprob] | None] = []
    at = 0
    for start, last in zip(starts, final_rows, strict=True):
        size = last - start + 1
        result.append(found[at : at + size] if batch.logprob_rows[start] else None)
        at += size
    return result
