"""Grammar matchers on both backends: acceptance, masks, stop tokens, rollback, fork."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from radixlm.constrained import Grammar, GrammarSpec, allocate_bitmask, unpack_bitmask

DIGITS = GrammarSpec("regex", r"[0-9]{2,3}")


def ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def allowed(grammar: Any, vocab_size: int) -> set[int]:
    bitmask = allocate_bitmask(1, vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    return set(unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist())


def test_matchers_satisfy_the_grammar_protocol(backend: Any) -> None:
    assert isinstance(backend.matcher(backend.compile(DIGITS)), Grammar)


def test_refused_token_leaves_the_state_unchanged(
    backend: Any, hf_tokenizer: Any, info: Any
) -> None:
    grammar = backend.matcher(backend.compile(DIGITS))
    before = allowed(grammar, info.vocab_size)
    assert not grammar.accept_token(ids(hf_tokenizer, "x")[0])
    assert allowed(grammar, info.vocab_size) == before


def test_mask_matches_what_accept_token_takes(backend: Any, info: Any) -> None:
    grammar = backend.matcher(backend.compile(GrammarSpec("regex", r"(ab|cd)[0-9]+")))
    mask = allowed(grammar, info.vocab_size)
    for token in range(info.vocab_size):
        assert grammar.fork().accept_token(token) == (token in mask), token


def test_stop_token_is_refused_until_the_output_may_end(
    backend: Any, hf_tokenizer: Any, info: Any
) -> None:
    grammar = backend.matcher(backend.compile(DIGITS))
    stop = info.stop_token_ids[0]
    assert grammar.accept_token(ids(hf_tokenizer, "7")[0])
    assert stop not in allowed(grammar, info.vocab_size)
    assert not grammar.accept_token(stop)
    assert grammar.accept_token(ids(hf_tokenizer, "8")[0])
    assert stop in allowed(grammar, info.vocab_size)
    assert grammar.accept_token(stop)
    assert grammar.is_terminated()


def test_terminated_grammar_allows_nothing(backend: Any, hf_tokenizer: Any, info: Any) -> None:
    grammar = backend.matcher(backend.compile(GrammarSpec("choice", ["42"])))
    for token in [*ids(hf_tokenizer, "42"), info.stop_token_ids[0]]:
        assert grammar.accept_token(token)
    assert grammar.is_terminated()
    assert allowed(grammar, info.vocab_size) == set()
    assert not grammar.accept_token(ids(hf_tokenizer, "4")[0])


def test_special_and_padding_ids_are_never_allowed(backend: Any, info: Any) -> None:
    compiled = backend.compile(GrammarSpec("json_object"))
    grammar = backend.matcher(compiled)
    never = {i for i, data in enumerate(info.token_bytes) if data is None} - set(
        info.stop_token_ids
    )
    assert max(never) == info.vocab_size - 1  # the model's padding rows are covered
    assert not allowed(grammar, info.vocab_size) & never
    assert not any(grammar.fork().accept_token(token) for token in never)


def test_rollback_restores_masks_and_termination(
    backend: Any, hf_tokenizer: Any, info: Any
) -> None:
    grammar = backend.matcher(backend.compile(DIGITS))
    masks = [allowed(grammar, info.vocab_size)]
    for token in ids(hf_tokenizer, "123"):
        assert grammar.accept_token(token)
        masks.append(allowed(grammar, info.vocab_size))
    assert grammar.accept_token(info.stop_token_ids[0])
    grammar.rollback(1)
    assert not grammar.is_terminated()
    assert allowed(grammar, info.vocab_size) == masks[-1]
    grammar.rollback(len(masks) - 1)
    assert allowed(grammar, info.vocab_size) == masks[0]


def test_rollback_past_the_start_is_refused(backend: Any) -> None:
    grammar = backend.matcher(backend.compile(DIGITS))
    with pytest.raises(ValueError):
        grammar.rollback(1)


def test_fork_is_independent_of_its_origin(backend: Any, hf_tokenizer: Any, info: Any) -> None:
    grammar = backend.matcher(backend.compile(GrammarSpec("choice", ["alpha", "beta"])))
    assert grammar.accept_token(ids(hf_tokenizer, "a")[0])
    twin = grammar.fork()
    assert allowed(twin, info.vocab_size) == allowed(grammar, info.vocab_size)
    for token in ids(hf_tokenizer, "lpha"):
        assert twin.accept_token(token)
    assert info.stop_token_ids[0] in allowed(twin, info.vocab_size)
    assert info.stop_token_ids[0] not in allowed(grammar, info.vocab_size)


def test_fill_bitmask_writes_only_its_row(backend: Any, info: Any) -> None:
    grammar = backend.matcher(backend.compile(DIGITS))
    bitmask = allocate_bitmask(3, info.vocab_size)
    bitmask[2] = 7
    grammar.fill_bitmask(bitmask, 1)
    assert (bitmask[0] == -1).all() and (bitmask[2] == 7).all()
    row = unpack_bitmask(bitmask[1:2], info.vocab_size)[0]
    assert 0 < int(row.sum()) < info.vocab_size


def test_both_backends_allow_the_same_tokens_along_a_regex(
    backends: dict[str, Any], hf_tokenizer: Any, info: Any
) -> None:
    spec = GrammarSpec("regex", r"[a-c]{2,4}(-[0-9]{1,2})?")
    grammars = {name: b.matcher(b.compile(spec)) for name, b in backends.items()}
    for token in [*ids(hf_tokenizer, "abc-12"), info.stop_token_ids[0]]:
        masks = [allowed(g, info.vocab_size) for g in grammars.values()]
        assert masks[0] == masks[1]
        assert all(g.accept_token(token) for g in grammars.values())


def test_regex_alternatives_that_extend_each_other_are_all_reachable(
    backend: Any, hf_tokenizer: Any, info: Any
) -> None:
    compiled = backend.compile(GrammarSpec("regex", r"^(a|ab|abc)$"))
    for text in ("a", "ab", "abc"):
        grammar = backend.matcher(compiled)
        assert all(grammar.accept_token(t) for t in ids(hf_tokenizer, text))
        assert grammar.accept_token(info.stop_token_ids[0]), text


def test_numpy_bitmask_rows_are_filled_too(backend: Any, info: Any) -> None:
    grammar = backend.matcher(backend.compile(DIGITS))
    as_torch = allocate_bitmask(1, info.vocab_size)
    grammar.fill_bitmask(as_torch, 0)
    as_numpy = allocate_bitmask(1, info.vocab_size).numpy()
    grammar.fill_bitmask(as_numpy, 0)
    assert torch.equal(torch.from_numpy(as_numpy), as_torch)


def test_compiled_grammars_are_shared_by_many_matchers(backend: Any, info: Any) -> None:
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps({"type": "boolean"})))
    first, second = backend.matcher(compiled), backend.matcher(compiled)
    assert first.accept_token(
        next(i for i in range(info.vocab_size) if info.token_bytes[i] == b"t")
    )
    assert allowed(second, info.vocab_size) != allowed(first, info.vocab_size)


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_every_stop_token_ends_the_output(name: str, hf_tokenizer: Any) -> None:
    from radixlm.constrained import TokenizerInfo, create_backend

    two_stops = TokenizerInfo.from_hf(hf_tokenizer, vocab_size=1024, stop_token_ids=[0, 1])
    backend = create_backend(name, two_stops)
    compiled = backend.compile(GrammarSpec("choice", ["7"]))
    for stop in (0, 1):
        grammar = backend.matcher(compiled)
        assert grammar.accept_token(ids(hf_tokenizer, "7")[0])
        assert {0, 1} <= allowed(grammar, two_stops.vocab_size)
        assert grammar.accept_token(stop) and grammar.is_terminated()
