"""Bad constraints end in GrammarError, quickly: never a hang, a crash or a silent acceptance."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm.constrained import GrammarCompiler, GrammarError, GrammarOptions, GrammarSpec

TIME_LIMIT = 0.5
BAD = [
    pytest.param("json_schema", "{not json", "not valid JSON", id="invalid-json"),
    pytest.param("json_schema", "[1, 2]", "schema must be an object", id="schema-not-an-object"),
    pytest.param("json_schema", '{"type": "strng"}', "type must be one of", id="unknown-type"),
    pytest.param(
        "json_schema",
        '{"type": "integer", "minimum": "3"}',
        "minimum must be a number",
        id="string-bound",
    ),
    pytest.param(
        "json_schema", '{"type": "string", "maxLength": -1}', "non-negative", id="negative-length"
    ),
    pytest.param(
        "json_schema",
        '{"type": "string", "minLength": 5, "maxLength": 1}',
        "above maxLength",
        id="empty-range",
    ),
    pytest.param(
        "json_schema", '{"required": "name"}', "list of property names", id="required-not-a-list"
    ),
    pytest.param(
        "json_schema", '{"$ref": "#/$defs/missing"}', "points to nothing", id="dangling-ref"
    ),
    pytest.param("json_schema", "false", "allows no value", id="false-schema"),
    pytest.param(
        "json_schema", '{"allOf": [{"$ref": "#"}]}', "deeper", id="self-referencing-allof"
    ),
    pytest.param("regex", "(unclosed", "", id="unclosed-group"),
    pytest.param("regex", "a{3,1}", "", id="reversed-repeat"),
    pytest.param("regex", "[z-a]", "", id="reversed-range"),
    pytest.param("regex", "a\\", "", id="trailing-backslash"),
    pytest.param("regex", "(?=look)ahead", "", id="lookahead"),
    pytest.param("choice", ["ok", "(", "a\\"], None, id="choices-with-regex-syntax"),
]
BAD_TAGS = [
    pytest.param("{not json", "not valid JSON", id="tag-invalid-json"),
    pytest.param('{"structures": []}', "triggers", id="tag-without-triggers"),
    pytest.param('{"type": "structural_tag"}', "format", id="tag-without-format"),
    pytest.param(
        '{"structures": [{"begin": "<a>", "end": "</a>", "schema": {"not": {}}}], "triggers": ["<a"]}',
        "'not'",
        id="tag-schema-keyword",
    ),
    pytest.param(
        '{"type": "structural_tag", "format": {"type": "no_such_format"}}',
        "does not compile",
        id="tag-unknown-format",
    ),
]


@pytest.fixture(scope="module")
def compilers(backends: dict[str, Any]) -> Any:
    made = {name: GrammarCompiler(b, time_limit_s=TIME_LIMIT) for name, b in backends.items()}
    yield made
    for compiler in made.values():
        compiler.shutdown()


def compile_within_limit(compiler: GrammarCompiler, spec: GrammarSpec) -> GrammarError:
    start = time.monotonic()
    with pytest.raises(GrammarError) as caught:
        compiler.submit(spec).result(timeout=TIME_LIMIT + 5)
    assert time.monotonic() - start < TIME_LIMIT + 1.5
    return caught.value


@pytest.fixture(scope="module", autouse=True)
def drain(compilers: dict[str, Any]) -> Any:
    """Let compilations abandoned at their time limit finish before the next module."""
    yield
    for compiler in compilers.values():
        assert compiler.wait_idle(60)


@pytest.mark.parametrize(("kind", "source", "says"), BAD)
@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_bad_constraint_is_a_grammar_error(
    compilers: dict[str, Any], name: str, kind: str, source: Any, says: str | None
) -> None:
    spec = GrammarSpec(kind, source)  # type: ignore[arg-type]
    if says is None:  # not bad after all: compiles
        assert compilers[name].submit(spec).result(timeout=5).spec == spec
        return
    error = compile_within_limit(compilers[name], spec)
    assert error.kind == kind and error.backend == name
    assert says in error.message
    assert error.message.strip()


@pytest.mark.parametrize(("source", "says"), BAD_TAGS)
def test_bad_structural_tag_is_a_grammar_error(
    compilers: dict[str, Any], source: str, says: str
) -> None:
    error = compile_within_limit(compilers["xgrammar"], GrammarSpec("structural_tag", source))
    assert error.kind == "structural_tag" and says in error.message


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= "a" (',
        "root ::= missing_rule",
        'start ::= "a"',
        'root ::= "unterminated',
        "root ::= [z-a]",
    ],
)
def test_broken_ebnf_is_a_grammar_error(compilers: dict[str, Any], grammar: str) -> None:
    error = compile_within_limit(compilers["xgrammar"], GrammarSpec("ebnf", grammar))
    assert "does not compile" in error.message


def test_deeply_nested_schema_is_refused_by_depth(compilers: dict[str, Any]) -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(200):
        schema = {"type": "array", "items": schema}
    for compiler in compilers.values():
        error = compile_within_limit(compiler, GrammarSpec("json_schema", json.dumps(schema)))
        assert "nested deeper" in error.message


def test_schema_too_deep_to_parse_is_refused(compilers: dict[str, Any]) -> None:
    source = '{"items":' * 100_000 + "{}" + "}" * 100_000
    error = compile_within_limit(compilers["xgrammar"], GrammarSpec("json_schema", source))
    assert "nested" in error.message or "deep" in error.message


def test_oversized_constraint_is_refused_by_size(backends: dict[str, Any], info: Any) -> None:
    from radixlm.constrained import create_backend

    small = create_backend("xgrammar", info, GrammarOptions(max_source_bytes=1000))
    with pytest.raises(GrammarError, match="above the limit"):
        small.compile(GrammarSpec("regex", "a" * 2000))


def test_huge_schema_hits_the_time_limit(compilers: dict[str, Any]) -> None:
    names = [f"p{i}" for i in range(1500)]
    schema = {
        "type": "object",
        "properties": {n: {"type": "string", "pattern": "^[a-z]{3,9}$"} for n in names},
        "required": names,
    }
    error = compile_within_limit(
        compilers["xgrammar"], GrammarSpec("json_schema", json.dumps(schema))
    )
    assert "took longer" in error.message


def test_pathological_regex_hits_the_time_limit(compilers: dict[str, Any]) -> None:
    # The automaton of this regex doubles with every repetition (2^19 states): several seconds
    # of compilation on these machines, far past the 0.5 s limit even on a much faster one.
    error = compile_within_limit(
        compilers["outlines"], GrammarSpec("regex", "(a|b|c)*a(a|b|c){18}")
    )
    assert "took longer" in error.message


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    kind=st.sampled_from(["json_schema", "regex", "ebnf"]),
    source=st.text(
        alphabet='{}[]()"\\:,|*+?.^$ab01-=:;<>typerootminLength', min_size=1, max_size=40
    ),
)
def test_random_sources_compile_or_fail_cleanly(
    compilers: dict[str, Any], kind: str, source: str
) -> None:
    if not source.strip():
        return
    for name, compiler in compilers.items():
        spec = GrammarSpec(kind, source)  # type: ignore[arg-type]
        future = compiler.submit(spec)
        error = future.exception(timeout=TIME_LIMIT + 5)
        assert error is None or isinstance(error, GrammarError), (name, repr(error))
