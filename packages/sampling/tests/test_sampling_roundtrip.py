"""Property: any valid SamplingParams survives model_dump -> parse unchanged."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.sampling import GenerateRequest, SamplingParams

token_ids = st.lists(st.integers(min_value=0, max_value=50_000), max_size=5)
words = st.text(min_size=1, max_size=8)


@st.composite
def sampling_fields(draw: st.DrawFn) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    optional: dict[str, st.SearchStrategy[Any]] = {
        "temperature": st.floats(min_value=0, max_value=10, allow_nan=False),
        "top_p": st.floats(min_value=1e-6, max_value=1.0),
        "top_k": st.one_of(st.just(-1), st.integers(min_value=1, max_value=1000)),
        "min_p": st.floats(min_value=0, max_value=1),
        "frequency_penalty": st.floats(min_value=-2, max_value=2),
        "presence_penalty": st.floats(min_value=-2, max_value=2),
        "repetition_penalty": st.floats(min_value=1e-3, max_value=2),
        "stop": st.one_of(words, st.lists(words, max_size=3)),
        "stop_token_ids": token_ids,
        "logit_bias": st.dictionaries(
            st.integers(min_value=0, max_value=50_000),
            st.floats(min_value=-100, max_value=100),
            max_size=3,
        ),
        "allowed_token_ids": token_ids.filter(bool),
        "bad_words": st.lists(words, max_size=3),
        "seed": st.integers(min_value=0, max_value=2**63 - 1),
        "n": st.integers(min_value=1, max_value=8),
        "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "no_stop_trim": st.booleans(),
        "logprobs": st.integers(min_value=0, max_value=20),
        "custom_params": st.dictionaries(words, st.integers(), max_size=2),
        "regex": st.sampled_from(["[a-z]+", r"\d{3}", "(yes|no)"]),
        "choice": st.lists(words, min_size=1, max_size=3),
        "strict_constraint": st.booleans(),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            fields[name] = draw(strategy)
    if "regex" in fields and "choice" in fields:
        del fields["choice"]
    max_new = draw(st.one_of(st.none(), st.integers(min_value=0, max_value=4096)))
    fields["max_new_tokens"] = max_new
    fields["min_new_tokens"] = draw(
        st.integers(min_value=0, max_value=4096 if max_new is None else max_new)
    )
    return fields


@settings(max_examples=200, deadline=None)
@given(sampling_fields())
def test_valid_params_survive_dump_and_parse(fields: dict[str, Any]) -> None:
    params = SamplingParams.parse(fields)
    assert SamplingParams.parse(params.model_dump()) == params


@settings(max_examples=200, deadline=None)
@given(sampling_fields())
def test_valid_params_survive_a_json_round_trip(fields: dict[str, Any]) -> None:
    params = SamplingParams.parse(fields)
    assert SamplingParams.parse(json.loads(params.model_dump_json())) == params


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=10), min_size=1, max_size=5), sampling_fields())
def test_split_items_carry_the_batch_values(prompts: list[str], fields: dict[str, Any]) -> None:
    request = GenerateRequest.parse({"text": prompts, "sampling_params": fields})
    items = request.split()
    assert [item.text for item in items] == prompts
    assert all(item.params == SamplingParams.parse(fields) for item in items)
