"""Texts in logprob entries: each token's own text, special tokens written out (SGLang's
layout), whatever the request's skip_special_tokens says about the output text."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHAT_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    with Engine(
        str(model_dir),
        show_progress=False,
        max_total_tokens=1024,
        engine_process=request.param == "process",
    ) as eng:
        yield eng


def test_prompt_logprob_texts_spell_the_prompt_with_its_special_tokens(engine: Engine) -> None:
    out = engine.generate(
        CHAT_PROMPT,
        {"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
        return_text_in_logprobs=True,
    )
    entries = out["meta_info"]["input_token_logprobs"]
    assert "".join(entry[2] for entry in entries) == CHAT_PROMPT


def test_a_special_output_tokens_logprob_text_is_its_own_text(engine: Engine) -> None:
    end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = engine.generate(
        CHAT_PROMPT,
        {"max_new_tokens": 1, "logit_bias": {str(end): 100.0}},
        return_logprob=True,
        return_text_in_logprobs=True,
    )
    assert out["output_ids"] == [end] and out["text"] == ""
    assert out["meta_info"]["output_token_logprobs"][0][1:] == [end, "<|im_end|>"]
