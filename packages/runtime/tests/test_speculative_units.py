"""Speculative decoding's parts on their own: n-gram lookup against a naive oracle, the
drafter's sources, the flags, and the verifier's exactness (its output tokens follow the
target distribution whatever the drafts: chi-square goodness of fit)."""

from __future__ import annotations

import math
import random
from array import array
from collections import Counter
from typing import Any

import pytest
import torch

from radixlm.cache import RadixCache
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.sampler import Sampler
from radixlm.runtime.sampling_batch import SamplingBatch, SamplingRequest
from radixlm.runtime.scheduler import Req
from radixlm.runtime.speculative import NgramDrafter, ngram_lookup
from radixlm.runtime.speculative.verify import verify
from radixlm.sampling import SamplingParams


def naive_lookup(tokens: list[int], count: int, low: int, high: int) -> list[int]:
    size = len(tokens)
    for n in range(min(high, size - 1), low - 1, -1):
        tail = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):  # the latest earlier occurrence
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + count]
    return []


def test_ngram_lookup_agrees_with_a_naive_search() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        size = rng.randrange(1, 40)
        # Wide ids too: a byte-level match across token boundaries must not count.
        alphabet = [rng.randrange(4) for _ in range(3)] + [256, 65536, -(2**40)]
        tokens = [rng.choice(alphabet) for _ in range(size)]
        low = rng.randrange(1, 4)
        high = low + rng.randrange(0, 5)
        count = rng.randrange(1, 6)
        got = ngram_lookup(array("q", tokens), count, low, high)
        assert got == naive_lookup(tokens, count, low, high), (tokens, count, low, high)


def test_unaligned_byte_matches_are_skipped() -> None:
    # 256 = bytes 00 01 00..; 1 = 01 00 ..: the packed bytes of [1] appear inside [256, 0].
    assert ngram_lookup(array("q", [256, 0, 5, 1]), 2, 1, 1) == []
    assert ngram_lookup(array("q", [1, 7, 256, 1]), 2, 1, 1) == [7, 256]


def _req(tokens: list[int], prompt: int) -> Req:
    req = Req("r", tokens[:prompt], 100)
    req.output_ids = tokens[prompt:]
    return req


def test_the_drafter_takes_the_cache_continuation_over_an_ngram() -> None:
    cache = RadixCache()
    cache.insert([5, 6, 7, 8, 9, 10, 11], list(range(7)))
    drafter = NgramDrafter(cache, max_draft=4)
    # Its own tokens repeat "6 7" -> 1 2, but the cache saw the whole sequence go on 8 9 ...
    req = _req([6, 7, 1, 2, 5, 6, 7], prompt=3)
    assert drafter.propose_one(req, 3) == [1, 2, 5]  # the cache holds nothing after 6 7 1 2 5 6 7
    req = _req([5, 6, 7], prompt=2)
    assert drafter.propose_one(req, 3) == [8, 9, 10]
    req = _req([5, 6, 7, 1, 5, 6, 7], prompt=2)
    assert drafter.propose_one(req, 2) == [1, 5]
    assert NgramDrafter(RadixCache(disable=True), 4).propose_one(_req([5, 6, 5], 1), 3) == [6, 5]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"speculative_algorithm": "EAGLE"}, "EAGLE head"),
        ({"speculative_algorithm": "bogus"}, "speculative_algorithm"),
        ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 2}, "eagle_topk"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1}, "draft_tokens"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 0}, "num_steps"),
        (
            {"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "/x"},
            "draft_model_path",
        ),
        (
            {
                "speculative_algorithm": "NGRAM",
                "speculative_ngram_min_match_window_size": 4,
                "speculative_ngram_max_match_window_size": 2,
            },
            "window_size",
        ),
    ],
)
def test_bad_speculative_settings_name_the_flag(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs("m", **kwargs)


def test_draft_counts_follow_sglang() -> None:
    spec = EngineConfig.from_kwargs("m", speculative_algorithm="ngram").speculative
    assert spec.algorithm == "NGRAM" and spec.max_draft == 4
    spec = EngineConfig.from_kwargs(
        "m", speculative_algorithm="NGRAM", speculative_num_draft_tokens=3
    ).speculative
    assert spec.max_draft == 2
    spec = EngineConfig.from_kwargs(
        "m", speculative_algorithm="NGRAM", speculative_num_steps=6
    ).speculative
    assert spec.max_draft == 6


# ----------------------------------------------------------------------------- exactness

VOCAB = 8


def _target(params: SamplingParams, logits: torch.Tensor) -> torch.Tensor:
    """The distribution the sampler draws from for one row (by its own definition)."""
    from radixlm.kernels import reference

    probs = torch.softmax(logits / params.temperature, dim=-1)[None]
    top_k = torch.tensor([params.top_k if params.top_k > 0 else 0])
    threshold = reference.sampling_thresholds(
        probs, top_k, torch.tensor([params.top_p]), torch.tensor([params.min_p])
    )
    kept = torch.where(probs >= threshold[:, None], probs, torch.zeros_like(probs))[0]
    return kept / kept.sum()


def _chi_square_p(counts: Counter[int], expected: torch.Tensor, total: int) -> float:
    """p-value of Pearson's chi-square test (survival function by the Wilson-Hilferty
    approximation; good for these degrees of freedom)."""
    stat = 0.0
    cells = 0
    for token in range(VOCAB):
        e = float(expected[token]) * total
        if e == 0:
            assert counts[token] == 0, f"token {token} has zero probability but was drawn"
            continue
        stat += (counts[token] - e) ** 2 / e
        cells += 1
    dof = cells - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.05),
    ],
    ids=["t1", "top_k", "top_p", "min_p"],
)
def test_verified_tokens_follow_the_target_distribution(params: SamplingParams) -> None:
    """Row 0's output token (the first draft if accepted, else the residual draw) and, when
    both drafts were accepted, the bonus token must each follow the target distribution of
    their row, whatever the drafts proposed."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=gen) * 1.5
    sampler = Sampler()
    trials = 6000
    first: Counter[int] = Counter()
    proposals = [int(logits[0].argmax()), int(logits[0].argmin()), 3]  # likely, unlikely, any
    requests = [SamplingRequest(params, output_ids=[0] * i) for i in range(3)]
    for trial in range(trials):
        draft = [proposals[trial % 3], 2]
        batch = SamplingBatch.build(requests, VOCAB, generator=gen)
        found = verify(sampler, logits, batch, [draft], gen)
        token = draft[0] if found.accepted[0] >= 1 else found.tokens[0]
        first[token] += 1
    p = _chi_square_p(first, _target(params, logits[0]), trials)
    assert p > 1e-4, (p, first)


def test_greedy_rows_accept_exactly_the_argmax_run() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    best = logits.argmax(dim=-1).tolist()
    params = SamplingParams(temperature=0.0)
    requests = [SamplingRequest(params, output_ids=[0] * i) for i in range(4)]
    batch = SamplingBatch.build(requests, VOCAB)
    wrong = (best[1] + 1) % VOCAB
    found = verify(Sampler(), logits, batch, [[best[0], wrong, best[2]]])
    assert found.accepted == [1] and found.tokens == [best[1]]
    found = verify(Sampler(), logits, batch, [[best[0], best[1], best[2]]])
    assert found.accepted == [3] and found.tokens == [best[3]]


def test_drafts_go_as_deep_as_their_chance_beats_a_rows_share() -> None:
    from radixlm.runtime.scheduler.scheduler import _worth_drafting

    assert _worth_drafting(0.9, 0.55) == 5  # 0.9 ** 5 = 0.59 > 0.55 > 0.9 ** 6
    assert _worth_drafting(0.5, 0.55) == 0
    assert _worth_drafting(0.99, 0.0, most=7) == 7


def test_measuring_a_step_touches_no_slot_a_request_could_hold(
    runners: dict[str, Any],
) -> None:
    """The start-up measurement writes the pool's padding slot alone (the table's padding row
    is put back), and leaves the runner's counters as they were."""
    from radixlm.runtime.speculative.costs import measure_step_cost

    runner = next(iter(runners.values()))
    pool, table = runner.kv_pool, runner.req_to_token_pool
    before = [layer[: pool.num_slots].clone() for layer in (*pool.k_buffers, *pool.v_buffers)]
    rows = table.req_to_token.clone()
    calls = runner.stats.forward_calls
    cost = measure_step_cost(runner)
    assert [rows for rows, _ in cost.points] == [1, 2, 4, 8]
    assert all(a[1] < b[1] for a, b in zip(cost.points, cost.points[1:], strict=False))
    assert runner.stats.forward_calls == calls
    assert torch.equal(table.req_to_token, rows)  # the padding row too: it is put back
    after = [layer[: pool.num_slots] for layer in (*pool.k_buffers, *pool.v_buffers)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_a_draft_row_must_beat_its_marginal_cost() -> None:
    """The threshold a draft's chance must beat: the marginal cost of the rows drafts add and
    of proposing one draft, over what a token costs without drafts."""
    from radixlm.runtime.speculative.costs import DraftCosts, StepCost

    # A step of R rows: 10 + R (ms) up to 4 rows, then 4 ms a row.
    cost = StepCost(((1, 11.0), (2, 12.0), (4, 14.0), (8, 30.0)))
    assert cost.seconds(3) == 13.0 and cost.seconds(16) == 62.0  # between, and past the last
    lookup = DraftCosts(cost, None, step_tokens=16)
    assert lookup.threshold(1) == 1.0 / 11.0  # one more row: 1 ms, a token costs 11 ms
    assert lookup.threshold(4) == (16.0 / 4) / (14.0 / 4)  # 4 rows more past 4: 4 ms each
    assert lookup.threshold(16) == 1.0  # no room left in the step: never
    model = DraftCosts(cost, cost.scaled(0.5), step_tokens=16)
    assert model.threshold(1) == (1.0 + 5.5) / 11.0
    assert StepCost.assumed(16.0).seconds(5) == 21.0
