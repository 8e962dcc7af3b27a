"""GrammarSpec: kinds, sources, cache keys, errors."""

from __future__ import annotations

import pickle

import pytest

from radixlm.constrained import GRAMMAR_KINDS, GrammarError, GrammarSpec
from radixlm.sampling import InvalidRequest


def test_every_kind_is_known() -> None:
    assert set(GRAMMAR_KINDS) == {
        "json_schema", "regex", "ebnf", "structural_tag", "choice", "json_object"
    }  # fmt: skip


def test_unknown_kind_is_refused_listing_the_kinds() -> None:
    with pytest.raises(GrammarError, match="json_schema"):
        GrammarSpec("yaml", "a: 1")  # type: ignore[arg-type]


def test_specs_compare_and_hash_by_value() -> None:
    assert GrammarSpec("regex", "a+") == GrammarSpec("regex", "a+")
    assert len({GrammarSpec("choice", ["a", "b"]), GrammarSpec("choice", ("a", "b"))}) == 1


def test_choice_list_becomes_a_tuple_and_keys_as_json() -> None:
    spec = GrammarSpec("choice", ["yes", "no"])
    assert spec.source == ("yes", "no")
    assert spec.key == ("choice", '["yes", "no"]')


@pytest.mark.parametrize("source", [[], "yes", [1, 2], ["a", None]])
def test_choice_needs_a_non_empty_list_of_strings(source: object) -> None:
    with pytest.raises(GrammarError, match="choice"):
        GrammarSpec("choice", source)  # type: ignore[arg-type]


def test_json_schema_may_be_given_as_a_dict() -> None:
    assert GrammarSpec("json_schema", {"type": "integer"}).source == '{"type": "integer"}'


def test_json_object_ignores_its_source() -> None:
    assert GrammarSpec("json_object").key == ("json_object", "")


@pytest.mark.parametrize("kind", ["regex", "ebnf", "json_schema", "structural_tag"])
def test_empty_sources_are_refused(kind: str) -> None:
    with pytest.raises(GrammarError, match="empty"):
        GrammarSpec(kind, "  ")  # type: ignore[arg-type]


def test_grammar_error_is_an_invalid_request_naming_the_field() -> None:
    error = GrammarError("bad", kind="json_object", backend="xgrammar", keyword="not", path="/a")
    assert isinstance(error, InvalidRequest) and isinstance(error, ValueError)
    assert error.field == "response_format"
    assert str(error) == "response_format: bad"


def test_grammar_error_survives_pickling() -> None:
    error = GrammarError("bad", kind="regex", backend="outlines", keyword=None, path=None)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.message, copy.kind, copy.backend) == ("bad", "regex", "outlines")


def test_spec_comes_from_sampling_params() -> None:
    from radixlm.sampling import SamplingParams

    assert GrammarSpec.from_sampling_params(SamplingParams()) is None
    schema = '{"type": "object"}'
    assert GrammarSpec.from_sampling_params(SamplingParams(json_schema=schema)) == GrammarSpec(
        "json_schema", schema
    )
    assert GrammarSpec.from_sampling_params(SamplingParams(regex="a+")) == GrammarSpec(
        "regex", "a+"
    )
    assert GrammarSpec.from_sampling_params(SamplingParams(ebnf='root ::= "x"')) == GrammarSpec(
        "ebnf", 'root ::= "x"'
    )
    tag = '{"structures": [], "triggers": ["<f"]}'
    assert (
        GrammarSpec.from_sampling_params(SamplingParams(structural_tag=tag)).kind
        == "structural_tag"
    )
    assert GrammarSpec.from_sampling_params(SamplingParams(choice=["a", "b"])) == GrammarSpec(
        "choice", ["a", "b"]
    )


def test_two_constraints_on_one_object_are_refused() -> None:
    class Both:
        json_schema = "{}"
        regex = "a"

    with pytest.raises(GrammarError, match="only one"):
        GrammarSpec.from_sampling_params(Both())
