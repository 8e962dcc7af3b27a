"""The auto backend: a backend per constraint, and keywords no grammar enforces enforced by
validating each completed value and rolling back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixlm.constrained import (
    GrammarError,
    GrammarSpec,
    Violation,
    allocate_bitmask,
    create_backend,
    unpack_bitmask,
)


@pytest.fixture(scope="module")
def auto(info: Any) -> Any:
    return create_backend("auto", info)


def compile_auto(auto: Any, schema: Any, *, strict: bool = False) -> Any:
    return auto.compile(GrammarSpec("json_schema", json.dumps(schema), strict=strict))


@pytest.fixture
def walks_validate(auto: Any, info: Any, vwalk: Any, check_schema_of: Any) -> Any:
    """walks_validate(schema, seeds): walks under auto that finish validate against the full
    schema; returns how many finished."""

    def run(schema: Any, seeds: int = 12) -> int:
        compiled = compile_auto(auto, schema)
        check = check_schema_of(schema)
        finished = 0
        for seed in range(seeds):
            text, _ = vwalk(auto.matcher(compiled), info, seed)
            if text is None:
                continue
            finished += 1
            errors = [e.message for e in check.iter_errors(json.loads(text))]
            assert not errors, f"{text!r}: {errors}"
        return finished

    return run


def test_a_schema_xgrammar_enforces_is_served_by_xgrammar_without_validation(auto: Any) -> None:
    compiled = compile_auto(auto, {"type": "object", "properties": {"a": {"type": "integer"}}})
    assert compiled.backend == "auto"
    assert compiled.served_by == "xgrammar"
    assert compiled.validated == ()


def test_other_kinds_go_to_the_first_backend_that_takes_them(auto: Any) -> None:
    assert auto.compile(GrammarSpec("regex", "[a-c]{2}")).served_by == "xgrammar"
    assert auto.compile(GrammarSpec("choice", ["x", "y"])).served_by == "xgrammar"


def test_unique_items_is_validated_and_every_finished_walk_is_unique(
    auto: Any, info: Any, walks_validate: Any
) -> None:
    schema = {
        "type": "array",
        "items": {"enum": ["a", "b", "c", "d"]},
        "uniqueItems": True,
        "minItems": 2,
        "maxItems": 4,
    }
    compiled = compile_auto(auto, schema)
    assert compiled.validated == ("uniqueItems",)
    assert walks_validate(schema, seeds=16) >= 12


@pytest.mark.parametrize(
    ("keyword", "schema"),
    [
        (
            "oneOf",
            {"oneOf": [{"type": "integer", "maximum": 50}, {"type": "number", "minimum": 10}]},
        ),
        (
            "not",
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                "required": ["a"],
                "not": {"required": ["b"]},
            },
        ),
        (
            "dependentRequired",
            {
                "type": "object",
                "properties": {"x": {"type": "string", "maxLength": 3}, "y": {"type": "integer"}},
                "dependentRequired": {"x": ["y"]},
            },
        ),
        (
            "contains",
            {
                "type": "array",
                "items": {"type": "integer", "maximum": 9, "minimum": 0},
                "contains": {"minimum": 7},
                "maxItems": 4,
            },
        ),
        (
            "if",
            {
                "type": "object",
                "properties": {"n": {"type": "integer"}, "big": {"type": "boolean"}},
                "required": ["n", "big"],
                "if": {"properties": {"n": {"minimum": 100}}},
                "then": {"properties": {"big": {"const": True}}},
                "else": {"properties": {"big": {"const": False}}},
            },
        ),
    ],
)
def test_keywords_no_grammar_enforces_are_validated(
    auto: Any, info: Any, keyword: str, schema: Any, walks_validate: Any
) -> None:
    compiled = compile_auto(auto, schema)
    assert keyword in compiled.validated
    assert walks_validate(schema) >= 6


def test_strict_refuses_what_only_validation_would_enforce(auto: Any) -> None:
    with pytest.raises(GrammarError) as caught:
        compile_auto(auto, {"type": "array", "uniqueItems": True}, strict=True)
    assert caught.value.keyword == "uniqueItems"
    assert "uniqueItems" in caught.value.message


def test_named_backends_stay_strict(info: Any) -> None:
    with pytest.raises(GrammarError) as caught:
        create_backend("xgrammar", info).compile(
            GrammarSpec("json_schema", '{"type": "array", "uniqueItems": true}')
        )
    assert caught.value.keyword == "uniqueItems"


def test_unknown_formats_are_annotations_and_listed(
    auto: Any, info: Any, walks_validate: Any
) -> None:
    schema = {"type": "string", "format": "color", "maxLength": 6}
    compiled = compile_auto(auto, schema)
    assert compiled.annotations == ("color",)
    assert compiled.validated == ()
    assert walks_validate(schema, seeds=4) == 4
    with pytest.raises(GrammarError) as caught:
        compile_auto(auto, schema, strict=True)
    assert caught.value.keyword == "format"


def test_a_checkable_format_no_backend_enforces_is_validated(auto: Any) -> None:
    compiled = compile_auto(auto, {"type": "string", "format": "idn-email"})
    assert compiled.validated == ("format",)


def test_property_names_enum_is_rewritten_into_the_grammar(
    auto: Any, info: Any, walks_validate: Any
) -> None:
    schema = {
        "type": "object",
        "properties": {"x": {"type": "integer"}},
        "additionalProperties": {"type": "boolean"},
        "propertyNames": {"enum": ["x", "y", "z"]},
    }
    compiled = compile_auto(auto, schema)
    assert compiled.validated == ()
    assert walks_validate(schema, seeds=8) >= 6


def test_if_on_a_required_name_is_rewritten_into_the_grammar(
    auto: Any, info: Any, walks_validate: Any
) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {}},
        "if": {"required": ["a"]},
        "then": {"required": ["b"]},
        "else": {"required": ["c"]},
    }
    compiled = compile_auto(auto, schema)
    assert compiled.validated == ()
    assert walks_validate(schema, seeds=8) >= 6


def test_if_on_a_const_of_a_boolean_property_is_rewritten(
    auto: Any, info: Any, walks_validate: Any
) -> None:
    schema = {
        "type": "object",
        "properties": {"on": {"type": "boolean"}, "level": {"type": "integer"}},
        "required": ["on"],
        "if": {"properties": {"on": {"const": True}}, "required": ["on"]},
        "then": {"required": ["level"]},
    }
    compiled = compile_auto(auto, schema)
    assert compiled.validated == ()
    assert walks_validate(schema, seeds=8) >= 6


def feed(grammar: Any, info: Any, text: str) -> None:
    """Accept `text` token by token (one token per byte where the vocabulary has them)."""
    for char in text.encode():
        token = info.token_bytes.index(bytes([char]))
        assert grammar.accept_token(token), text


def test_a_duplicate_item_rolls_back_to_its_own_start_and_is_masked(auto: Any, info: Any) -> None:
    schema = {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True}
    grammar = auto.matcher(compile_auto(auto, schema))
    feed(grammar, info, '["a",')
    assert grammar.violation() is None
    feed(grammar, info, '"a"')
    found = grammar.violation()
    assert isinstance(found, Violation)
    assert (found.keyword, found.pointer, found.fatal) == ("uniqueItems", "/1", False)
    assert found.rollback == 3  # the item, not the whole array
    mask = allocate_bitmask(1, info.vocab_size)
    grammar.fill_bitmask(mask, 0)
    assert not unpack_bitmask(mask, info.vocab_size).any()  # nothing until it rolls back
    grammar.rollback(found.rollback)
    assert grammar.violation() is None
    assert info.decode_bytes(grammar.history) == b'["a",'
    feed(grammar, info, '"')
    grammar.fill_bitmask(mask, 0)
    allowed = unpack_bitmask(mask, info.vocab_size)[0]
    assert allowed[info.token_bytes.index(b"a")]  # `a` alone does not complete the item yet
    feed(grammar, info, "a")  # only `"` can follow, which repeats the item: a dead end
    found = grammar.violation()
    assert found is not None and not found.fatal and found.rollback == 2
    grammar.rollback(found.rollback)
    feed(grammar, info, '"')
    grammar.fill_bitmask(mask, 0)
    allowed = unpack_bitmask(mask, info.vocab_size)[0]
    assert not allowed[info.token_bytes.index(b"a")]
    assert allowed[info.token_bytes.index(b"b")]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("1", "1.0"),
        ("1", "true"),
        ("0", "false"),
        ("null", "false"),
        ('{"a":1,"b":[2]}', '{"b":[2.0],"a":1}'),
        ('{"a":1}', '{"a":1,"b":1}'),
        ("[1,[true]]", "[1.0,[true]]"),
        ("[1,[true]]", "[1,[1]]"),
        ('"1"', "1"),
        ("100000000000000000000", "1e20"),
    ],
)
def test_item_uniqueness_is_json_equality_as_jsonschema_has_it(
    auto: Any, info: Any, first: str, second: str
) -> None:
    import jsonschema

    schema = {"type": "array", "uniqueItems": True}
    grammar = auto.matcher(compile_auto(auto, schema))
    feed(grammar, info, f"[{first},{second}")
    if grammar.violation() is None:  # a number or literal item closes at the next byte
        feed(grammar, info, "]")
    expected = jsonschema.Draft202012Validator(schema).is_valid(json.loads(f"[{first},{second}]"))
    found = grammar.violation()
    assert (found is None) == expected, (first, second, found)
    if found is not None:
        assert (found.keyword, found.pointer) == ("uniqueItems", "/1")


def test_max_contains_is_counted_item_by_item(auto: Any, info: Any) -> None:
    schema = {"type": "array", "contains": {"type": "integer"}, "maxContains": 2}
    grammar = auto.matcher(compile_auto(auto, schema))
    feed(grammar, info, '[1,"x",2,"y"')
    assert grammar.violation() is None
    feed(grammar, info, ",3")
    assert grammar.violation() is None  # a number closes at the next byte
    feed(grammar, info, ",")
    found = grammar.violation()
    assert found is not None and (found.keyword, found.pointer) == ("maxContains", "/4")
    assert found.rollback == 2  # `3,` back to the item's start


def test_retries_are_bounded_then_the_violation_is_fatal(auto: Any, info: Any, vwalk: Any) -> None:
    # Only one item value exists, so two unique items are impossible: every walk must end in
    # a fatal violation that names the keyword, never in output.
    schema = {"type": "array", "items": {"const": "a"}, "uniqueItems": True, "minItems": 2}
    compiled = compile_auto(auto, schema)
    for seed in range(4):
        grammar = auto.matcher(compiled)
        text, rollbacks = vwalk(grammar, info, seed, max_steps=2000)
        assert text is None
        found = grammar.violation()
        assert found is not None and found.fatal, rollbacks
        assert "uniqueItems" in found.message and "/1" in found.message
        assert rollbacks <= 64


def test_fork_carries_the_checks_and_runs_independently(auto: Any, info: Any) -> None:
    schema = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True}
    grammar = auto.matcher(compile_auto(auto, schema))
    feed(grammar, info, '["a",')
    twin = grammar.fork()
    feed(twin, info, '"a"')
    assert twin.violation() is not None
    assert grammar.violation() is None
    feed(grammar, info, '"b"]')
    assert grammar.violation() is None


def test_the_whole_document_is_checked_before_it_may_end(auto: Any, info: Any) -> None:
    # `not` at the root: only the closed document can be judged.
    schema = {"type": "integer", "minimum": 0, "maximum": 20, "not": {"const": 7}}
    grammar = auto.matcher(compile_auto(auto, schema))
    feed(grammar, info, "7")
    assert grammar.violation() is None  # a number closes only at its end
    assert grammar.accept_token(info.stop_token_ids[0])
    found = grammar.violation()
    assert found is not None and found.keyword == "not" and found.rollback == 2
