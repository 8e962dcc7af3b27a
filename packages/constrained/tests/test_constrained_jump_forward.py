"""Jump-forward: the same text with fewer model calls, and tokens the tokenizer would write."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from radixlm.constrained import GrammarSpec, JumpForward, create_backend

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"enum": ["Paris", "東京", "New York"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "zip"],
        },
    },
    "required": ["name", "city", "tags", "active", "address"],
}
TARGETS = [
    {"name": "Zoë", "city": "東京", "tags": ["green", "blue"], "active": True,
     "address": {"street": "1 Main St", "zip": "75001"}},
    {"name": "", "city": "New York", "tags": [], "active": False,
     "address": {"street": "Rue de la Paix", "zip": ""}},
    {"name": "Bob \"the\" builder", "city": "Paris", "tags": ["red"], "active": True,
     "address": {"street": "東京 1-2", "zip": "100-0001"}},
]  # fmt: skip


def stand_in_model(info: Any, target: str, seed: int) -> Callable[[list[int]], torch.Tensor]:
    """A deterministic "model": seeded noise from the text so far, plus a strong preference for
    continuing `target` the way the tokenizer writes it (or, between the tokenizer's token
    boundaries, with the longest token that fits)."""
    goal = target.encode("utf-8")
    canonical = info.encode_exact(target)
    boundary: dict[int, int] = {}
    position = 0
    for token in canonical:
        boundary[position] = token
        position += len(info.token_bytes[token])

    def longest_fit(rest: bytes) -> int:
        fits = [i for i, b in enumerate(info.token_bytes) if b and rest.startswith(b)]
        return max(fits, key=lambda i: len(info.token_bytes[i]))

    def logits(output: list[int]) -> torch.Tensor:
        text = info.decode_bytes(output)
        digest = hashlib.sha256(text + seed.to_bytes(4, "little")).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        row = torch.randn(1, info.vocab_size, generator=generator)
        if goal.startswith(text):
            rest = goal[len(text) :]
            choice = boundary.get(len(text)) if rest else info.stop_token_ids[0]
            row[0, choice if choice is not None else longest_fit(rest)] += 100.0
        return row

    return logits


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize("target", TARGETS, ids=["unicode", "empty-values", "escapes"])
@pytest.mark.parametrize("tokenizer", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_jump_forward_gives_the_same_text_with_fewer_model_calls(
    request: pytest.FixtureRequest, walk: Any, name: str, tokenizer: str, target: Any
) -> None:
    info = request.getfixturevalue("info" if tokenizer == "byte_level" else "sp_info")
    backend = create_backend(name, info)
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    text = compact(target)
    model = stand_in_model(info, text, seed=7)
    plain = walk(backend.matcher(compiled), info, 0, logits=model)
    jumping = walk(backend.matcher(compiled), info, 0, logits=model, jump_forward=True)
    assert plain.terminated and jumping.terminated
    assert plain.text == jumping.text == text
    assert jumping.model_calls < plain.model_calls * 0.75
    assert jumping.jumped_tokens > 0


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_jump_forward_output_is_the_tokenizers_own_tokenization(
    info: Any, sp_info: Any, walk: Any, name: str
) -> None:
    for tokenizer_info in (info, sp_info):
        backend = create_backend(name, tokenizer_info)
        compiled = backend.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
        for target in TARGETS:
            text = compact(target)
            model = stand_in_model(tokenizer_info, text, seed=3)
            result = walk(
                backend.matcher(compiled), tokenizer_info, 0, logits=model, jump_forward=True
            )
            assert result.token_ids == tokenizer_info.encode_exact(text)


def test_forced_text_merging_with_the_previous_token_rolls_it_back(
    backends: dict[str, Any], hf_tokenizer: Any, info: Any
) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "integer"}}, "required": ["name"]}
    vocab = hf_tokenizer.get_vocab()
    assert '{"' in vocab  # the tokenizer merges `{` and `"`
    for backend in backends.values():
        grammar = backend.matcher(backend.compile(GrammarSpec("json_schema", json.dumps(schema))))
        assert grammar.accept_token(vocab["{"])
        jump = grammar.jump_forward()
        assert jump is not None
        assert jump.rollback == 1 and jump.token_ids[0] == vocab['{"']
        assert jump.text == '"name":'
        assert info.decode_bytes(jump.token_ids) == b'{"name":'


def apply(grammar: Any, output: list[int], jump: JumpForward) -> list[int]:
    grammar.rollback(jump.rollback)
    kept = output[: len(output) - jump.rollback]
    for token in jump.token_ids:
        assert grammar.accept_token(token)
    return kept + list(jump.token_ids)


def test_jump_spells_the_old_output_followed_by_its_text(
    backends: dict[str, Any], hf_tokenizer: Any, info: Any
) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["東京都", "東京駅"]}},
        "required": ["city"],
    }
    for backend in backends.values():
        grammar = backend.matcher(backend.compile(GrammarSpec("json_schema", json.dumps(schema))))
        output = hf_tokenizer.encode('{"ci', add_special_tokens=False)
        assert all(grammar.accept_token(t) for t in output)
        jump = grammar.jump_forward()
        assert jump is not None
        new_output = apply(grammar, output, jump)
        assert info.decode_bytes(new_output) == info.decode_bytes(output) + jump.text.encode()
        # The forced text ends where the two choices part: inside the shared characters.
        assert info.decode_bytes(new_output).decode().startswith('{"city":"東京')


def test_last_forced_token_is_left_to_the_model_when_a_longer_token_may_follow(
    backends: dict[str, Any], hf_tokenizer: Any, info: Any
) -> None:
    vocab = hf_tokenizer.get_vocab()
    # `"tags":[` is forced, but `["` (a longer token) may come next: the model picks.
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["tags"],
    }
    assert '["' in vocab
    for backend in backends.values():
        grammar = backend.matcher(backend.compile(GrammarSpec("json_schema", json.dumps(schema))))
        jump = grammar.jump_forward()
        assert jump is not None
        assert not jump.text.endswith("[")
        assert info.decode_bytes(jump.token_ids) == jump.text.encode()


def test_jump_forward_does_not_change_the_state(backends: dict[str, Any], info: Any) -> None:
    from radixlm.constrained import allocate_bitmask

    for backend in backends.values():
        grammar = backend.matcher(backend.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))))
        before, after = allocate_bitmask(1, info.vocab_size), allocate_bitmask(1, info.vocab_size)
        grammar.fill_bitmask(before, 0)
        first = grammar.jump_forward()
        assert first is not None and grammar.jump_forward() == first
        grammar.fill_bitmask(after, 0)
        assert torch.equal(before, after)


def test_no_jump_where_the_model_has_a_choice_or_after_the_end(
    backends: dict[str, Any], hf_tokenizer: Any, info: Any
) -> None:
    for backend in backends.values():
        grammar = backend.matcher(backend.compile(GrammarSpec("regex", "[a-z]+")))
        assert grammar.jump_forward() is None
        choice = backend.matcher(backend.compile(GrammarSpec("choice", ["done"])))
        for token in hf_tokenizer.encode("done", add_special_tokens=False):
            assert choice.accept_token(token)
        assert choice.jump_forward() is None
        assert choice.accept_token(info.stop_token_ids[0])
        assert choice.jump_forward() is None


def test_without_an_encoder_there_is_no_jump() -> None:
    from radixlm.constrained import TokenizerInfo

    tokens = [None, "a", "b", "c", "ab", "abc"]
    synthetic = TokenizerInfo.from_vocab(tokens, stop_token_ids=[0])
    backend = create_backend("xgrammar", synthetic)
    grammar = backend.matcher(backend.compile(GrammarSpec("choice", ["abc"])))
    assert grammar.jump_forward() is None


def test_a_whole_constant_is_one_jump(backends: dict[str, Any], info: Any) -> None:
    for backend in backends.values():
        grammar = backend.matcher(backend.compile(GrammarSpec("choice", ["a fixed answer: 42"])))
        jump = grammar.jump_forward()
        assert jump is not None and jump.rollback == 0
        assert jump.text == "a fixed answer: 42"
        assert list(jump.token_ids) == info.encode_exact("a fixed answer: 42")
