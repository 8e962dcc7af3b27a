"""JSON schemas of more than 20,000 subschemas: llguidance compiles them (as Lark rules around
`%json` blocks, `backends/_llguidance_schema.py`), `auto` sends them there, xgrammar and outlines
refuse them saying so; what walks write validates, what jsonschema rejects is refused, repeated
subtrees share one rule, and the rules allow exactly what llguidance's own JSON compiler does."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

pytest.importorskip("llguidance")

from llguidance import LLMatcher

from radixlm.constrained import (
    GrammarError,
    GrammarOptions,
    GrammarSpec,
    TokenizerInfo,
    allocate_bitmask,
    create_backend,
    unpack_bitmask,
)
from radixlm.constrained._schema import normalize_json_schema
from radixlm.constrained._schema_support import EAGER_MAX_NODES, LAZY_MAX_NODES, LLGUIDANCE_SUPPORT
from radixlm.constrained.backends._llguidance_lark import lark_json
from radixlm.constrained.backends._llguidance_schema import count_nodes, write_large_schema
from radixlm.constrained.backends.llguidance_backend import (
    build_tokenizer,
    large_schema_limits,
    parser_limits,
)

COMPILE_BOUND_S = 60.0  # generous: about 1-3 s each here

# -- schemas ----------------------------------------------------------------------------------

_MEMBER_VALUES = [
    {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0}, "name": {"type": "string"}},
        "required": ["id"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    {"anyOf": [{"type": "null"}, {"type": "number", "minimum": -1, "maximum": 1}]},
]


def many_properties(count: int = 10_000) -> dict[str, Any]:
    """One object of `count` properties (every 500th required), values of three kinds."""
    return {
        "type": "object",
        "properties": {f"p{i}": _MEMBER_VALUES[i % 3] for i in range(count)},
        "required": [f"p{i}" for i in range(0, count, 500)],
        "additionalProperties": False,
    }


def definitions_library(count: int = 3_200) -> dict[str, Any]:
    """`count` definitions referring to one another (recursion through cycles)."""
    defs = {
        f"D{i}": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "s": {"type": "string", "maxLength": 5},
                "next": {"$ref": f"#/$defs/D{(7 * i + 1) % count}"},
                "other": {
                    "anyOf": [{"$ref": f"#/$defs/D{(13 * i + 5) % count}"}, {"type": "null"}]
                },
            },
            "required": ["v"],
            "additionalProperties": False,
        }
        for i in range(count)
    }
    return {
        "type": "object",
        "properties": {
            "root": {"$ref": "#/$defs/D0"},
            "items": {"type": "array", "items": {"$ref": f"#/$defs/D{count // 2}"}, "maxItems": 4},
        },
        "required": ["root"],
        "additionalProperties": False,
        "$defs": defs,
    }


def big_any_of(count: int = 2_200) -> dict[str, Any]:
    """An `anyOf` of `count` objects, told apart by a `kind` constant."""
    kinds = ["integer", "string", "boolean"]
    branches = [
        {
            "type": "object",
            "properties": {
                "kind": {"const": f"k{i}"},
                **{f"f{j}": {"type": kinds[(i + j) % 3]} for j in range(10)},
            },
            "required": ["kind", f"f{i % 10}"],
            "additionalProperties": False,
        }
        for i in range(count)
    ]
    return {
        "type": "object",
        "properties": {"event": {"anyOf": branches}},
        "required": ["event"],
        "additionalProperties": False,
    }


def nested_arrays(width: int = 10, members: int = 1_200) -> dict[str, Any]:
    """Arrays of arrays of objects of `members` array-valued properties each."""

    def row(seed: int) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                f"c{seed}_{j}": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
                for j in range(members)
            },
            "additionalProperties": False,
        }

    return {
        "type": "array",
        "prefixItems": [{"type": "array", "items": row(i), "maxItems": 5} for i in range(width)],
        "items": {"type": "array", "items": {"type": "array", "items": row(width)}},
        "minItems": 1,
    }


SHAPES: dict[str, Callable[[], dict[str, Any]]] = {
    "many_properties": many_properties,
    "definitions_library": definitions_library,
    "big_any_of": big_any_of,
    "nested_arrays": nested_arrays,
}


_REQUIRED = {f"p{i}": [{"id": i}, ["red"], None][i % 3] for i in range(0, 10_000, 500)}


def members(**changed: Any) -> dict[str, Any]:
    """The required members of `many_properties` with `changed` ones, in the schema's order
    (which the grammar keeps)."""
    values = {**_REQUIRED, **changed}
    return dict(sorted(values.items(), key=lambda item: int(item[0][1:])))


# Documents jsonschema accepts and rejects, per shape.
VALID = {
    "many_properties": [
        _REQUIRED,
        members(p1=["red", "red"], p9998=None, p9999={"id": 0, "name": "x"}),
    ],
    "definitions_library": [
        {"root": {"v": 1}},
        {"root": {"v": 1, "next": {"v": 2, "other": {"v": 3}}}, "items": [{"v": 4, "s": "ab"}]},
    ],
    "big_any_of": [{"event": {"kind": "k7", "f7": True}}, {"event": {"kind": "k2199", "f9": 3}}],
    "nested_arrays": [[[]], [[{"c0_1": [1]}], [], [{}, {"c2_1199": []}]], [[], *[[]] * 10, [[{}]]]],
}
INVALID = {
    "many_properties": [
        {},  # required properties missing
        members(p1500={"id": -1}),  # below the minimum
        members(p1=["red", "pink"]),  # not in the enum
        members(p2=2),  # above the maximum
        {**_REQUIRED, "p10000": 1},  # not listed
    ],
    "definitions_library": [
        {"root": {}},
        {"root": {"v": 1, "next": {"v": "x"}}},
        {"root": {"v": 1, "s": "toolong"}},
        {"root": {"v": 1}, "items": [{"v": 1}] * 5},
        {"root": {"v": 1, "other": {"v": 1, "zzz": 1}}},
    ],
    "big_any_of": [
        {"event": {"kind": "k7"}},  # f7 is required there
        {"event": {"kind": "k7", "f7": 1}},  # and a boolean
        {"event": {"kind": "k2200", "f0": 1}},
        {"event": {}},
    ],
    "nested_arrays": [
        [],
        [[{"c1_0": [1]}]],  # c1_0 belongs to the second position
        [[{"c0_0": [1, 2, 3, 4]}]],
        [[{}] * 6],
    ],
}


def compact(document: Any) -> str:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False)


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auto(info: Any) -> Any:
    return create_backend("auto", info)


@pytest.fixture(scope="module")
def byte_token(info: Any) -> dict[int, int]:
    return {data[0]: i for i, data in enumerate(info.token_bytes) if data and len(data) == 1}


@pytest.fixture(scope="module")
def compiled(auto: Any) -> Callable[[str], Any]:
    """The shape's schema compiled once by `auto` (compile time printed)."""
    cache: dict[str, Any] = {}

    def get(shape: str) -> Any:
        if shape not in cache:
            text = json.dumps(SHAPES[shape]())
            started = time.perf_counter()
            cache[shape] = auto.compile(GrammarSpec("json_schema", text))
            took = time.perf_counter() - started
            nodes = count_nodes(json.loads(text))
            print(f"\n{shape}: {nodes} subschemas, {len(text)} bytes, compiled in {took:.2f} s")
            assert took < COMPILE_BOUND_S
        return cache[shape]

    return get


def feeds(grammar: Any, byte_token: dict[int, int], text: str, stop: int = 0) -> bool:
    """Whether the grammar takes `text` one byte per token, then the end."""
    return all(grammar.accept_token(byte_token[b]) for b in text.encode()) and (
        grammar.accept_token(stop)
    )


# -- compiling --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_auto_sends_a_large_schema_to_llguidance(shape: str, compiled: Any) -> None:
    nodes = count_nodes(SHAPES[shape]())
    assert EAGER_MAX_NODES < nodes < LAZY_MAX_NODES
    result = compiled(shape)
    assert result.served_by == "llguidance"
    assert result.validated == ()


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_an_eager_backend_refuses_a_large_schema_and_names_llguidance(name: str, info: Any) -> None:
    pytest.importorskip({"xgrammar": "xgrammar", "outlines": "outlines_core"}[name])
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_001)}}
    with pytest.raises(GrammarError) as caught:
        create_backend(name, info).compile(GrammarSpec("json_schema", json.dumps(schema)))
    message = caught.value.message
    assert f"over {EAGER_MAX_NODES} subschemas" in message and name in message
    assert "llguidance" in message and str(LAZY_MAX_NODES) in message


def test_a_schema_over_the_limit_is_refused_naming_the_limit(auto: Any) -> None:
    schema = {"type": "object", "properties": {f"p{i}": {} for i in range(LAZY_MAX_NODES + 1)}}
    started = time.perf_counter()
    with pytest.raises(GrammarError) as caught:
        auto.compile(GrammarSpec("json_schema", json.dumps(schema)))
    print(f"\nrefused in {time.perf_counter() - started:.2f} s")
    assert caught.value.limit == "max_schema_nodes"
    assert f"more than {LAZY_MAX_NODES} subschemas" in caught.value.message
    assert "simplify" in caught.value.message


def test_repeated_subtrees_share_one_rule() -> None:
    item = {
        "type": "object",
        "properties": {
            f"q{j}": {"type": "array", "items": {"type": "integer"}} for j in range(100)
        },
        "required": ["q0"],
        "additionalProperties": False,
    }
    schema = {"type": "object", "properties": {f"p{i}": item for i in range(150)}}
    text = json.dumps(schema)
    normalized = json.loads(normalize_json_schema(text, LLGUIDANCE_SUPPORT).text)
    assert count_nodes(normalized) > 30_000
    options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    written = write_large_schema(normalized, options)
    print(f"\n{len(text)} bytes of schema, {len(written.text)} of grammar")
    assert len(written.text) * 20 < len(text)
    assert written.blocks == 2  # the integer arrays and the open-ended rest of the root
    assert written.text.count('"\\"q0\\""') == 1  # one rule for all 150 copies


def test_a_part_no_rule_expresses_and_no_block_holds_is_refused_by_name(info: Any) -> None:
    huge = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(11_000)}}
    schema = {**huge, "patternProperties": {"^x": {"type": "string"}}}
    backend = create_backend("llguidance", info)
    with pytest.raises(GrammarError) as caught:
        backend.compile(GrammarSpec("json_schema", json.dumps(schema)))
    assert caught.value.keyword == "patternProperties"
    assert "simplify it" in caught.value.message and "2000 subschemas" in caught.value.message


# -- what the grammars allow --------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_walks_of_a_large_schema_validate(
    shape: str, compiled: Any, auto: Any, info: Any, vwalk: Any, check_schema_of: Any
) -> None:
    check = check_schema_of(SHAPES[shape]())
    finished = 0
    for seed in range(3):
        text, _ = vwalk(auto.matcher(compiled(shape)), info, seed, max_steps=1_500)
        if text is None:
            continue
        finished += 1
        errors = [e.message for e in check.iter_errors(json.loads(text))]
        assert not errors, f"{text[:200]!r}: {errors[:3]}"
    assert finished


@pytest.mark.parametrize("shape", SHAPES)
def test_documents_jsonschema_rejects_are_refused(
    shape: str, compiled: Any, auto: Any, byte_token: dict[int, int]
) -> None:
    check = jsonschema.Draft202012Validator(SHAPES[shape]())
    for document in VALID[shape]:
        assert check.is_valid(document)
        assert feeds(auto.matcher(compiled(shape)), byte_token, compact(document)), document
    for document in INVALID[shape]:
        assert not check.is_valid(document)
        assert not feeds(auto.matcher(compiled(shape)), byte_token, compact(document)), document


def test_flexible_whitespace_is_what_the_blocks_allow(
    info: Any, byte_token: dict[int, int]
) -> None:
    backend = create_backend("llguidance", info, GrammarOptions(json_whitespace="flexible"))
    grammar = backend.compile(GrammarSpec("json_schema", json.dumps(definitions_library(1_400))))
    document = {"root": {"v": 1, "next": {"v": 2, "s": "a"}}, "items": [{"v": 3}, {"v": 4}]}
    spaced = json.dumps(document, separators=(" , ", " : ")).replace("{", "{ ").replace("]", " ]")
    assert feeds(backend.matcher(grammar), byte_token, spaced)
    assert feeds(backend.matcher(grammar), byte_token, json.dumps(document))
    assert not feeds(backend.matcher(grammar), byte_token, " " + compact(document))
    assert not feeds(backend.matcher(grammar), byte_token, compact(document).replace(":", "   :"))


def test_validation_of_a_large_schema_catches_what_the_grammar_leaves(
    auto: Any, info: Any, byte_token: dict[int, int]
) -> None:
    schema = definitions_library(2_600)  # past xgrammar's 20,000 subschemas
    schema["$defs"]["D1"]["properties"]["tags"] = {"type": "array", "uniqueItems": True}
    started = time.perf_counter()
    result = auto.compile(GrammarSpec("json_schema", json.dumps(schema)))
    print(f"\nrelaxed, validated: compiled in {time.perf_counter() - started:.2f} s")
    assert result.served_by == "llguidance" and result.validated == ("uniqueItems",)
    grammar = auto.matcher(result)
    started = time.perf_counter()
    assert feeds(grammar, byte_token, compact({"root": {"v": 0, "next": {"v": 1, "tags": [1, 2]}}}))
    print(f"a document checked in {time.perf_counter() - started:.3f} s")
    grammar = auto.matcher(result)
    text = compact({"root": {"v": 0, "next": {"v": 1, "tags": [1, 1]}}})
    for byte in text.encode():
        if not grammar.accept_token(byte_token[byte]) or grammar.violation() is not None:
            break
    found = grammar.violation()
    assert found is not None and found.keyword == "uniqueItems"


# -- the rules against llguidance's own JSON compiler ------------------------------------------

SMALL_SCHEMAS = [
    {
        "type": "object",
        "properties": {f"k{i}": {"type": "integer"} for i in range(20)},
        "required": ["k3", "k12"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}},
    {
        "type": "object",
        "properties": {"x y": {"type": "integer"}, 'q"\\': {"type": "null"}, "é": {}},
        "additionalProperties": {"type": "boolean"},
    },
    {"type": "object", "additionalProperties": {"type": "integer"}},
    {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "minItems": 1},
    {
        "type": "array",
        "prefixItems": [{"type": "null"}],
        "items": {"type": "boolean"},
        "maxItems": 3,
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {
        "anyOf": [
            {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
            {"type": "array", "items": {"type": "string"}},
            {"type": "null"},
        ]
    },
    {"type": ["object", "integer"], "properties": {"a": {"type": "null"}}, "minimum": 3},
    {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "next": {"$ref": "#"}},
        "required": ["n"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def bytes_info() -> TokenizerInfo:
    """One token per byte (id byte + 1) and a stop token (id 0): masks compare exactly."""
    return TokenizerInfo.from_vocab([None] + [bytes([b]) for b in range(256)], stop_token_ids=[0])


def _matcher(info: TokenizerInfo, lark: str, limits: Any) -> Any:
    grammar = LLMatcher.grammar_from_lark('%llguidance {"no_forcing": true}\n' + lark)
    matcher = LLMatcher(build_tokenizer(info), grammar, log_level=0, limits=limits)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def _takes(matcher: Any, data: bytes) -> bool:
    matcher = matcher.deep_copy()
    return all(matcher.consume_token(b + 1) for b in data) and matcher.is_accepting()


def _walk(matcher: Any, rng: random.Random) -> bytes | None:
    matcher, out = matcher.deep_copy(), bytearray()
    mask = allocate_bitmask(1, 257)
    for step in range(300):
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.shape[1] * 4)
        allowed = unpack_bitmask(mask, 257)[0].nonzero().flatten().tolist()
        if 0 in allowed and (len(allowed) == 1 or rng.random() < 0.3):
            return bytes(out)
        closing = [t for t in allowed if t and t - 1 in b'"]}']
        if closing and rng.random() < min(0.9, step / 50):
            token = rng.choice(closing)
        else:
            token = rng.choice([t for t in allowed if t])
        assert matcher.consume_token(token)
        out.append(token - 1)
    return None


def _variants(document: bytes, rng: random.Random) -> list[bytes]:
    """The document re-spaced, and with a byte put in or taken out."""
    value = json.loads(document)
    text = compact(value).encode()
    out = [text, json.dumps(value).encode(), json.dumps(value, indent=1).encode()]
    for _ in range(8):
        data = bytearray(text)
        at = rng.randrange(len(data) + 1)
        if rng.random() < 0.5:
            data[at:at] = rng.choice([b" ", b"  ", b"   ", b"\n", b",", b"1", b'"', b"}", b"]"])
        elif data:
            del data[min(at, len(data) - 1)]
        out.append(bytes(data))
    return out


@pytest.mark.parametrize("whitespace", ["compact", "flexible"])
@pytest.mark.parametrize("index", range(len(SMALL_SCHEMAS)))
def test_rules_allow_what_llguidance_json_allows(
    index: int, whitespace: str, bytes_info: TokenizerInfo
) -> None:
    schema = SMALL_SCHEMAS[index]
    backend = create_backend("llguidance", bytes_info, GrammarOptions(json_whitespace=whitespace))
    options = backend.json_options()
    normalized = json.loads(normalize_json_schema(json.dumps(schema), LLGUIDANCE_SUPPORT).text)
    direct = _matcher(bytes_info, f"start: {lark_json(normalized, options)}", parser_limits())
    written = write_large_schema(normalized, options, block_nodes=1)  # rules for all it can
    rules = _matcher(bytes_info, written.text, large_schema_limits(written))
    check = jsonschema.Draft202012Validator(schema)
    rng = random.Random(index)
    documents: set[bytes] = set()
    for _ in range(6):
        for matcher in (direct, rules):
            found = _walk(matcher, rng)
            if found is not None:
                documents.update(_variants(found, rng))
    assert len(documents) > 20
    for document in documents:
        taken = _takes(rules, document)
        assert taken == _takes(direct, document), document
        if taken:
            assert check.is_valid(json.loads(document)), document
