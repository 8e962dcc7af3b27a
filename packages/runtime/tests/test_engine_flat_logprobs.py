"""vLLM's `flat_logprobs`: the same logprobs as the nested layout, as columns with offsets."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    path = build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    with Engine(
        str(path),
        show_progress=False,
        max_total_tokens=2048,
        engine_process=request.param == "process",
    ) as eng:
        yield eng


def _nested_to_flat(positions: list[Any]) -> dict[str, list[Any]]:
    offsets, logprobs, ids, texts = [0], [], [], []
    for row in positions:
        for entry in row or []:
            logprobs.append(entry[0])
            ids.append(entry[1])
            texts.append(entry[2])
        offsets.append(len(ids))
    return {"logprobs": logprobs, "token_ids": ids, "texts": texts, "offsets": offsets}


def test_flat_logprobs_hold_exactly_the_nested_ones(engine: Engine) -> None:
    params: dict[str, Any] = {
        "temperature": 0,
        "max_new_tokens": 6,
        "ignore_eos": True,
        "logprobs": 3,
        "prompt_logprobs": 2,
        "logprob_token_ids": [4, 9],
    }
    kwargs = {"return_text_in_logprobs": True}
    nested = engine.generate("flat logprobs", params, **kwargs)["meta_info"]
    flat = engine.generate("flat logprobs", {**params, "flat_logprobs": True}, **kwargs)[
        "meta_info"
    ]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        rows = nested[key]
        assert flat[key] == {
            "logprobs": [r[0] for r in rows],
            "token_ids": [r[1] for r in rows],
            "texts": [r[2] for r in rows],
        }
    for key in ("output_top_logprobs", "input_top_logprobs", "output_token_ids_logprobs"):
        assert flat[key] == _nested_to_flat(nested[key]), key
    offsets = flat["output_top_logprobs"]["offsets"]
    assert offsets == [3 * i for i in range(7)]  # 3 per output token
    assert flat["input_top_logprobs"]["offsets"][:2] == [0, 0]  # the first prompt token: none
