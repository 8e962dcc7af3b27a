"""GenerateRequest: inputs, batch normalisation and split()."""

from __future__ import annotations

from typing import Any

import pytest

from radixlm.sampling import GenerateRequest, InvalidRequest, SamplingParams


def test_single_text_request() -> None:
    request = GenerateRequest.parse({"text": "Hello", "sampling_params": {"temperature": 0}})
    assert request.is_single and request.batch_size == 1
    assert request.params.temperature == 0
    assert request.split() == [request]


def test_single_request_without_sampling_params_uses_defaults() -> None:
    assert GenerateRequest.parse({"input_ids": [1, 2, 3]}).params == SamplingParams()


@pytest.mark.parametrize(
    "body",
    [
        {"text": ["a", "b", "c"]},
        {"input_ids": [[1], [2, 3], [4]]},
        {"input_embeds": [[[0.1, 0.2]], [[0.3, 0.4]], [[0.5, 0.6], [0.7, 0.8]]]},
    ],
)
def test_each_input_kind_makes_a_batch(body: dict[str, Any]) -> None:
    request = GenerateRequest.parse(body)
    assert not request.is_single
    assert request.batch_size == 3
    assert all(item.is_single for item in request.split())


def test_single_input_embeds_is_not_a_batch() -> None:
    request = GenerateRequest.parse({"input_embeds": [[0.1, 0.2], [0.3, 0.4]]})
    assert request.is_single


def test_split_broadcasts_scalars_and_takes_lists_per_item() -> None:
    request = GenerateRequest.parse(
        {
            "text": ["a", "b"],
            "rid": ["r1", "r2"],
            "sampling_params": {"temperature": 0.5},
            "return_logprob": [True, False],
            "top_logprobs_num": 3,
            "token_ids_logprob": [5, 6],
            "lora_path": [None, "adapter"],
            "stream": True,
        }
    )
    first, second = request.split()
    assert (first.text, first.rid, first.return_logprob, first.lora_path) == ("a", "r1", True, None)
    assert (second.text, second.rid, second.return_logprob) == ("b", "r2", False)
    assert second.lora_path == "adapter"
    assert first.top_logprobs_num == second.top_logprobs_num == 3
    assert first.token_ids_logprob == second.token_ids_logprob == [5, 6]
    assert first.params.temperature == second.params.temperature == 0.5
    assert first.stream and second.stream


def test_require_reasoning_is_broadcast_or_taken_per_item() -> None:
    assert GenerateRequest.parse({"text": "a"}).require_reasoning is False
    both = GenerateRequest.parse({"text": ["a", "b"], "require_reasoning": True}).split()
    assert [item.require_reasoning for item in both] == [True, True]
    each = GenerateRequest.parse({"text": ["a", "b"], "require_reasoning": [True, False]})
    assert [item.require_reasoning for item in each.split()] == [True, False]


def test_split_takes_per_item_sampling_params_and_logprob_ids() -> None:
    request = GenerateRequest.parse(
        {
            "input_ids": [[1, 2], [3]],
            "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
            "token_ids_logprob": [[7], [8, 9]],
            "image_data": ["img-a.png", ["img-b.png", "img-c.png"]],
        }
    )
    first, second = request.split()
    assert (first.input_ids, first.params.max_new_tokens) == ([1, 2], 1)
    assert (second.input_ids, second.params.max_new_tokens) == ([3], 2)
    assert first.token_ids_logprob == [7] and second.token_ids_logprob == [8, 9]
    assert first.image_data == "img-a.png"
    assert second.image_data == ["img-b.png", "img-c.png"]


def test_split_does_not_change_the_batch() -> None:
    request = GenerateRequest.parse({"text": ["a", "b"], "rid": ["1", "2"]})
    before = request.model_dump()
    request.split()
    assert request.model_dump() == before


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rid", ["only-one"]),
        ("sampling_params", [{}, {}, {}]),
        ("return_logprob", [True]),
        ("logprob_start_len", [0, 1, 2]),
        ("token_ids_logprob", [[1]]),
        ("image_data", ["x.png"]),
    ],
)
def test_batch_lists_of_the_wrong_length_are_rejected(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as caught:
        GenerateRequest.parse({"text": ["a", "b"], field: value})
    assert caught.value.field == field
    assert "batch has 2" in caught.value.message


def test_batch_rejects_a_single_rid() -> None:
    with pytest.raises(InvalidRequest) as caught:
        GenerateRequest.parse({"text": ["a", "b"], "rid": "same"})
    assert caught.value.field == "rid"


def test_batch_rejects_duplicate_rids() -> None:
    with pytest.raises(InvalidRequest, match="distinct"):
        GenerateRequest.parse({"text": ["a", "b"], "rid": ["x", "x"]})


def test_batch_media_must_be_a_list() -> None:
    with pytest.raises(InvalidRequest, match="one entry per prompt"):
        GenerateRequest.parse({"text": ["a", "b"], "image_data": "x.png"})


@pytest.mark.parametrize("field", ["rid", "return_logprob", "sampling_params"])
def test_single_request_rejects_lists(field: str) -> None:
    value = {"rid": ["a"], "return_logprob": [True], "sampling_params": [{}]}[field]
    with pytest.raises(InvalidRequest) as caught:
        GenerateRequest.parse({"text": "a", field: value})
    assert caught.value.field == field


def test_no_input_is_rejected() -> None:
    with pytest.raises(InvalidRequest) as caught:
        GenerateRequest.parse({"sampling_params": {}})
    assert caught.value.field == "text"
    assert "input_ids" in caught.value.message


def test_several_inputs_are_rejected() -> None:
    with pytest.raises(InvalidRequest) as caught:
        GenerateRequest.parse({"text": "a", "input_ids": [1]})
    assert caught.value.field == "input_ids"


@pytest.mark.parametrize("body", [{"text": []}, {"input_ids": [[1], []]}, {"input_ids": []}])
def test_empty_prompts_are_rejected(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        GenerateRequest.parse(body)


def test_negative_input_ids_are_rejected() -> None:
    with pytest.raises(InvalidRequest, match=">= 0"):
        GenerateRequest.parse({"input_ids": [1, -5]})


def test_logprob_start_len_below_minus_one_is_rejected() -> None:
    with pytest.raises(InvalidRequest) as caught:
        GenerateRequest.parse({"text": "a", "logprob_start_len": -2})
    assert caught.value.field == "logprob_start_len"


def test_sampling_param_errors_name_the_nested_field() -> None:
    with pytest.raises(InvalidRequest) as caught:
        GenerateRequest.parse({"text": "a", "sampling_params": {"top_p": 2}})
    assert caught.value.field == "sampling_params.top_p"


def test_unknown_request_field_is_rejected() -> None:
    with pytest.raises(InvalidRequest) as caught:
        GenerateRequest.parse({"text": "a", "prompt": "b"})
    assert caught.value.field == "prompt"


def test_params_of_a_batch_must_be_split_first() -> None:
    request = GenerateRequest.parse({"text": ["a"], "sampling_params": [{}]})
    with pytest.raises(TypeError, match="split"):
        _ = request.params


def test_bootstrap_fields_are_broadcast_or_taken_per_item() -> None:
    request = GenerateRequest.parse(
        {
            "text": ["a", "b"],
            "bootstrap_host": "10.0.0.1",
            "bootstrap_port": 8998,
            "bootstrap_room": [7, 2**63 - 1],
        }
    )
    items = request.split()
    assert [(i.bootstrap_host, i.bootstrap_port, i.bootstrap_room) for i in items] == [
        ("10.0.0.1", 8998, 7),
        ("10.0.0.1", 8998, 2**63 - 1),
    ]


def test_batch_takes_one_distinct_bootstrap_room_per_prompt() -> None:
    with pytest.raises(InvalidRequest, match="one per prompt") as caught:
        GenerateRequest.parse({"text": ["a", "b"], "bootstrap_room": 7})
    assert caught.value.field == "bootstrap_room"
    with pytest.raises(InvalidRequest, match="distinct"):
        GenerateRequest.parse({"text": ["a", "b"], "bootstrap_room": [7, 7]})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("bootstrap_room", -1),
        ("bootstrap_room", 2**63),
        ("bootstrap_port", 0),
        ("bootstrap_port", 70000),
        ("bootstrap_host", " "),
    ],
)
def test_bootstrap_values_out_of_range_are_rejected(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as caught:
        GenerateRequest.parse({"text": "a", field: value})
    assert caught.value.field == field
