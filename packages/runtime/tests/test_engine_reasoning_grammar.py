"""Structured output for reasoning models (`require_reasoning`): the output is free until
`</think>`, and the constraint applies from the token after it.

Two tiny random Llamas: one whose tokenizer writes `</think>` as seven BPE tokens (the
thinking is scripted with a custom logit processor that forces a given token sequence and then
leaves the logits alone), and one holding `<think>` / `</think>` as added tokens, as Qwen3's
does (its thinking is the model's own greedy text, ended by `thinking_token_budget`).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import ScriptedTokensProcessor, build_tiny_model
from radixlm.runtime.thinking import THINK_END, end_of_thinking_token, think_end_ids
from radixlm.sampling import InvalidRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CITY = {
    "type": "object",
    "properties": {
        "name": {"enum": ["Paris", "London"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
    },
    "required": ["name", "population"],
    "additionalProperties": False,
}
GREEDY: dict[str, Any] = {"temperature": 0, "max_new_tokens": 64}
CONSTRAINED: dict[str, Any] = {**GREEDY, "json_schema": json.dumps(CITY)}
THOUGHT = "I think { this is not JSON"
_keys = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-reasoning"))


def _engine(model_dir: Path, engine_process: bool) -> Engine:
    return Engine(
        str(model_dir),
        show_progress=False,
        max_total_tokens=2048,
        enable_custom_logit_processor=True,
        engine_process=engine_process,
    )


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    with _engine(model_dir, engine_process=False) as eng:
        yield eng


def scripted(engine: Engine, text: str, **params: Any) -> tuple[dict[str, Any], list[int]]:
    """Params whose first output tokens are `text`'s, then the model's own; and those ids."""
    ids = list(engine.tokenizer.encode(text, add_special_tokens=False))
    custom = {"script": ids, "script_key": f"r{next(_keys)}"}
    return {**params, "custom_params": custom}, ids


def answer(text: str) -> Any:
    """The JSON after the reasoning, validated against the schema."""
    assert text.count(THINK_END) == 1
    value = json.loads(text.split(THINK_END, 1)[1])
    jsonschema.validate(value, CITY)
    return value


def test_a_marker_of_several_tokens_frees_the_thinking_and_constrains_the_answer(
    engine: Engine,
) -> None:
    assert len(think_end_ids(engine.tokenizer)) > 1
    params, script = scripted(engine, f"{THOUGHT}{THINK_END}", **CONSTRAINED)
    out = engine.generate(
        "the answer",
        params,
        custom_logit_processor=ScriptedTokensProcessor.to_str(),
        require_reasoning=True,
    )
    assert out["output_ids"][: len(script)] == script  # no mask refused the free text
    assert out["text"].startswith(THOUGHT)
    answer(out["text"])
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    engine.check_invariants()


def test_the_same_free_text_is_refused_when_the_constraint_applies_from_the_start(
    engine: Engine,
) -> None:
    params, _ = scripted(engine, f"{THOUGHT}{THINK_END}", **CONSTRAINED)
    out = engine.generate(
        "the answer", params, custom_logit_processor=ScriptedTokensProcessor.to_str()
    )
    # The forced thinking's first token is masked: nothing the grammar allows is left.
    assert out["output_ids"] == []
    finish = out["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and "does not allow" in finish["message"]


def test_without_require_reasoning_the_output_is_the_constrained_output_as_before(
    engine: Engine,
) -> None:
    before = engine.generate("the answer", CONSTRAINED)
    again = engine.generate("the answer", CONSTRAINED, require_reasoning=False)
    assert again["output_ids"] == before["output_ids"]
    jsonschema.validate(json.loads(before["text"]), CITY)


def test_a_thinking_that_never_ends_is_never_constrained(engine: Engine) -> None:
    free = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    unconstrained = engine.generate("the answer", free)["output_ids"]
    out = engine.generate(
        "the answer", {**free, "json_schema": json.dumps(CITY)}, require_reasoning=True
    )
    assert out["output_ids"] == unconstrained
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_max_new_tokens_counts_the_thinking_and_the_answer(engine: Engine) -> None:
    params, script = scripted(engine, f"{THOUGHT}{THINK_END}", **CONSTRAINED)
    params["max_new_tokens"] = len(script) + 3
    out = engine.generate(
        "the answer",
        params,
        custom_logit_processor=ScriptedTokensProcessor.to_str(),
        require_reasoning=True,
    )
    assert len(out["output_ids"]) == len(script) + 3
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_a_streamed_output_adds_up_to_the_whole_one(engine: Engine) -> None:
    _streamed_equals_whole(engine)


def test_a_streamed_output_from_an_engine_process_adds_up_to_the_whole_one(
    model_dir: Path,
) -> None:
    with _engine(model_dir, engine_process=True) as engine:
        _streamed_equals_whole(engine)


def _streamed_equals_whole(engine: Engine) -> None:
    params, _ = scripted(engine, f"{THOUGHT}{THINK_END}", **CONSTRAINED)
    whole = engine.generate(
        "the answer",
        params,
        custom_logit_processor=ScriptedTokensProcessor.to_str(),
        require_reasoning=True,
    )
    params, _ = scripted(engine, f"{THOUGHT}{THINK_END}", **CONSTRAINED)
    chunks = list(
        engine.generate(
            "the answer",
            params,
            custom_logit_processor=ScriptedTokensProcessor.to_str(),
            require_reasoning=True,
            stream=True,
        )
    )
    assert len(chunks) > 2
    assert chunks[-1]["text"] == whole["text"]
    answer(chunks[-1]["text"])


# A tokenizer that holds `</think>` as one token, and a thinking ended by its budget.


@pytest.fixture(scope="module")
def think_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("tiny-think-tokens"))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path))
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(str(path))
    with Engine(str(path), show_progress=False, max_total_tokens=2048) as eng:
        yield eng


def test_a_one_token_marker_forced_by_the_thinking_budget_starts_the_constraint(
    think_engine: Engine,
) -> None:
    end_id = end_of_thinking_token(think_engine.tokenizer)
    assert end_id is not None
    free = think_engine.generate("hello world", {**GREEDY, "ignore_eos": True})["output_ids"]
    assert end_id not in free[:4]
    out = think_engine.generate(
        "hello world", {**CONSTRAINED, "thinking_token_budget": 4}, require_reasoning=True
    )
    ids = out["output_ids"]
    assert ids[:4] == free[:4]  # the model's own thinking, unmasked
    assert ids[4] == end_id
    answer(out["text"])
    think_engine.check_invariants()


def test_a_budget_with_a_constraint_needs_require_reasoning(think_engine: Engine) -> None:
    with pytest.raises(InvalidRequest) as error:
        think_engine.generate("x", {**CONSTRAINED, "thinking_token_budget": 2})
    assert error.value.field == "thinking_token_budget"
    assert "require_reasoning" in error.value.message
