"""`$ref`s to other documents: documents shipped beside the schema (by relative name, by `$id`,
with pointers and anchors into them, chained, recursive), resources embedded with their own
`$id`, draft-07 `definitions`. Each grammar accepts exactly what jsonschema accepts with the
same registry (the reference), on xgrammar and llguidance; references to documents that were
not shipped are refused naming them. Nothing is fetched."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from radixlm.constrained import (
    GrammarError,
    GrammarOptions,
    GrammarSpec,
    Violation,
    create_backend,
    load_schema_documents,
    schema_registry,
)

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")

GRAMMAR_BACKENDS = ("xgrammar", "llguidance")

DOCUMENTS: dict[str, Any] = {
    "address.json": {
        "type": "object",
        "properties": {
            "street": {"type": "string", "maxLength": 12},
            "city": {"$ref": "#/$defs/city"},
        },
        "required": ["street", "city"],
        "additionalProperties": False,
        "$defs": {"city": {"enum": ["Paris", "Oslo"]}},
    },
    # Found by its $id (an absolute URI), not by its name.
    "people/person.json": {
        "$id": "https://example.com/schemas/person.json",
        "type": "object",
        "properties": {"name": {"$ref": "#/$defs/name"}, "age": {"$ref": "#age"}},
        "required": ["name"],
        "additionalProperties": False,
        "$defs": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
            "age": {"$anchor": "age", "type": "integer", "minimum": 0, "maximum": 130},
        },
    },
    # A chain: a.json -> b.json -> c.json, each relative to the one before.
    "chain/a.json": {
        "type": "object",
        "properties": {"b": {"$ref": "b.json"}},
        "required": ["b"],
        "additionalProperties": False,
    },
    "chain/b.json": {"type": "array", "items": {"$ref": "c.json#/$defs/code"}, "maxItems": 3},
    "chain/c.json": {"$defs": {"code": {"type": "string", "pattern": "^[a-c]{2}$"}}},
    # Recursion across documents: a tree whose node schema lives in another document, and two
    # documents referring to each other.
    "node.json": {
        "type": "object",
        "properties": {
            "value": {"type": "integer", "minimum": 0, "maximum": 9},
            "children": {"type": "array", "items": {"$ref": "node.json"}, "maxItems": 2},
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    "tree.json": {
        "type": "object",
        "properties": {"name": {"enum": ["x", "y"]}, "kids": {"$ref": "forest.json"}},
        "required": ["name"],
        "additionalProperties": False,
    },
    "forest.json": {"type": "array", "items": {"$ref": "tree.json"}, "maxItems": 2},
    # Draft 7: `definitions`, and a `$ref` that hides its siblings.
    "codes7.json": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"code": {"type": "integer", "minimum": 10, "maximum": 99}},
    },
    # Its own $id moves the base of its "#/$defs/tag" (validation must follow that too).
    "tags.json": {
        "$id": "https://example.com/tags.json",
        "type": "array",
        "items": {"$ref": "#/$defs/tag"},
        "uniqueItems": True,
        "$defs": {"tag": {"enum": ["a", "b", "c"]}},
    },
}

# name -> (schema, instances jsonschema accepts, instances it rejects)
CASES: dict[str, tuple[Any, list[Any], list[Any]]] = {
    "sibling-by-name": (
        {"$ref": "address.json"},
        [{"street": "Main St", "city": "Oslo"}],
        [{"street": "Main St", "city": "Rome"}, {"street": "Main St"}, {"city": "Paris"}],
    ),
    # A relative name resolves against the referring schema's $id: the document shipped as
    # "address.json" is https://example.com/schemas/address.json here.
    "sibling-by-name-beside-an-id": (
        {
            "$id": "https://example.com/schemas/order.json",
            "type": "object",
            "properties": {"ship_to": {"$ref": "address.json"}},
            "required": ["ship_to"],
        },
        [{"ship_to": {"street": "Main St", "city": "Paris"}}],
        [{"ship_to": {"street": "Main St", "city": "Rome"}}, {"ship_to": {}}],
    ),
    "absolute-id-with-pointer-and-anchor": (
        {
            "type": "object",
            "properties": {
                "who": {"$ref": "https://example.com/schemas/person.json"},
                "alias": {"$ref": "https://example.com/schemas/person.json#/$defs/name"},
                "age": {"$ref": "https://example.com/schemas/person.json#age"},
            },
            "required": ["who", "alias"],
            "additionalProperties": False,
        },
        [{"who": {"name": "Ada", "age": 36}, "alias": "Lovelace"}],
        [
            {"who": {"name": "ada"}, "alias": "Lovelace"},
            {"who": {"name": "Ada"}, "alias": "L"},
            {"who": {"name": "Ada", "age": 200}, "alias": "Lovelace"},
            {"who": {"name": "Ada"}, "alias": "Ada", "age": -1},
        ],
    ),
    "pointer-into-a-sibling": (
        {"type": "array", "items": {"$ref": "address.json#/$defs/city"}, "maxItems": 2},
        [["Paris"], ["Oslo", "Paris"], []],
        [["Rome"], ["Paris", "Paris", "Oslo"]],
    ),
    "chained": (
        {"$ref": "chain/a.json"},
        [{"b": ["ab", "ca"]}, {"b": []}],
        [{"b": ["ad"]}, {"b": ["ab", "ab", "ab", "ab"]}, {}],
    ),
    "recursive-across-documents": (
        {"type": "object", "properties": {"root": {"$ref": "node.json"}}, "required": ["root"]},
        [
            {"root": {"value": 1}},
            {"root": {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]}},
        ],
        [
            {"root": {"value": 1, "children": [{"value": 12}]}},
            {"root": {"value": 1, "children": [{"children": []}]}},
            {"root": {"value": 1, "children": [{"value": 2, "extra": 1}]}},
        ],
    ),
    "mutually-recursive-documents": (
        {"$ref": "tree.json"},
        [{"name": "x"}, {"name": "x", "kids": [{"name": "y", "kids": [{"name": "x"}]}]}],
        [{"name": "z"}, {"name": "x", "kids": [{"name": "x", "kids": [{"name": "q"}]}]}],
    ),
    # A compound document: an embedded resource with its own $id; its "#/$defs/zip" is its
    # own definition, not the root's (which would take integers).
    "embedded-id-resources": (
        {
            "$id": "https://example.com/compound/root.json",
            "type": "object",
            "properties": {
                "home": {"$ref": "addr.json"},
                "work": {"$ref": "https://example.com/compound/addr.json#/$defs/zip"},
                # A pointer into the schema that lands inside the embedded resource.
                "billing": {"$ref": "#/$defs/addr"},
            },
            "required": ["home"],
            "additionalProperties": False,
            "$defs": {
                "zip": {"type": "integer"},
                "addr": {
                    "$id": "addr.json",
                    "type": "object",
                    "properties": {"zip": {"$ref": "#/$defs/zip"}},
                    "required": ["zip"],
                    "additionalProperties": False,
                    "$defs": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                },
            },
        },
        [
            {"home": {"zip": "75001"}},
            {"home": {"zip": "75001"}, "work": "02139", "billing": {"zip": "10115"}},
        ],
        [
            {"home": {"zip": 75001}},
            {"home": {"zip": "7500"}},
            {"home": {"zip": "75001"}, "work": 1},
            {"home": {"zip": "75001"}, "billing": {"zip": 10115}},
        ],
    ),
    "draft-07-definitions": (
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {
                "code": {"$ref": "codes7.json#/definitions/code"},
                "local": {"$ref": "#/definitions/part"},
            },
            "required": ["code"],
            "additionalProperties": False,
            "definitions": {
                "part": {
                    "$id": "http://example.com/part.json",
                    "$ref": "codes7.json#/definitions/code",
                }
            },
        },
        [{"code": 10}, {"code": 42, "local": 99}],
        [{"code": 9}, {"code": 100}, {"code": 42, "local": 5}, {"code": "42"}],
    ),
}


def compile_on(backend: Any, schema: Any) -> Any:
    return backend.compile(GrammarSpec("json_schema", json.dumps(schema)))


def reference(schema: Any, documents: Any = DOCUMENTS) -> Any:
    """jsonschema's validator for the schema's draft, with the registry the grammar uses."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, registry=schema_registry(schema, documents))


def accepts(backend: Any, info: Any, compiled: Any, value: Any) -> bool:
    """Whether the grammar takes the compact JSON text of `value` and may stop after it."""
    grammar = backend.matcher(compiled)
    tokens = info.encode_exact(json.dumps(value, separators=(",", ":")))
    assert tokens is not None
    return all(grammar.accept_token(t) for t in tokens) and grammar.accept_token(
        info.stop_token_ids[0]
    )


@pytest.fixture(scope="module")
def shipped(info: Any) -> dict[str, Any]:
    """xgrammar, llguidance and auto with the documents shipped beside the schemas."""
    options = GrammarOptions(schema_documents=DOCUMENTS)
    return {name: create_backend(name, info, options) for name in (*GRAMMAR_BACKENDS, "auto")}


@pytest.mark.parametrize("backend_name", GRAMMAR_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_each_grammar_accepts_exactly_what_jsonschema_accepts_with_the_same_registry(
    shipped: dict[str, Any], info: Any, backend_name: str, case: str
) -> None:
    schema, valid, invalid = CASES[case]
    check = reference(schema)
    backend = shipped[backend_name]
    compiled = compile_on(backend, schema)
    for value in valid:
        assert check.is_valid(value), value
        assert accepts(backend, info, compiled, value), value
    for value in invalid:
        assert not check.is_valid(value), value
        assert not accepts(backend, info, compiled, value), value


@pytest.mark.parametrize("backend_name", GRAMMAR_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_finished_random_walks_validate_against_the_reference(
    shipped: dict[str, Any], info: Any, walk: Any, backend_name: str, case: str
) -> None:
    schema = CASES[case][0]
    check = reference(schema)
    backend = shipped[backend_name]
    compiled = compile_on(backend, schema)
    finished = 0
    for seed in range(3):
        result = walk(backend.matcher(compiled), info, seed, stop_bias=4.0, close_bias=6.0)
        if result.terminated:
            finished += 1
            value = json.loads(result.text)
            assert check.is_valid(value), result.text
    assert finished >= 1


def test_validation_follows_references_into_other_documents_and_rolls_back(
    shipped: dict[str, Any], info: Any
) -> None:
    # uniqueItems lives in tags.json: no grammar enforces it, validation does, with the
    # documents behind the same references.
    schema = {"type": "object", "properties": {"tags": {"$ref": "tags.json"}}, "required": ["tags"]}
    auto = shipped["auto"]
    compiled = compile_on(auto, schema)
    assert compiled.validated == ("uniqueItems",)
    grammar = auto.matcher(compiled)
    for token in info.encode_exact('{"tags":["a","a"') or []:
        assert grammar.accept_token(token)
    found = grammar.violation()
    assert isinstance(found, Violation) and found.keyword == "uniqueItems"
    assert found.pointer == "/tags/1"
    grammar.rollback(found.rollback)
    kept = info.decode_bytes(grammar.history).decode()
    finished = '{"tags":["a","b"]}'
    assert finished.startswith(kept)
    for token in info.encode_exact(finished[len(kept) :]) or []:
        assert grammar.accept_token(token)
    assert grammar.violation() is None  # the whole document validated
    assert grammar.accept_token(info.stop_token_ids[0]) and grammar.is_terminated()


@pytest.mark.parametrize("backend_name", GRAMMAR_BACKENDS)
def test_schemas_inside_structural_tags_refer_to_shipped_documents(
    shipped: dict[str, Any], info: Any, backend_name: str
) -> None:
    tag = {
        "structures": [{"begin": "<ship>", "schema": {"$ref": "address.json"}, "end": "</ship>"}],
        "triggers": ["<ship>"],
    }
    backend = shipped[backend_name]
    compiled = backend.compile(GrammarSpec("structural_tag", json.dumps(tag)))
    text = 'To <ship>{"street":"Main St","city":"Oslo"}</ship>'
    grammar = backend.matcher(compiled)
    assert all(grammar.accept_token(t) for t in info.encode_exact(text) or [])
    wrong = backend.matcher(compiled)
    tokens = info.encode_exact('To <ship>{"street":"Main St","city":"Rome"}') or []
    assert not all(wrong.accept_token(t) for t in tokens)


def test_a_recursive_reference_across_documents_stays_recursive(shipped: dict[str, Any]) -> None:
    from radixlm.constrained._schema import normalize_json_schema
    from radixlm.constrained._schema_support import XGRAMMAR_SUPPORT

    normalized = normalize_json_schema(
        json.dumps({"$ref": "node.json"}), XGRAMMAR_SUPPORT, documents=DOCUMENTS
    )
    bundled = json.loads(normalized.text)
    node = bundled["$defs"]["node.json"]
    assert bundled["$ref"] == "#/$defs/node.json"
    assert node["properties"]["children"]["items"] == {"$ref": "#/$defs/node.json"}


@pytest.mark.parametrize(
    ("ref", "named"),
    [
        ("missing.json", "'missing.json'"),
        (
            "https://example.com/schemas/missing.json#/$defs/x",
            "https://example.com/schemas/missing.json",
        ),
    ],
)
@pytest.mark.parametrize("backend_name", [*GRAMMAR_BACKENDS, "auto"])
def test_a_reference_to_a_document_not_shipped_is_refused_naming_it_and_how_to_ship_it(
    shipped: dict[str, Any], backend_name: str, ref: str, named: str
) -> None:
    schema = {"type": "object", "properties": {"x": {"$ref": ref}}}
    with pytest.raises(GrammarError) as caught:
        compile_on(shipped[backend_name], schema)
    error = caught.value
    assert error.keyword == "$ref" and error.path == "/properties/x"
    assert named in error.message
    assert "schema_documents" in error.message and "--json-schema-dir" in error.message
    assert "network" in error.message


def test_a_pointer_to_nothing_in_a_shipped_document_is_refused_naming_it(
    shipped: dict[str, Any],
) -> None:
    with pytest.raises(GrammarError, match=r"address.json#/\$defs/nope.*points to nothing"):
        compile_on(shipped["auto"], {"$ref": "address.json#/$defs/nope"})


def test_without_the_documents_the_same_reference_is_refused(backends: dict[str, Any]) -> None:
    with pytest.raises(GrammarError, match=r"address\.json.*not shipped") as caught:
        compile_on(backends["xgrammar"], {"$ref": "address.json"})
    assert caught.value.keyword == "$ref"


def test_an_unknown_reference_only_validation_would_meet_is_refused(
    shipped: dict[str, Any],
) -> None:
    # `not` is enforced by validation alone: the grammar never follows the reference, but
    # validation would, so it is refused when the schema compiles.
    schema = {"type": "integer", "not": {"$ref": "missing.json"}}
    with pytest.raises(GrammarError, match=r"missing\.json") as caught:
        compile_on(shipped["auto"], schema)
    assert caught.value.path == "/not"


def test_an_unknown_reference_in_an_unused_definition_does_not_matter(
    shipped: dict[str, Any], info: Any
) -> None:
    schema = {"$ref": "address.json", "$defs": {"unused": {"$ref": "missing.json"}}}
    compiled = compile_on(shipped["xgrammar"], schema)
    assert accepts(shipped["xgrammar"], info, compiled, {"street": "a", "city": "Oslo"})


def test_metaschemas_still_resolve_without_shipping_them(
    backends: dict[str, Any], info: Any
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "step": {"$ref": "http://json-schema.org/draft-04/schema#/properties/multipleOf"}
        },
        "required": ["step"],
    }
    compiled = compile_on(backends["xgrammar"], schema)
    assert accepts(backends["xgrammar"], info, compiled, {"step": 2})
    assert not accepts(backends["xgrammar"], info, compiled, {"step": -2})


REAL = Path(__file__).parent / "data" / "real_schemas"
# Real schemas of the corpus that refer to other documents of it: (schema, {file name in the
# schema directory: corpus file}). jupyter-events refers to its property metaschema by $id
# (recursively); CycloneDX refers to its SPDX and JSF schemas by names relative to its own $id.
REAL_WITH_DOCUMENTS = {
    "jupyter-events__event-metaschema.json": {
        "property-metaschema.json": "jupyter-events__property-metaschema.json"
    },
    "cyclonedx-python-lib__bom-1.4.json": {
        "spdx.SNAPSHOT.schema.json": "cyclonedx-python-lib__spdx-license-ids.json",
        "jsf-0.82.SNAPSHOT.schema.json": "cyclonedx-python-lib__jsf-0.82.json",
    },
}


@pytest.mark.parametrize("name", list(REAL_WITH_DOCUMENTS))
def test_real_schemas_compile_with_their_documents_in_a_directory_and_walks_validate(
    tmp_path: Path, info: Any, vwalk: Any, name: str
) -> None:
    for file, source in REAL_WITH_DOCUMENTS[name].items():
        (tmp_path / file).write_text((REAL / source).read_text(encoding="utf-8"))
    documents = load_schema_documents(tmp_path)
    schema = json.loads((REAL / name).read_text(encoding="utf-8"))
    with pytest.raises(GrammarError, match="not shipped"):
        compile_on(create_backend("auto", info), schema)
    auto = create_backend("auto", info, GrammarOptions(schema_documents=documents))
    compiled = compile_on(auto, schema)
    check = reference(schema, documents)
    finished = 0
    for seed in range(3):
        text, _ = vwalk(auto.matcher(compiled), info, seed)
        if text is not None:
            finished += 1
            assert check.is_valid(json.loads(text)), text
    assert finished >= 1


def test_a_directory_of_documents_is_keyed_by_relative_path(tmp_path: Path) -> None:
    (tmp_path / "common").mkdir()
    (tmp_path / "address.json").write_text(json.dumps(DOCUMENTS["address.json"]))
    (tmp_path / "common" / "name.json").write_text('{"type": "string"}')
    (tmp_path / "notes.txt").write_text("not a schema")
    documents = load_schema_documents(tmp_path)
    assert sorted(documents) == ["address.json", "common/name.json"]
    assert documents["common/name.json"] == {"type": "string"}


def test_a_directory_with_a_file_that_is_not_json_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match=r"broken\.json"):
        load_schema_documents(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        load_schema_documents(tmp_path / "absent")


@pytest.mark.parametrize(
    ("documents", "message"),
    [
        ({"a.json": [1]}, "must be a JSON schema"),
        ({"a.json#/x": {}}, "fragment"),
        ({"": {}}, "not a URI"),
        ({"a.json": {"x": {1, 2}}}, "not JSON"),
    ],
)
def test_grammar_options_refuse_documents_that_are_not_schemas(
    documents: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        GrammarOptions(schema_documents=documents)


def test_grammar_options_keep_a_copy_of_the_documents() -> None:
    given = {"a.json": {"type": "string"}}
    options = GrammarOptions(schema_documents=given)
    given["a.json"]["type"] = "integer"
    assert options.schema_documents["a.json"] == {"type": "string"}
    assert options == GrammarOptions(schema_documents={"a.json": {"type": "string"}})
    hash(options)  # still usable as a key
    assert pickle.loads(pickle.dumps(options)) == options
    assert "a.json" in repr(options) and "string" not in repr(options)
