"""The finished document's judge: jsonschema-rs stands in for `jsonschema` only where the two
read the specification alike (`judges_agree`, `document_is_plain`); there their verdicts are
compared on the keyword and corpus schemas, over valid examples and thousands of mutations."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import referencing

from radixlm.constrained._schema_checks import (
    SchemaChecks,
    compiled_validator_available,
    document_is_plain,
    judges_agree,
)

DATA = Path(__file__).parent / "data"
ORDER: Any = {
    "type": "object",
    "properties": {
        "sku": {"allOf": [{"type": "string", "pattern": "^[A-Z][0-9A-Z-]*$"},
                          {"pattern": "^.{2,12}$"}]},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "express": {"type": "boolean"},
        "note": {"type": "string"},
    },
    "required": ["sku", "express"],
    "if": {"properties": {"express": {"const": True}}},
    "then": {"required": ["note"]},
}  # fmt: skip


@pytest.mark.parametrize(
    "schema",
    [
        ORDER,
        {"$defs": {"n": {"type": "integer", "multipleOf": 3}}, "items": {"$ref": "#/$defs/n"}},
        {"type": "string", "pattern": r"^\d{3}-[a-z]+(x|y)?$"},
        {"patternProperties": {"^[a-z]+$": {"type": "number"}}, "additionalProperties": False},
        True,
    ],
)
def test_schemas_both_judges_read_alike(schema: Any) -> None:
    assert judges_agree(schema)


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ({"type": "string", "format": "email"}, "formats are checked differently"),
        ({"type": "number", "multipleOf": 0.01}, "float arithmetic"),
        ({"type": "string", "pattern": r"^\p{L}+$"}, "a property escape"),
        ({"type": "string", "pattern": r"^(?=a)\w+$"}, "a look-ahead"),
        ({"type": "string", "pattern": r"\bword\b"}, "\\b is not in the agreed syntax"),
        ({"$ref": "https://example.com/other.json"}, "a reference to another document"),
        ({"$ref": "#"}, "a reference to the root"),
        ({"$id": "https://example.com/s.json", "type": "object"}, "an id"),
        ({"type": "object", "unevaluatedProperties": False}, "not among the agreed keywords"),
        ({"properties": {"a": {"type": "string", "format": "date"}}}, "format, nested"),
        ({"items": [{"type": "string", "pattern": "(?i)a"}]}, "a flag group in a tuple"),
    ],
)
def test_schemas_left_to_jsonschema(schema: Any, why: str) -> None:
    assert not judges_agree(schema), why


@pytest.mark.parametrize(
    ("text", "plain"),
    [
        (b'{"a": [1, 2.5, true, null], "b": "x y-z"}', True),
        (b'{\n  "a": 1,\n\t"b": "c"\n}', True),  # whitespace between tokens only
        (b'{"a": "line\\nbreak"}', False),  # an escape: a newline in the string
        (b'{"a": "caf\xc3\xa9"}', False),  # beyond ASCII
        (b'{"a": 12345678901234567}', False),  # more than a float holds exactly
        (b'{"a": 1e400}', False),
    ],
)
def test_plain_documents(text: bytes, plain: bool) -> None:
    assert document_is_plain(text) is plain


STRINGS = ["", "a", "ab", "ABC", "X1-RED", "x1", "Z9-BLUE-LONG", "hello world", "2024-01-31",
           "a@b.co", "123", "-1", "A-", "AAAAAAAAAAAAA", "true", "{}", " a ", "Ab_9"]  # fmt: skip
SCALARS: list[Any] = [0, 1, -1, 2, 3, 7, 99, 100, 101, -3, 0.5, 2.5, 1.0, 1e3, True, False, None]


def _names(schema: Any, out: set[str]) -> set[str]:
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "properties" and isinstance(value, dict):
                out.update(value)
            if key == "required" and isinstance(value, list):
                out.update(v for v in value if isinstance(v, str))
            _names(value, out)
    elif isinstance(schema, list):
        for value in schema:
            _names(value, out)
    return out


def _random_value(rng: random.Random, names: list[str], depth: int) -> Any:
    kind = rng.random()
    if depth > 2 or kind < 0.35:
        return rng.choice(SCALARS)
    if kind < 0.6:
        return rng.choice(STRINGS)
    if kind < 0.8:
        return [_random_value(rng, names, depth + 1) for _ in range(rng.randrange(4))]
    return {
        rng.choice(names): _random_value(rng, names, depth + 1) for _ in range(rng.randrange(4))
    }


def _mutate(rng: random.Random, value: Any, names: list[str]) -> Any:
    """`value` with one random change somewhere inside it."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(list(value))
        out = dict(value)
        roll = rng.random()
        if roll < 0.2:
            del out[key]
        elif roll < 0.35:
            out[rng.choice(names)] = _random_value(rng, names, 1)
        else:
            out[key] = _mutate(rng, value[key], names)
        return out
    if isinstance(value, list) and value and rng.random() < 0.7:
        out_list = list(value)
        roll = rng.random()
        i = rng.randrange(len(value))
        if roll < 0.2:
            del out_list[i]
        elif roll < 0.4:
            out_list.append(rng.choice(value))  # a duplicate, for uniqueItems
        else:
            out_list[i] = _mutate(rng, value[i], names)
        return out_list
    return _random_value(rng, names, 1)


def _corpus() -> list[tuple[str, Any, list[Any]]]:
    cases = [("order", ORDER, [{"sku": "X1-RED", "express": True, "note": "n", "tags": ["a"]}])]
    for entry in json.loads((DATA / "keyword_schemas.json").read_text()):
        examples = [entry["example"]] if "example" in entry else []
        cases.append((entry["name"], entry["schema"], examples))
    for entry in json.loads((DATA / "schemas.json").read_text()):
        cases.append((entry["name"], entry["schema"], []))
    return [case for case in cases if judges_agree(case[1])]


@pytest.mark.skipif(not compiled_validator_available(), reason="jsonschema-rs is not installed")
def test_where_the_judges_agree_their_verdicts_are_equal_on_thousands_of_documents() -> None:
    rng = random.Random(0)
    compared = {True: 0, False: 0}
    judged = 0
    for name, schema, examples in _corpus():
        judge = SchemaChecks(schema, frozenset()).final_judge()
        if judge is None:  # jsonschema-rs refused the schema (draft 4 spellings, say)
            continue
        judged += 1
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        reference = cls(schema, format_checker=cls.FORMAT_CHECKER, registry=referencing.Registry())
        names = sorted(_names(schema, set())) or ["a"]
        documents = list(examples)
        for _ in range(60):
            seed = rng.choice(documents) if documents and rng.random() < 0.7 else None
            documents.append(
                _mutate(rng, seed, names) if seed is not None else _random_value(rng, names, 0)
            )
        for document in documents:
            if not document_is_plain(json.dumps(document).encode()):
                continue
            verdict = reference.is_valid(document)
            assert judge.is_valid(document) == verdict, (name, document)
            compared[verdict] += 1
    assert judged > 100, judged  # most of the corpus is in the agreed part
    assert compared[True] > 500 and compared[False] > 2000, compared


@pytest.mark.skipif(not compiled_validator_available(), reason="jsonschema-rs is not installed")
def test_the_finished_document_is_judged_by_jsonschema_where_the_judges_may_differ() -> None:
    # '$' before a final newline: Python's re matches it, ECMA-262 does not. jsonschema judges
    # a document with an escape (here the newline), so its verdict stands.
    schema = {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]+$"}}}
    checks = SchemaChecks(schema, frozenset({"pattern"}))
    document = {"sku": "ABC\n"}
    text = json.dumps(document).encode()
    assert checks.final_judge() is not None and not document_is_plain(text)
    located = checks.root_place.located
    assert checks.first_error(document, located, final=True, text=text) is None  # jsonschema's
    error = checks.first_error({"sku": "abc"}, located, final=True, text=b'{"sku": "abc"}')
    assert error is not None and error.validator == "pattern"
    # A schema with a format never gets the compiled judge.
    assert SchemaChecks({"format": "email"}, frozenset()).final_judge() is None
