"""`thinking_token_budget`: once N output tokens are out without `</think>`, the next token is
`</think>` (a tiny random Llama whose tokenizer has `<think>` and `</think>` as added tokens)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm.runtime import Engine, SamplingBatch, SamplingRequest
from radixlm.runtime.fixtures import build_tiny_model
from radixlm.runtime.sampler import Sampler
from radixlm.runtime.thinking import ThinkingBudget, end_of_thinking_token
from radixlm.sampling import InvalidRequest, SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GREEDY: dict[str, Any] = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with `<think>` / `</think>` added as (non-special) tokens, as Qwen3's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("tiny-thinking"))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path))
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[Engine]:
    with Engine(
        str(model_dir),
        show_progress=False,
        max_total_tokens=2048,
        engine_process=request.param == "process",
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def end_id(engine: Engine) -> int:
    token = end_of_thinking_token(engine.tokenizer)
    assert token is not None
    return token


def test_the_end_of_thinking_is_forced_once_the_budget_is_spent(
    engine: Engine, end_id: int
) -> None:
    free = engine.generate("hello world", GREEDY)["output_ids"]
    assert end_id not in free[:3]  # the tiny model does not end its thinking by itself
    out = engine.generate("hello world", {**GREEDY, "thinking_token_budget": 3})
    ids = out["output_ids"]
    assert ids[:3] == free[:3] and ids[3] == end_id and len(ids) == 10
    assert "</think>" in out["text"]
    engine.check_invariants()


def test_a_zero_budget_ends_the_thinking_at_once(engine: Engine, end_id: int) -> None:
    out = engine.generate("hello world", {**GREEDY, "thinking_token_budget": 0})
    assert out["output_ids"][0] == end_id


def test_sampled_sequences_are_forced_too(engine: Engine, end_id: int) -> None:
    params = {**GREEDY, "temperature": 1.0, "seed": 3, "n": 2, "thinking_token_budget": 2}
    outs = engine.generate("the cache", params)
    for out in outs:  # ended by the model within the budget, or forced right after it
        assert end_id in out["output_ids"][:3]


def test_a_budget_cannot_be_combined_with_a_constraint(engine: Engine) -> None:
    with pytest.raises(InvalidRequest) as error:
        engine.generate("x", {**GREEDY, "thinking_token_budget": 2, "regex": "[ab]+"})
    assert error.value.field == "thinking_token_budget"


def test_a_thinking_ended_by_the_model_is_not_forced_again() -> None:
    budget = ThinkingBudget(end_token_id=9, budget=2)
    assert budget.forced_token([1]) is None
    assert budget.forced_token([1, 9]) is None
    assert budget.forced_token([1, 9, 4, 5]) is None
    fresh = ThinkingBudget(end_token_id=9, budget=2)
    assert fresh.forced_token([1, 2]) == 9
    assert fresh.forced_token([1, 2, 9]) is None
    assert fresh.forced_token([1, 2]) == 9  # the end token was taken back


def test_a_forced_token_overrides_every_other_mask() -> None:
    params = SamplingParams(temperature=0.8, allowed_token_ids=[1, 2], logit_bias={5: -100.0})
    requests = [
        SamplingRequest(params, forced_token_id=5, seed=1),
        SamplingRequest(params, seed=1),
    ]
    batch = SamplingBatch.build(requests, vocab_size=8)
    out = Sampler()(torch.zeros(2, 8), batch)
    assert out.token_ids[0] == 5 and out.token_ids[1] in (1, 2)
