"""Two `pattern`s on one string (`allOf`, `$ref` siblings, keywords beside `anyOf`): the grammar
enforces one, validation the other; what finishes matches both."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixlm.constrained import GrammarError, GrammarSpec, create_backend

CODE = {"type": "string", "pattern": "^[a-c]{2,5}$"}
# Anchored at both ends: xgrammar reads a pattern as a full match where JSON Schema searches.
STARTS_WITH_A = {"pattern": "^a[a-z]*$"}


@pytest.fixture(scope="module")
def auto(info: Any) -> Any:
    return create_backend("auto", info)


def compile_auto(auto: Any, schema: Any, *, strict: bool = False) -> Any:
    return auto.compile(GrammarSpec("json_schema", json.dumps(schema), strict=strict))


def feed(grammar: Any, info: Any, text: str) -> None:
    for token in info.encode_exact(text) or []:
        assert grammar.accept_token(token), text


def finished_walks(auto: Any, info: Any, vwalk: Any, schema: Any, seeds: int) -> list[Any]:
    compiled = compile_auto(auto, schema)
    values = []
    for seed in range(seeds):
        text, _ = vwalk(auto.matcher(compiled), info, seed)
        if text is not None:
            values.append(json.loads(text))
    return values


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"code": {"allOf": [CODE, STARTS_WITH_A]}}},
        {
            "type": "object",
            "$defs": {"a-word": {"type": "string", **STARTS_WITH_A}},
            "properties": {"code": {"$ref": "#/$defs/a-word", "pattern": CODE["pattern"]}},
        },
        {
            "type": "object",
            "properties": {"code": {**CODE, "anyOf": [STARTS_WITH_A, {"pattern": "^b[a-z]*$"}]}},
        },
    ],
    ids=["allOf", "ref-siblings", "beside-anyOf"],
)
def test_two_patterns_compile_and_finished_outputs_match_both(
    auto: Any, info: Any, vwalk: Any, check_schema_of: Any, schema: Any
) -> None:
    schema = {**schema, "required": ["code"], "additionalProperties": False}
    compiled = compile_auto(auto, schema)
    assert compiled.validated == ("pattern",)
    values = finished_walks(auto, info, vwalk, schema, seeds=6)
    assert len(values) >= 3
    check = check_schema_of(schema)
    for value in values:
        assert not list(check.iter_errors(value)), value


def test_a_value_that_breaks_the_validated_pattern_is_a_pattern_violation(
    auto: Any, info: Any
) -> None:
    schema = {
        "type": "object",
        "properties": {"code": {"allOf": [CODE, STARTS_WITH_A]}},
        "required": ["code"],
    }
    grammar = auto.matcher(compile_auto(auto, schema))
    feed(grammar, info, '{"code":"bc')  # the grammar's pattern allows it so far
    assert grammar.violation() is None
    feed(grammar, info, '"')
    found = grammar.violation()
    assert found is not None and not found.fatal
    assert (found.keyword, found.pointer) == ("pattern", "/code")
    assert "^a" in found.message
    grammar.rollback(found.rollback)
    written = info.decode_bytes(grammar.history).decode()
    feed(grammar, info, '{"code":"ab"}'[len(written) :])
    assert grammar.violation() is None
    assert grammar.accept_token(info.stop_token_ids[0])


def test_strict_still_refuses_two_patterns_naming_the_keyword(auto: Any) -> None:
    schema = {"allOf": [CODE, STARTS_WITH_A]}
    with pytest.raises(GrammarError, match="pattern") as caught:
        compile_auto(auto, schema, strict=True)
    assert caught.value.keyword == "pattern"
