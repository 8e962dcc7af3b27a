"""Ragged mixed batches, cached prefixes and prompt logprobs give the same numbers as alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm.runtime import ModelRunner

PROMPTS = [
    [5, 17, 99, 3, 250, 42, 7, 7, 128, 64],
    [33, 2, 200, 11, 9, 180, 77, 4, 61, 19, 8, 8, 90, 14, 150],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [240, 241, 242],
]
ATOL = 2e-5


def alone_next_logits(driver: Any, prompt: list[int]) -> torch.Tensor:
    seq = driver.start(prompt)
    try:
        return driver.forward([driver.entry(seq, prompt)]).next_token_logits[0].clone()
    finally:
        driver.release(seq)


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_ragged_mixed_batch_equals_each_request_alone(
    arch: str, runners: dict[str, ModelRunner], driver_for: Any
) -> None:
    driver = driver_for(runners[arch])
    a, b, c, d = PROMPTS
    # b has 6 tokens cached already; c and d are decoding (their prompts minus one are cached).
    seq_b, seq_c, seq_d = driver.start(b), driver.start(c), driver.start(d)
    driver.forward([driver.entry(seq_b, b[:6])])
    driver.forward([driver.entry(seq_c, c[:-1]), driver.entry(seq_d, d[:-1])])
    seq_a = driver.start(a)
    mixed = driver.forward(
        [
            driver.entry(seq_c, c[-1:]),
            driver.entry(seq_a, a),
            driver.entry(seq_d, d[-1:]),
            driver.entry(seq_b, b[6:]),
        ]
    ).next_token_logits
    for seq in (seq_a, seq_b, seq_c, seq_d):
        driver.release(seq)
    for row, prompt in enumerate([c, a, d, b]):
        expected = alone_next_logits(driver, prompt)
        assert torch.allclose(mixed[row], expected, atol=ATOL), f"row {row}"


@pytest.mark.parametrize("arch", ["llama3", "mistral"])
@pytest.mark.parametrize("cached", [1, 7, 11])
def test_cached_prefix_then_extend_equals_whole_prompt(
    arch: str, cached: int, runners: dict[str, ModelRunner], driver_for: Any
) -> None:
    driver = driver_for(runners[arch])
    prompt = PROMPTS[1]
    whole = alone_next_logits(driver, prompt)
    seq = driver.start(prompt)
    driver.forward([driver.entry(seq, prompt[:cached])])
    split = driver.forward([driver.entry(seq, prompt[cached:])]).next_token_logits[0]
    driver.release(seq)
    assert torch.allclose(split, whole, atol=ATOL)


def test_decode_steps_in_a_batch_equal_decoding_alone(
    runners: dict[str, ModelRunner], driver_for: Any
) -> None:
    driver = driver_for(runners["qwen2"])
    alone = [driver.greedy(p, 6) for p in PROMPTS]
    seqs = [driver.start(p) for p in PROMPTS]
    out = driver.forward([driver.entry(s, p) for s, p in zip(seqs, PROMPTS, strict=True)])
    generated = [[int(t)] for t in out.next_token_logits.argmax(-1)]
    for _ in range(5):
        out = driver.forward(
            [driver.entry(s, g[-1:]) for s, g in zip(seqs, generated, strict=True)]
        )
        for g, t in zip(generated, out.next_token_logits.argmax(-1), strict=True):
            g.append(int(t))
    for seq in seqs:
        driver.release(seq)
    assert generated == alone


def test_prompt_logprobs_match_transformers(
    hf_checkpoints: dict[str, tuple[Path, Any]], runners: dict[str, ModelRunner], driver_for: Any
) -> None:
    runner = runners["qwen2"]
    driver = driver_for(runner)
    prompt = PROMPTS[1]
    start = 4  # score prompt tokens 5.. (positions 4..13 predict tokens 5..14)
    seq = driver.start(prompt)
    entry = driver.entry(
        seq,
        prompt,
        input_logprob_start=start,
        input_logprob_targets=prompt[start + 1 :],
        top_logprobs_num=3,
        token_ids_logprob=[0, 7],
    )
    out = driver.forward([entry])
    driver.release(seq)
    scored = out.input_logprobs[0]
    _, hf_model = hf_checkpoints["qwen2"]
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    assert [s.token_id for s in scored] == prompt[start + 1 :]
    for offset, item in enumerate(scored):
        row = reference[start + offset]
        assert abs(item.logprob - row[item.token_id].item()) < 1e-4
        assert [t for t, _ in item.top] == row.topk(3).indices.tolist()
        assert [t for t, _ in item.requested] == [0, 7]
        assert abs(item.requested[1][1] - row[7].item()) < 1e-4


def test_runner_counts_the_tokens_it_forwards(
    runners: dict[str, ModelRunner], driver_for: Any
) -> None:
    runner = runners["qwen3"]
    before = runner.stats.tokens_forwarded
    driver_for(runner).greedy(PROMPTS[0], 3)
    assert runner.stats.tokens_forwarded - before == len(PROMPTS[0]) + 2


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_decode_of_very_different_lengths_equals_each_alone(
    arch: str, runners: dict[str, ModelRunner], driver_for: Any
) -> None:
    # On CPU similar lengths share a padded group (masked) and distant ones do not; the
    # mistral model's sliding window (6) masks the old keys inside a padded group too.
    driver = driver_for(runners[arch])
    prompts = [[(7 * i + j) % 200 + 2 for j in range(n)] for i, n in enumerate((3, 9, 10, 40))]
    seqs = [driver.start(p) for p in prompts]
    for seq, prompt in zip(seqs, prompts, strict=True):
        driver.forward([driver.entry(seq, prompt[:-1])])
    batched = driver.forward(
        [driver.entry(s, p[-1:]) for s, p in zip(seqs, prompts, strict=True)]
    ).next_token_logits
    for seq in seqs:
        driver.release(seq)
    for row, prompt in enumerate(prompts):
        assert torch.allclose(batched[row], alone_next_logits(driver, prompt), atol=ATOL), row


def test_a_decode_batch_holds_the_same_arrays_as_the_general_build() -> None:
    """The one-token-per-request fast path of ForwardBatch.build against the general path
    (which the same entries take when a two-token entry follows them)."""
    from radixlm.runtime.forward_batch import BatchEntry, ForwardBatch

    decodes = [
        BatchEntry(2, [11], 5, [40]),
        BatchEntry(0, [12], 9, [41]),
        BatchEntry(3, [13], 0, [42]),
    ]
    table = torch.zeros(4, 16, dtype=torch.int32)
    fast = ForwardBatch.build(decodes, table)
    general = ForwardBatch.build([*decodes, BatchEntry(1, [14, 15], 0, [43, 44])], table)
    for name in ("input_ids", "positions", "out_cache_loc"):
        assert getattr(fast, name).tolist() == getattr(general, name).tolist()[:3], name
    for name in ("req_pool_indices", "prefix_lens", "extend_lens", "seq_lens"):
        assert getattr(fast, name).tolist() == getattr(general, name).tolist()[:3], name
    assert fast.prefix_lens_cpu == (5, 9, 0) and fast.extend_lens_cpu == (1, 1, 1)
    assert fast.req_pool_indices_cpu == (2, 0, 3) and fast.is_decode
    fast.write_req_to_token()
    expected = torch.zeros(4, 16, dtype=torch.int32)
    expected[2, 5], expected[0, 9], expected[3, 0] = 40, 41, 42
    assert torch.equal(table, expected)
