"""Beam search through the engine equals transformers' `generate(num_beams=k)`: the same
sequences, in the same order, with the same `sequences_scores`; no KV slot is left behind."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import transformers

from radixlm.runtime import Engine
from radixlm.runtime.beam_search import BeamSearch, BeamSearchParams
from radixlm.runtime.fixtures import build_tiny_model
from radixlm.sampling import GenerateRequest, InvalidRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["the model is a cache of the", "hello world, the radix tree"]
#: A token the tiny model often picks (found by greedy decoding): made a second EOS, beams
#: finish at many lengths, so the finished set and the stopping heuristics matter.
FREQUENT_TOKEN = 489
SCORE_TOLERANCE = 1e-4  # absolute, and 1e-5 relative (float32 sums in transformers)


@dataclass
class Pair:
    engine: Engine
    hf: Any
    tokenizer: Any


def _pair(path: Path) -> Iterator[Pair]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with Engine(str(path), show_progress=False, max_total_tokens=4096) as engine:
        yield Pair(engine, hf, engine.tokenizer)


@pytest.fixture(scope="module")
def plain_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-beam"))


@pytest.fixture(scope="module")
def plain(plain_path: Path) -> Iterator[Pair]:
    """The tiny model with its one EOS (rarely chosen: beams end at max_tokens)."""
    yield from _pair(plain_path)


@pytest.fixture(scope="module")
def plain_process(plain_path: Path) -> Iterator[Pair]:
    """The same model with the engine core in its own process (no transformers twin)."""
    with Engine(
        str(plain_path), show_progress=False, max_total_tokens=4096, engine_process=True
    ) as engine:
        yield Pair(engine, None, engine.tokenizer)


@pytest.fixture(params=["thread", "process"])
def either(request: pytest.FixtureRequest) -> Pair:
    """`plain`, with the core on a thread and in its own process."""
    return cast(
        Pair, request.getfixturevalue("plain" if request.param == "thread" else "plain_process")
    )


@pytest.fixture(scope="module")
def eos_heavy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """The same weights with a frequent token as a second EOS (beams end at EOS too)."""
    path = build_tiny_model(
        tmp_path_factory.mktemp("tiny-beam-eos"),
        generation_config={"eos_token_id": [0, FREQUENT_TOKEN]},
    )
    yield from _pair(path)


def _transformers_beams(
    pair: Pair,
    prompt: list[int],
    k: int,
    max_tokens: int,
    length_penalty: float,
    early_stopping: bool | str,
) -> tuple[list[list[int]], list[float] | None]:
    with torch.no_grad():
        out = pair.hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens,
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=pair.tokenizer.pad_token_id,
        )
    eos = set(pair.engine.eos_token_ids)
    sequences = []
    for row in out.sequences[:, len(prompt) :].tolist():
        # Rows are padded to the longest; cut each after its EOS.
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        sequences.append(row[:end])
    scores = None if k == 1 else out.sequences_scores.tolist()
    return sequences, scores


def _assert_matches(pair: Pair, prompt_text: str, k: int, max_tokens: int, **options: Any) -> None:
    prompt = pair.tokenizer(prompt_text)["input_ids"]
    length_penalty = options.get("length_penalty", 1.0)
    early_stopping = options.get("early_stopping", False)
    expected, scores = _transformers_beams(
        pair, prompt, k, max_tokens, length_penalty, early_stopping
    )
    results = pair.engine.beam_search(prompt, k, max_tokens, length_penalty, early_stopping)
    assert [r["output_ids"] for r in results] == expected
    if scores is not None:
        ours = [r["meta_info"]["score"] for r in results]
        assert ours == pytest.approx(scores, rel=1e-5, abs=SCORE_TOLERANCE)
    pair.engine.check_invariants()


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beams_equal_transformers_when_beams_end_at_max_tokens(
    plain: Pair, prompt: str, k: int, length_penalty: float
) -> None:
    _assert_matches(plain, prompt, k, 12, length_penalty=length_penalty)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, -1.0, 2.0])
@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_beams_equal_transformers_when_beams_end_at_eos(
    eos_heavy: Pair, prompt: str, k: int, length_penalty: float, early_stopping: bool | str
) -> None:
    _assert_matches(
        eos_heavy, prompt, k, 24, length_penalty=length_penalty, early_stopping=early_stopping
    )


@pytest.mark.parametrize("prompt", PROMPTS)
def test_one_beam_is_greedy_decoding(eos_heavy: Pair, prompt: str) -> None:
    _assert_matches(eos_heavy, prompt, 1, 24)
    greedy = eos_heavy.engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24})
    (beam,) = eos_heavy.engine.beam_search(prompt, 1, 24)
    assert beam["output_ids"] == greedy["output_ids"]
    assert beam["text"] == greedy["text"]


def test_results_say_why_each_beam_ended(eos_heavy: Pair) -> None:
    results = eos_heavy.engine.beam_search(PROMPTS[0], 4, 24)
    eos = set(eos_heavy.engine.eos_token_ids)
    for result in results:
        reason = result["meta_info"]["finish_reason"]
        if reason["type"] == "stop":
            assert result["output_ids"][-1] in eos and reason["matched"] in eos
        else:
            assert reason["type"] == "length" and len(result["output_ids"]) == 24
    assert [r["index"] for r in results] == [0, 1, 2, 3]
    scores = [r["meta_info"]["score"] for r in results]
    assert scores == sorted(scores, reverse=True)


def test_score_is_the_cumulative_logprob_over_the_penalised_length(either: Pair) -> None:
    for result in either.engine.beam_search(PROMPTS[1], 3, 10, length_penalty=1.5):
        meta = result["meta_info"]
        total = sum(entry[0] for entry in meta["output_token_logprobs"])
        assert meta["cumulative_logprob"] == pytest.approx(total)
        assert meta["score"] == pytest.approx(total / 10**1.5)


def test_beams_share_their_prefix_kv_through_the_radix_cache(either: Pair) -> None:
    engine = either.engine
    prompt = either.tokenizer(PROMPTS[0])["input_ids"]
    engine.flush_cache().result()
    before = engine.server_info(fresh=True)["tokens_forwarded"]
    k, steps = 4, 8
    engine.beam_search(prompt, k, steps)
    forwarded = engine.server_info(fresh=True)["tokens_forwarded"] - before
    # The prompt once, then at most one new token per live beam per step.
    assert forwarded <= len(prompt) + k * (steps - 1)


def test_no_kv_slot_is_left_behind(either: Pair) -> None:
    engine = either.engine
    engine.beam_search(PROMPTS[0], 4, 16)
    engine.check_invariants()
    assert engine.flush_cache().result()
    info = engine.server_info(fresh=True)
    assert info["token_usage"] == 0.0  # every slot free once the cache is dropped
    assert info["num_running_reqs"] == 0


def test_the_request_form_is_a_coroutine_for_the_server(either: Pair) -> None:
    request = GenerateRequest.parse(
        {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 8}, "rid": "beam-1"}
    )
    results = asyncio.run(either.engine.beam_search(request, 2, length_penalty=0.5))
    expected = either.engine.beam_search(PROMPTS[1], 2, 8, 0.5)
    assert [list(r.output_ids) for r in results] == [r["output_ids"] for r in expected]
    assert {r.rid for r in results} == {"beam-1"}
    assert results[0].to_json()["meta_info"]["score"] == pytest.approx(
        expected[0]["meta_info"]["score"], abs=1e-5
    )


def test_a_search_past_the_context_is_refused_naming_max_tokens(either: Pair) -> None:
    with pytest.raises(InvalidRequest) as error:
        either.engine.beam_search(PROMPTS[0], 2, either.engine.context_length)
    assert error.value.field == "max_new_tokens"


@pytest.mark.parametrize(
    ("field", "values"),
    [("beam_width", dict(beam_width=0)), ("max_tokens", dict(max_tokens=0))],
)
def test_bad_parameters_name_their_field(field: str, values: dict[str, int]) -> None:
    with pytest.raises(InvalidRequest) as error:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **values})
    assert error.value.field == field


def test_only_the_first_beam_width_candidates_may_finish() -> None:
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=8), eos_token_ids=[0])
    # EOS ranks third of the four candidates kept: a spare, so it is dropped, not finished.
    search.advance([[(5, -0.1), (6, -0.2), (0, -0.3), (7, -0.4)]])
    assert search.finished == []
    assert [b.token_ids for b in search.live] == [(5,), (6,)]
