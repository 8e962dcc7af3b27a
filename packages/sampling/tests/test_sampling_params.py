"""SamplingParams: ranges, aliases, constraints, vocabulary checks and error messages."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from radixlm.sampling import InvalidRequest, RepetitionDetection, SamplingParams

# field -> (values accepted at and inside the boundaries, values rejected just outside)
BOUNDARIES: dict[str, tuple[list[Any], list[Any]]] = {
    "temperature": ([0.0, 1e-6, 1.0, 100.0], [-1e-6, -1.0]),
    "top_p": ([1e-6, 0.5, 1.0], [0.0, -0.1, 1.000001]),
    "top_k": ([-1, 0, 1, 50, 10**6], [-2, -100]),  # 0: no cap (vLLM), as -1
    "min_p": ([0.0, 0.5, 1.0], [-1e-6, 1.000001]),
    "frequency_penalty": ([-2.0, 0.0, 2.0], [-2.000001, 2.000001]),
    "presence_penalty": ([-2.0, 0.0, 2.0], [-2.000001, 2.000001]),
    "repetition_penalty": ([1e-6, 1.0, 2.0], [0.0, -1.0, 2.000001]),
    "max_new_tokens": ([0, 1, 128, None], [-1]),
    "min_new_tokens": ([0, 1, 128], [-1]),
    "n": ([1, 2, 64], [0, -1]),
    "logprobs": ([-1, 0, 5, None], [-2]),  # -1: the whole vocabulary (vLLM)
    "prompt_logprobs": ([-1, 0, 5, None], [-2]),
    "thinking_token_budget": ([0, 100, None], [-1]),
}


def _cases(accepted: bool) -> list[tuple[str, Any]]:
    return [(f, v) for f, (ok, bad) in BOUNDARIES.items() for v in (ok if accepted else bad)]


@pytest.mark.parametrize(("field", "value"), _cases(accepted=True))
def test_boundary_values_are_accepted(field: str, value: Any) -> None:
    extra = {"max_new_tokens": None} if field == "min_new_tokens" else {}
    params = SamplingParams.parse({field: value, **extra})
    assert getattr(params, field) == value


@pytest.mark.parametrize(("field", "value"), _cases(accepted=False))
def test_values_outside_the_range_are_rejected_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams.parse({field: value})
    assert caught.value.field == field
    assert field in str(caught.value)
    assert str(value) in caught.value.message or f"{value:g}" in caught.value.message


def test_defaults_are_sglangs() -> None:
    params = SamplingParams()
    assert params.max_new_tokens == 128
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, -1, 0.0)
    assert (params.frequency_penalty, params.presence_penalty) == (0.0, 0.0)
    assert params.repetition_penalty == 1.0
    assert params.n == 1
    assert params.skip_special_tokens and params.spaces_between_special_tokens
    assert not params.ignore_eos and not params.no_stop_trim


def test_vllm_aliases_set_sglang_fields() -> None:
    params = SamplingParams.parse({"max_tokens": 7, "min_tokens": 3})
    assert (params.max_new_tokens, params.min_new_tokens) == (7, 3)


def test_alias_and_name_with_the_same_value_are_accepted() -> None:
    assert SamplingParams.parse({"max_tokens": 7, "max_new_tokens": 7}).max_new_tokens == 7


def test_alias_and_name_with_different_values_are_rejected() -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams.parse({"max_tokens": 7, "max_new_tokens": 8})
    assert caught.value.field == "max_tokens"
    assert "alias of max_new_tokens" in caught.value.message


def test_unknown_field_is_rejected_with_a_suggestion() -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams.parse({"temprature": 0.5})
    assert caught.value.field == "temprature"
    assert "'temperature'" in caught.value.message


def test_unknown_field_without_a_close_name_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="unknown sampling parameter"):
        SamplingParams.parse({"zzzzzz": 1})


def test_constructor_raises_pydantic_error_for_bad_values() -> None:
    with pytest.raises(ValidationError):
        SamplingParams(temperature=-1)


def test_params_are_immutable() -> None:
    params = SamplingParams()
    with pytest.raises(ValidationError):
        params.temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"json_schema": "{}"}, {"regex": "a+"}),
        ({"regex": "a+"}, {"ebnf": 'root ::= "a"'}),
        ({"ebnf": 'root ::= "a"'}, {"choice": ["a"]}),
        ({"structural_tag": "{}"}, {"json_schema": "{}"}),
    ],
)
def test_at_most_one_structured_output_constraint(
    first: dict[str, Any], second: dict[str, Any]
) -> None:
    with pytest.raises(InvalidRequest, match="only one structured-output constraint"):
        SamplingParams.parse({**first, **second})


def test_constraint_reports_the_one_given() -> None:
    assert SamplingParams(regex="[ab]+").constraint == ("regex", "[ab]+")
    assert SamplingParams(choice=["x", "y"]).constraint == ("choice", ["x", "y"])
    assert SamplingParams().constraint is None


def test_strict_constraint_defaults_to_the_servers_choice() -> None:
    assert SamplingParams().strict_constraint is None
    params = SamplingParams.parse({"json_schema": "{}", "strict_constraint": True})
    assert params.strict_constraint is True
    assert params.constraint == ("json_schema", "{}")  # not a constraint itself


def test_strict_constraint_must_be_a_boolean() -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams.parse({"regex": "a+", "strict_constraint": "very"})
    assert caught.value.field == "strict_constraint"


def test_json_schema_must_be_json_text() -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams.parse({"json_schema": "{not json"})
    assert caught.value.field == "json_schema"
    assert "json.dumps" in caught.value.message


def test_json_schema_given_as_an_object_is_rejected() -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams.parse({"json_schema": {"type": "object"}})
    assert caught.value.field == "json_schema"


def test_empty_choice_and_empty_regex_are_rejected() -> None:
    with pytest.raises(InvalidRequest, match="at least one"):
        SamplingParams.parse({"choice": []})
    with pytest.raises(InvalidRequest, match="must not be empty"):
        SamplingParams.parse({"regex": ""})


def test_invalid_stop_regex_is_rejected() -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams.parse({"stop_regex": ["ok", "(unclosed"]})
    assert caught.value.field == "stop_regex"
    assert "(unclosed" in caught.value.message


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="must not be empty"):
        SamplingParams.parse({"stop": ["\n", ""]})


def test_stop_views_are_lists() -> None:
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams().stop_strings == []
    assert SamplingParams(stop_regex=r"\d").stop_regexes == [r"\d"]


def test_min_new_tokens_may_not_exceed_max_new_tokens() -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams.parse({"min_new_tokens": 10, "max_new_tokens": 5})
    assert caught.value.field == "min_new_tokens"
    assert "max_new_tokens (5)" in caught.value.message


def test_logit_bias_keys_arrive_as_strings_from_json() -> None:
    params = SamplingParams.parse(json.loads('{"logit_bias": {"42": -100, "7": 2.5}}'))
    assert params.logit_bias == {42: -100.0, 7: 2.5}


@pytest.mark.parametrize("bias", [-100.0001, 100.0001])
def test_logit_bias_outside_the_openai_range_is_rejected(bias: float) -> None:
    with pytest.raises(InvalidRequest, match=r"\[-100, 100\]"):
        SamplingParams.parse({"logit_bias": {"1": bias}})


def test_negative_token_ids_are_rejected() -> None:
    for field in ("stop_token_ids", "allowed_token_ids", "logprob_token_ids"):
        with pytest.raises(InvalidRequest) as caught:
            SamplingParams.parse({field: [1, -2]})
        assert caught.value.field == field


def test_empty_allowed_token_ids_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="must not be empty"):
        SamplingParams.parse({"allowed_token_ids": []})


@pytest.mark.parametrize(
    "field", ["stop_token_ids", "allowed_token_ids", "logprob_token_ids", "logit_bias"]
)
def test_check_rejects_token_ids_outside_the_vocabulary(field: str) -> None:
    value: Any = {"100": 1.0} if field == "logit_bias" else [3, 100]
    params = SamplingParams.parse({field: value})
    params.check(vocab_size=101)
    with pytest.raises(InvalidRequest) as caught:
        params.check(vocab_size=100)
    assert caught.value.field == field
    assert "0..99" in caught.value.message


def test_check_rejects_more_logprobs_than_the_vocabulary() -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(logprobs=20).check(vocab_size=10)
    assert caught.value.field == "logprobs"


def test_repetition_detection_window_must_hold_the_repeats() -> None:
    RepetitionDetection(ngram_size=4, repeats=3, window=12)
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams.parse(
            {"repetition_detection": {"ngram_size": 4, "repeats": 3, "window": 11}}
        )
    assert caught.value.field == "repetition_detection"


def test_nested_field_errors_carry_the_path() -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams.parse({"repetition_detection": {"ngram_size": 0}})
    assert caught.value.field == "repetition_detection.ngram_size"


def test_greedy_is_temperature_zero_or_top_k_one() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams().is_greedy


def test_keeps_stop_string_under_either_name() -> None:
    assert SamplingParams(no_stop_trim=True).keeps_stop_string
    assert SamplingParams(include_stop_str_in_output=True).keeps_stop_string
    assert not SamplingParams().keeps_stop_string


def test_every_error_is_listed() -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams.parse({"temperature": -1, "top_p": 5})
    assert {e.field for e in caught.value.errors} == {"temperature", "top_p"}


def test_field_prefix_names_the_nesting() -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams.parse({"top_p": 0}, field_prefix="sampling_params")
    assert caught.value.field == "sampling_params.top_p"
