"""auto's validation scanner (`_json_scanner`): rolling back restores exactly the state that
replaying the kept tokens from the start gives, however the output is split into tokens; the
shortcuts (string contents skipped, strings decoded without json.loads) give json.loads's
answers."""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm.constrained import TokenizerInfo
from radixlm.constrained._json_scanner import Failure, JsonScanner, Open
from radixlm.constrained._validation import SchemaChecks, ValidatingGrammar

# Checks at every level, so that random documents meet some and break some: arrays unique,
# names without an "x" (and at most 3 characters one level down), no item 0 in a member's
# arrays, strings at most 6 characters where they are items of items.
SCHEMA: Any = {
    "uniqueItems": True,
    "propertyNames": {"pattern": "^[^x]*$"},
    "items": {
        "uniqueItems": True,
        "propertyNames": {"maxLength": 3},
        "items": {"maxLength": 6},
    },
    "additionalProperties": {"items": {"not": {"const": 0}}},
}
DEFERRED = frozenset({"uniqueItems", "propertyNames", "not", "maxLength"})
CHECKS = SchemaChecks(SCHEMA, DEFERRED)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(codec="utf-8"), max_size=6)
    | st.sampled_from(["x", "ab", 'q"uote', "back\\slash", "\n", "\u2028", "é"])
)
documents = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=16,
)


@st.composite
def outputs(draw: Any) -> tuple[bytes, list[bytes]]:
    """A document as a model might write it (compact or spaced, escaped or raw non-ASCII),
    split into tokens anywhere, even inside a UTF-8 sequence."""
    value = draw(documents)
    spaced = draw(st.booleans())
    text = json.dumps(
        value,
        ensure_ascii=draw(st.booleans()),
        separators=(", ", ": ") if spaced else (",", ":"),
    ).encode("utf-8")
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)))) | {0, len(text)})
    return text, [text[a:b] for a, b in itertools.pairwise(cuts) if a < b]


class _AnyToken:
    """An inner grammar that takes every token (the scanner alone is under test)."""

    def accept_token(self, token_id: int) -> bool:
        return True

    def fill_bitmask(self, bitmask: Any, row: int = 0) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        pass

    def jump_forward(self) -> None:
        return None

    def fork(self) -> _AnyToken:
        return self

    def violation(self) -> None:
        return None


def _grammar(pieces: list[bytes]) -> tuple[ValidatingGrammar, list[int]]:
    """A validating grammar over a vocabulary of these pieces (id 0 stops), and their ids."""
    vocab: list[bytes | None] = [None, *dict.fromkeys(pieces)]
    ids = {piece: i for i, piece in enumerate(vocab) if piece is not None}
    info = TokenizerInfo.from_vocab(vocab, stop_token_ids=[0])
    return ValidatingGrammar(_AnyToken(), CHECKS, info), [ids[p] for p in pieces]


def _plain(value: Any) -> Any:
    """A scanner snapshot with each open object or array as its fields (comparable apart)."""
    if isinstance(value, Open):
        return ("open", value.is_object, id(value.place), value.pointer, value.start_byte,
                value.start_token, value.checked, value.holds)  # fmt: skip
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _state(grammar: ValidatingGrammar) -> Any:
    grammar.check_invariants()
    found = grammar.violation()
    return (
        _plain(grammar._snapshot),
        grammar.committed,
        None if found is None else (found.keyword, found.pointer, found.rollback),
    )


def _replayed(tokens: list[int], pieces: list[bytes]) -> ValidatingGrammar:
    grammar, _ = _grammar(pieces)
    for token in tokens:
        assert grammar.accept_token(token)
    return grammar


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outputs(), st.data())
def test_rollback_restores_what_replaying_the_kept_tokens_gives(
    output: tuple[bytes, list[bytes]], data: Any
) -> None:
    _, pieces = output
    grammar, tokens = _grammar(pieces)
    at = 0
    rollbacks = 4  # at most, so that every example ends
    while at < len(tokens):
        assert grammar.accept_token(tokens[at])
        at += 1
        found = grammar.violation()
        if found is None and (not rollbacks or not data.draw(st.booleans(), label="roll back")):
            continue
        rollbacks -= 1
        back = found.rollback if found is not None else data.draw(st.integers(1, at), label="n")
        grammar.rollback(back)
        at -= back
        assert _state(grammar) == _state(_replayed(tokens[:at], pieces))
        if found is not None:
            return  # writing the same value again would be banned
    assert _state(grammar) == _state(_replayed(tokens, pieces))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outputs())
def test_the_checks_do_not_depend_on_how_the_output_is_split_into_tokens(
    output: tuple[bytes, list[bytes]],
) -> None:
    text, pieces = output

    def scan(chunks: list[bytes]) -> Any:
        scanner = JsonScanner(CHECKS, bytearray())
        for number, chunk in enumerate(chunks):
            start = len(scanner.buffer)
            scanner.buffer += chunk
            try:
                scanner.feed(chunk, start, number)
                if number == len(chunks) - 1:
                    scanner.finish(len(scanner.buffer))
            except Failure as failure:
                keyword = getattr(failure.error, "validator", None)
                return ("failed", failure.last_byte, failure.pointer, keyword)
        return ("done", scanner.done, scanner.key, scanner.index, scanner.seen)

    assert scan(pieces) == scan([text[i : i + 1] for i in range(len(text))])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outputs())
def test_a_finished_document_breaks_a_check_exactly_when_jsonschema_rejects_it(
    output: tuple[bytes, list[bytes]],
) -> None:
    text, pieces = output
    grammar, tokens = _grammar(pieces)
    for token in [*tokens, 0]:
        assert grammar.accept_token(token)
        if grammar.violation() is not None:
            break
    errors = list(jsonschema.Draft202012Validator(SCHEMA).iter_errors(json.loads(text)))
    assert (grammar.violation() is not None) == bool(errors), (text, errors)


def test_a_duplicate_item_fails_at_its_last_byte_whatever_the_tokens() -> None:
    text = b'[1, "ab", 1.0]'
    for size in (1, 2, 5, len(text)):
        grammar, tokens = _grammar([text[i : i + size] for i in range(0, len(text), size)])
        for token in tokens:
            grammar.accept_token(token)
        found = grammar.violation()
        assert found is not None and (found.keyword, found.pointer) == ("uniqueItems", "/2")


def test_fork_after_rollback_carries_the_restored_state() -> None:
    pieces = [b'{"a', b'b": [', b"1, ", b"2", b"]}"]
    grammar, tokens = _grammar(pieces)
    for token in tokens[:4]:
        grammar.accept_token(token)
    grammar.rollback(2)
    twin = grammar.fork()
    twin.check_invariants()
    assert _state(twin) == _state(grammar) == _state(_replayed(tokens[:2], pieces))
    for token in tokens[2:]:
        assert twin.accept_token(token)
    assert _state(grammar) == _state(_replayed(tokens[:2], pieces))


@given(st.binary(max_size=12).filter(lambda raw: b'"' not in raw))
def test_strings_are_decoded_as_json_loads_decodes_them(raw: bytes) -> None:
    text = b'"' + raw + b'"'
    scanner = JsonScanner(CHECKS, bytearray(text))
    try:
        expected: Any = json.loads(text)
    except ValueError:
        expected = Failure
    try:
        found: Any = scanner._parse(0, len(text), 0, "")
    except Failure:
        found = Failure
    assert found == expected
