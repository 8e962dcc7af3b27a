"""The transformers logits processor: model.generate under a constraint."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, LogitsProcessorList

from radixlm.constrained import GrammarError, GrammarSpec
from radixlm.constrained.hf import GrammarLogitsProcessor


@pytest.fixture(scope="module")
def model() -> Any:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=1024, n_positions=128, n_embd=32, n_layer=1, n_head=2,
        bos_token_id=0, eos_token_id=0, pad_token_id=1,
    )  # fmt: skip
    return GPT2LMHeadModel(config).eval()


def generate(model: Any, tokenizer: Any, processor: Any, **kwargs: Any) -> list[str]:
    inputs = tokenizer(["Answer:"], return_tensors="pt")
    out = model.generate(
        **inputs,
        logits_processor=LogitsProcessorList([processor]),
        max_new_tokens=60,
        pad_token_id=1,
        eos_token_id=0,
        **kwargs,
    )
    new = out[:, inputs["input_ids"].shape[1] :]
    return [tokenizer.decode([t for t in row.tolist() if t not in (0, 1)]) for row in new]


def test_greedy_generation_matches_the_regex(model: Any, hf_tokenizer: Any) -> None:
    processor = GrammarLogitsProcessor.from_tokenizer(
        hf_tokenizer, GrammarSpec("regex", r"[0-9]{3}-[a-z]{2,4}"), vocab_size=1024
    )
    (text,) = generate(model, hf_tokenizer, processor, do_sample=False)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_sampled_generations_validate_against_the_schema(
    model: Any, hf_tokenizer: Any, backend: str
) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "blue"]}},
        "required": ["ok", "tag"],
    }
    processor = GrammarLogitsProcessor.from_tokenizer(
        hf_tokenizer,
        GrammarSpec("json_schema", json.dumps(schema)),
        backend=backend,
        vocab_size=1024,
    )
    torch.manual_seed(1)
    texts = generate(model, hf_tokenizer, processor, do_sample=True, num_return_sequences=3)
    assert len(texts) == 3
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_a_bad_constraint_fails_when_the_processor_is_built(hf_tokenizer: Any) -> None:
    with pytest.raises(GrammarError):
        GrammarLogitsProcessor.from_tokenizer(hf_tokenizer, GrammarSpec("regex", "(("))
