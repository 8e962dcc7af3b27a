"""CustomLogitProcessor: serialisation by reference and its errors."""

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


def test_a_class_defined_in_a_function_cannot_be_serialised() -> None:
    class Local(CustomLogitProcessor):
        def __call__(self, logits: Any, custom_param_list: list[dict[str, Any] | None]) -> Any:
            return logits

    with pytest.raises(ValueError, match="importable module"):
        Local.to_str()


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
