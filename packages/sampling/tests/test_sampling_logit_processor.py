"""CustomLogitProcessor: serialisation by reference, by value (SGLang's form), and errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixlm.sampling import CustomLogitProcessor


class BanFirstToken(CustomLogitProcessor):
    def __call__(self, logits: Any, custom_param_list: list[dict[str, Any] | None]) -> Any:
        for row in logits:
            row[0] = float("-inf")
        return logits


def test_to_str_and_from_str_round_trip_to_the_class() -> None:
    text = BanFirstToken.to_str()
    assert CustomLogitProcessor.from_str(text) is BanFirstToken
    processor = CustomLogitProcessor.from_str(text)()
    assert processor([[1.0, 2.0]], [None]) == [[float("-inf"), 2.0]]


def test_a_class_defined_in_a_function_is_sent_by_value_in_sglangs_form() -> None:
    class Local(CustomLogitProcessor):
        def __call__(self, logits: Any, custom_param_list: list[dict[str, Any] | None]) -> Any:
            return [[v * 2 for v in row] for row in logits]

    payload = json.loads(Local().to_str())  # SGLang's example calls it on an instance
    assert set(payload) == {"callable"}  # SGLang's shape: hex of the dill-pickled class
    loaded = CustomLogitProcessor.from_str(json.dumps(payload))
    assert issubclass(loaded, CustomLogitProcessor) and loaded.__name__ == "Local"
    assert loaded()([[1.0, 2.0]], [None]) == [[2.0, 4.0]]


def test_sglangs_own_serialisation_of_a_subclass_loads() -> None:
    import dill

    class Sglang(CustomLogitProcessor):
        def __call__(self, logits: Any, custom_param_list: list[dict[str, Any] | None]) -> Any:
            return logits

    text = json.dumps({"callable": dill.dumps(Sglang).hex()})  # what SGLang's to_str() does
    assert CustomLogitProcessor.from_str(text).__name__ == "Sglang"


def test_a_pickled_object_that_is_not_a_processor_class_is_rejected() -> None:
    import dill

    for value in (len, {"a": 1}, BanFirstToken()):
        text = json.dumps({"callable": dill.dumps(value).hex()})
        with pytest.raises(ValueError, match="not a subclass"):
            CustomLogitProcessor.from_str(text)


@pytest.mark.parametrize("text", ["not json", "{}", json.dumps({"callable": 3})])
def test_malformed_strings_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="custom_logit_processor"):
        CustomLogitProcessor.from_str(text)


def test_a_name_that_does_not_import_is_rejected() -> None:
    text = BanFirstToken.to_str().replace("BanFirstToken", "Missing")
    with pytest.raises(ValueError, match="cannot load"):
        CustomLogitProcessor.from_str(text)


def test_a_name_that_is_not_a_processor_is_rejected() -> None:
    text = json.dumps({"format": "radixlm.custom_logit_processor/1", "callable": "json:dumps"})
    with pytest.raises(ValueError, match="not a CustomLogitProcessor"):
        CustomLogitProcessor.from_str(text)


def test_the_base_class_is_abstract() -> None:
    with pytest.raises(TypeError):
        CustomLogitProcessor()  # type: ignore[abstract]
