"""The sampler against distributions and straightforward per-row references."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm.runtime import (
    CustomProcessorsDisabled,
    Sampler,
    SamplerConfig,
    SamplingBatch,
    SamplingRequest,
)
from radixlm.runtime.sampling_batch import seeded_uniform
from radixlm.sampling import SamplingParams

# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
DRAWS = 6000


def request(**fields: Any) -> SamplingRequest:
    extra = {
        k: fields.pop(k)
        for k in list(fields)
        if k in SamplingRequest.__dataclass_fields__ and k != "params"
    }
    return SamplingRequest(SamplingParams(**fields), **extra)


def draw(logits: torch.Tensor, **fields: Any) -> list[int]:
    """DRAWS seeded draws from one row of logits (one batch, one seed per row)."""
    rows = logits[None, :].repeat(DRAWS, 1)
    batch = SamplingBatch.build([request(seed=i, **fields) for i in range(DRAWS)], logits.shape[0])
    return Sampler()(rows, batch).token_ids


def assert_follows(samples: list[int], expected: dict[int, float]) -> None:
    counts = Counter(samples)
    assert set(counts) <= set(expected), f"drew {set(counts) - set(expected)} outside the set"
    n = len(samples)
    chi2 = sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in expected.items())
    assert chi2 < CHI2_CRITICAL[len(expected) - 1], (chi2, counts, expected)


def normalised(weights: dict[int, float]) -> dict[int, float]:
    total = sum(weights.values())
    return {t: w / total for t, w in weights.items()}


PROBS = torch.tensor([0.05, 0.30, 0.02, 0.40, 0.15, 0.08])
LOGITS = PROBS.log()


def test_plain_sampling_follows_the_softmax() -> None:
    assert_follows(draw(LOGITS), {i: float(p) for i, p in enumerate(PROBS)})


def test_temperature_sharpens_the_distribution() -> None:
    scaled = torch.softmax(LOGITS / 0.5, -1)
    assert_follows(draw(LOGITS, temperature=0.5), {i: float(p) for i, p in enumerate(scaled)})


def test_top_k_draws_from_the_k_best_renormalised() -> None:
    expected = normalised({3: 0.40, 1: 0.30, 4: 0.15})
    assert_follows(draw(LOGITS, top_k=3), expected)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # 0.40 + 0.30 = 0.70 < 0.8, so 0.15 is needed too.
    expected = normalised({3: 0.40, 1: 0.30, 4: 0.15})
    assert_follows(draw(LOGITS, top_p=0.8), expected)


def test_top_p_applies_to_the_top_k_survivors() -> None:
    # top-k 2 leaves 0.4/0.7 and 0.3/0.7; top-p 0.5 of that keeps only the first.
    assert set(draw(LOGITS, top_k=2, top_p=0.5)) == {3}


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    # threshold 0.3 * 0.40 = 0.12
    expected = normalised({3: 0.40, 1: 0.30, 4: 0.15})
    assert_follows(draw(LOGITS, min_p=0.3), expected)


def test_unseeded_draws_follow_the_distribution_too() -> None:
    generator = torch.Generator().manual_seed(7)
    rows = LOGITS[None, :].repeat(DRAWS, 1)
    batch = SamplingBatch.build([request(top_k=4)] * DRAWS, 6, generator=generator)
    expected = normalised({3: 0.40, 1: 0.30, 4: 0.15, 5: 0.08})
    assert_follows(Sampler()(rows, batch).token_ids, expected)


def test_greedy_rows_take_the_argmax_beside_sampled_rows() -> None:
    logits = torch.randn(4, 50)
    batch = SamplingBatch.build(
        [request(temperature=0.0), request(seed=1), request(top_k=1), request(seed=2)], 50
    )
    out = Sampler()(logits, batch).token_ids
    assert out[0] == int(logits[0].argmax())
    assert out[2] == int(logits[2].argmax())


def test_a_batch_without_greedy_rows_draws_what_it_draws_beside_one() -> None:
    """A batch of sampled rows only takes no argmax; its seeded rows draw the same tokens
    as they do beside a greedy row (which takes its argmax)."""
    torch.manual_seed(5)
    logits = torch.randn(5, 300)
    sampled = [request(seed=s, temperature=0.8) for s in range(4)]
    alone = SamplingBatch.build(sampled, 300)
    beside = SamplingBatch.build([*sampled, request(temperature=0.0)], 300)
    assert not alone.any_greedy and beside.any_greedy
    got = Sampler()(logits[:4], alone).token_ids
    mixed = Sampler()(logits, beside).token_ids
    assert got == mixed[:4] and mixed[4] == int(logits[4].argmax())


# References -------------------------------------------------------------------------------


def reference_process(logits: torch.Tensor, req: SamplingRequest) -> torch.Tensor:
    """Per-row, loop-based: repetition, frequency/presence, bias, bans, allowed."""
    p = req.params
    out = logits.clone().tolist()
    vocab = len(out)
    for token in set(req.prompt_ids) | set(req.output_ids):
        out[token] = (
            out[token] / p.repetition_penalty
            if out[token] > 0
            else (out[token] * p.repetition_penalty)
        )
    counts = Counter(req.output_ids)
    for token, count in counts.items():
        out[token] -= p.frequency_penalty * count + p.presence_penalty
    for token, bias in (p.logit_bias or {}).items():
        out[int(token)] += bias
    banned = set()
    if len(req.output_ids) < p.min_new_tokens:
        banned |= set(p.stop_token_ids or []) | set(req.eos_token_ids)
    context = list(req.prompt_ids) + list(req.output_ids)
    for words in req.bad_words_ids:
        head = list(words[:-1])
        if not head or context[len(context) - len(head) :] == head:
            banned.add(words[-1])
    for token in banned:
        out[token] = -math.inf
    if p.allowed_token_ids is not None:
        for token in range(vocab):
            if token not in p.allowed_token_ids:
                out[token] = -math.inf
    return torch.tensor(out)


def test_penalties_bias_bans_and_allowed_ids_match_a_reference() -> None:
    torch.manual_seed(0)
    vocab = 40
    requests = [
        request(repetition_penalty=1.3, prompt_ids=[1, 2, 3], output_ids=[3, 4, 4]),
        request(frequency_penalty=0.7, presence_penalty=0.4, output_ids=[5, 5, 5, 6, 9]),
        request(logit_bias={7: 5.0, 8: -3.0}),
        request(allowed_token_ids=[1, 2, 30]),
        request(
            bad_words_ids=[[11], [12, 13], [14, 15]],
            prompt_ids=[0, 12],
            output_ids=[],
        ),
        request(min_new_tokens=3, stop_token_ids=[20], eos_token_ids=[21], output_ids=[1]),
        request(min_new_tokens=1, stop_token_ids=[20], eos_token_ids=[21], output_ids=[1]),
        request(
            repetition_penalty=0.8,
            frequency_penalty=-0.5,
            presence_penalty=1.0,
            logit_bias={3: 1.0},
            prompt_ids=[3, 9],
            output_ids=[9, 9, 10],
            allowed_token_ids=[3, 9, 10, 11],
        ),
        request(),
    ]
    logits = torch.randn(len(requests), vocab) * 3
    batch = SamplingBatch.build(requests, vocab)
    processed = Sampler().process_logits(logits, batch)
    for row, req in enumerate(requests):
        expected = reference_process(logits[row], req)
        assert torch.allclose(processed[row], expected, atol=1e-5), f"row {row}"


def test_bad_word_is_blocked_only_when_its_prefix_ends_the_context() -> None:
    blocked = SamplingBatch.build([request(bad_words_ids=[[12, 13]], output_ids=[12])], 20)
    free = SamplingBatch.build([request(bad_words_ids=[[12, 13]], output_ids=[12, 5])], 20)
    logits = torch.zeros(1, 20)
    assert Sampler().process_logits(logits, blocked)[0, 13] == -math.inf
    assert Sampler().process_logits(logits, free)[0, 13] == 0.0


def test_min_new_tokens_masks_eos_until_reached_unless_eos_is_ignored() -> None:
    logits = torch.zeros(3, 10)
    logits[:, 1] = 10.0  # EOS is the favourite
    batch = SamplingBatch.build(
        [
            request(temperature=0, min_new_tokens=2, eos_token_ids=[1], output_ids=[4]),
            request(temperature=0, min_new_tokens=2, eos_token_ids=[1], output_ids=[4, 4]),
            request(
                temperature=0, min_new_tokens=2, ignore_eos=True, eos_token_ids=[1], output_ids=[]
            ),
        ],
        10,
    )
    out = Sampler()(logits, batch).token_ids
    assert out[0] != 1
    assert out[1] == 1
    assert out[2] == 1


def test_grammar_bitmask_restricts_the_draws() -> None:
    vocab = 70
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # token 5
    bitmask[0, 2] = 1 << 1  # token 65
    bitmask[1] = -1  # no grammar: everything allowed
    logits = torch.zeros(2, vocab)
    logits[:, 3] = 50.0
    seen: set[int] = set()
    for seed in range(40):
        batch = SamplingBatch.build(
            [request(seed=seed), request(temperature=0)], vocab, grammar_bitmask=bitmask
        )
        out = Sampler()(logits, batch).token_ids
        seen.add(out[0])
        assert out[1] == 3
    assert seen == {5, 65}


# Seeds ------------------------------------------------------------------------------------


def test_a_seeded_request_draws_the_same_tokens_whatever_the_batch() -> None:
    torch.manual_seed(0)
    vocab = 100
    target_logits = torch.randn(vocab)
    target = dict(seed=1234, temperature=0.9, top_p=0.95)

    def run(position: int, others: int, steps: int = 8) -> list[int]:
        outputs: list[int] = []
        for _ in range(steps):
            rows = [torch.randn(vocab) for _ in range(others)]
            reqs = [request(temperature=1.0, seed=None) for _ in range(others)]
            rows.insert(position, target_logits)
            reqs.insert(position, request(output_ids=list(outputs), **target))
            batch = SamplingBatch.build(reqs, vocab)
            outputs.append(Sampler()(torch.stack(rows), batch).token_ids[position])
        return outputs

    alone = run(0, 0)
    assert run(2, 5) == alone
    assert run(7, 7) == alone
    assert len(set(alone)) > 1  # the step moves the draw on


def test_seeded_uniform_depends_on_seed_and_step_only() -> None:
    assert seeded_uniform(5, 3) == seeded_uniform(5, 3)
    assert seeded_uniform(5, 3) != seeded_uniform(5, 4)
    assert seeded_uniform(5, 3) != seeded_uniform(6, 3)
    values = [seeded_uniform(s, 0) for s in range(2000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.03


# Logprobs ---------------------------------------------------------------------------------


def test_logprobs_report_chosen_top_and_requested_tokens() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 30)
    batch = SamplingBatch.build(
        [
            request(
                temperature=0,
                return_logprob=True,
                top_logprobs_num=4,
                token_ids_logprob=[0, 29],
            ),
            request(temperature=0),
        ],
        30,
    )
    out = Sampler()(logits, batch)
    assert out.logprobs is not None and out.logprobs[1] is None
    first = out.logprobs[0]
    assert first is not None
    reference = torch.log_softmax(logits[0], -1)
    assert first.token_id == out.token_ids[0]
    assert abs(first.logprob - reference[first.token_id].item()) < 1e-6
    assert [t for t, _ in first.top] == reference.topk(4).indices.tolist()
    assert [t for t, _ in first.requested] == [0, 29]
    assert abs(first.requested[1][1] - reference[29].item()) < 1e-6


def test_processed_logprobs_reflect_temperature_and_masks() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    batch = SamplingBatch.build(
        [request(temperature=0.5, seed=3, return_logprob=True, logit_bias={3: -100.0})], 4
    )
    out = Sampler(SamplerConfig(logprobs_mode="processed"))(logits, batch)
    assert out.logprobs is not None and out.logprobs[0] is not None
    biased = logits[0].clone()
    biased[3] -= 100.0
    expected = torch.log_softmax(biased / 0.5, -1)[out.token_ids[0]].item()
    assert abs(out.logprobs[0].logprob - expected) < 1e-5


# Custom logit processors ------------------------------------------------------------------

PROCESSOR_MODULE = """
from radixlm.sampling import CustomLogitProcessor


class ForceToken(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list):
        for row, params in enumerate(custom_param_list):
            logits[row, :] = float("-inf")
            logits[row, params["token"]] = 0.0
        return logits
"""


@pytest.fixture
def force_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "runtime_test_processor.py").write_text(PROCESSOR_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    from runtime_test_processor import ForceToken  # type: ignore[import-not-found]

    return str(ForceToken.to_str())


def test_custom_logit_processor_runs_when_enabled(force_token: str) -> None:
    batch = SamplingBatch.build(
        [
            request(seed=1, custom_params={"token": 7}, custom_logit_processor=force_token),
            request(temperature=0),
        ],
        10,
    )
    logits = torch.zeros(2, 10)
    logits[1, 2] = 1.0
    out = Sampler(SamplerConfig(enable_custom_logit_processor=True))(logits, batch)
    assert out.token_ids == [7, 2]


def test_custom_logit_processor_is_refused_when_disabled(force_token: str) -> None:
    batch = SamplingBatch.build(
        [request(custom_params={"token": 7}, custom_logit_processor=force_token)], 10
    )
    with pytest.raises(CustomProcessorsDisabled, match="enable_custom_logit_processor"):
        Sampler()(torch.zeros(1, 10), batch)


def _fields(batch: SamplingBatch) -> dict[str, Any]:
    names: tuple[str, ...] = ("temperatures", "top_ks", "top_ps", "min_ps", "greedy")
    names += ("logit_bias", "allowed")
    names += ("banned", "output_counts", "repetition_mask", "forced_rows", "forced_ids")
    return {name: getattr(batch, name) for name in names}


def test_a_batch_reused_from_the_last_step_equals_one_built_afresh() -> None:
    """A decode step over the same request objects reuses the last step's per-request
    tensors; what depends on progress (seeded uniforms, bans before min_new_tokens, bad words,
    penalties) is rebuilt, so the result equals a fresh build at every step."""
    outputs: list[list[int]] = [[], [], []]
    requests = [
        request(seed=7, temperature=0.8, top_k=5, logit_bias={"3": 2.0}, output_ids=outputs[0]),
        request(
            min_new_tokens=2,
            stop_token_ids=[4],
            frequency_penalty=0.5,
            bad_words_ids=((1, 2),),
            output_ids=outputs[1],
        ),
        request(temperature=0.0, allowed_token_ids=[1, 2, 3, 5], output_ids=outputs[2]),
    ]
    previous = None
    for step in range(4):
        reused = SamplingBatch.build(requests, 16, previous=previous)
        fresh = SamplingBatch.build(requests, 16)
        if previous is not None:
            assert reused.temperatures is previous.temperatures  # really reused
        for name, value in _fields(fresh).items():
            got = _fields(reused)[name]
            assert (value is None) == (got is None), name
            if value is not None:
                torch.testing.assert_close(got, value, msg=name)
        assert reused.uniforms[0] == seeded_uniform(7, step)
        previous = reused
        for ids in outputs:
            ids.append(1)  # every request generated token 1: bad word (1, 2) is now armed
    assert reused.banned is not None and bool(reused.banned[1, 2])
    assert not bool(reused.banned[1, 4])  # min_new_tokens reached: the stop id is allowed


def test_a_batch_of_other_request_objects_is_built_afresh() -> None:
    first = [request(temperature=0.5), request(temperature=0.0)]
    batch = SamplingBatch.build(first, 16)
    other = [request(temperature=0.5), request(temperature=1.0)]
    again = SamplingBatch.build(other, 16, previous=batch)
    assert again.temperatures is not batch.temperatures
    torch.testing.assert_close(again.temperatures, torch.tensor([0.5, 1.0]))
    shorter = SamplingBatch.build(first[:1], 16, previous=batch)
    assert shorter.size == 1 and shorter.temperatures.shape == (1,)
