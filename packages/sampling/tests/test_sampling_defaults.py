"""SamplingDefaults: request > model generation_config > constants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixlm.sampling import InvalidRequest, SamplingDefaults, SamplingParams

QWEN_LIKE = {
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
}


def test_model_defaults_fill_fields_the_request_left_unset() -> None:
    defaults = SamplingDefaults.from_generation_config(QWEN_LIKE)
    params = defaults.apply(SamplingParams(max_new_tokens=5))
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.8, 20)
    assert params.repetition_penalty == 1.05
    assert params.max_new_tokens == 5


def test_request_values_win_over_model_defaults() -> None:
    defaults = SamplingDefaults.from_generation_config(QWEN_LIKE)
    params = defaults.apply(SamplingParams(temperature=0.0, top_k=-1))
    assert params.temperature == 0.0
    assert params.top_k == -1
    assert params.top_p == 0.8


def test_request_value_equal_to_the_constant_still_wins() -> None:
    # temperature=1.0 is also the constant default; having been sent, it must be kept.
    params = SamplingDefaults.from_generation_config(QWEN_LIKE).apply(
        SamplingParams(temperature=1.0)
    )
    assert params.temperature == 1.0


def test_constants_apply_when_the_model_has_no_defaults() -> None:
    assert SamplingDefaults.from_generation_config({}).apply(None) == SamplingParams()


def test_openai_mode_ignores_the_model_file() -> None:
    defaults = SamplingDefaults.from_generation_config(QWEN_LIKE, mode="openai")
    assert defaults.apply(None) == SamplingParams()
    assert defaults.values["temperature"] == 0.7


def test_reads_generation_config_from_a_model_directory(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    defaults = SamplingDefaults.from_generation_config(tmp_path)
    assert defaults.apply(None).temperature == 0.6
    assert SamplingDefaults.from_generation_config(tmp_path / "generation_config.json").values == {
        "temperature": 0.6
    }


def test_missing_generation_config_means_no_model_defaults(tmp_path: Path) -> None:
    assert SamplingDefaults.from_generation_config(tmp_path).values == {}


def test_hf_top_k_zero_means_disabled() -> None:
    assert SamplingDefaults.from_generation_config({"top_k": 0}).values == {"top_k": -1}


def test_unrelated_generation_config_keys_are_ignored() -> None:
    values = SamplingDefaults.from_generation_config(QWEN_LIKE).values
    assert set(values) == {"temperature", "top_p", "top_k", "repetition_penalty"}


def test_invalid_model_defaults_are_reported() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingDefaults.from_generation_config({"top_p": 0.0})


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="'model' or 'openai'"):
        SamplingDefaults(mode="vllm")  # type: ignore[arg-type]


def test_conflict_between_request_and_model_default_is_an_invalid_request() -> None:
    defaults = SamplingDefaults.from_generation_config({"max_new_tokens": 4})
    with pytest.raises(InvalidRequest) as caught:
        defaults.apply(SamplingParams(min_new_tokens=8))
    assert caught.value.field == "min_new_tokens"


def test_apply_does_not_mutate_the_request() -> None:
    request = SamplingParams(top_p=0.5)
    SamplingDefaults.from_generation_config(QWEN_LIKE).apply(request)
    assert request.model_fields_set == {"top_p"}
    assert request.temperature == 1.0
