"""The schema corpus (tests/data/schemas.json): each schema compiles or is rejected by naming the
keyword at fault, per backend; what compiles only ever lets valid JSON terminate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from radixlm.constrained import GrammarError, GrammarSpec

CORPUS = json.loads((Path(__file__).parent / "data" / "schemas.json").read_text(encoding="utf-8"))
NAMED = ("xgrammar", "llguidance", "outlines")
CASES = [
    pytest.param(item, backend, id=f"{backend}-{item['name']}")
    for item in CORPUS
    for backend in NAMED
]
WALKS = 6


def validator(schema: Any) -> Any:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def test_corpus_holds_at_least_forty_schemas() -> None:
    assert len(CORPUS) >= 40


def test_corpus_expects_both_outcomes_on_each_backend() -> None:
    for backend in NAMED:
        outcomes = {item[backend] == "ok" for item in CORPUS}
        assert outcomes == {True, False}


@pytest.mark.parametrize(("item", "backend_name"), CASES)
def test_schema_compiles_or_is_rejected_naming_the_keyword(
    item: dict[str, Any], backend_name: str, backends: dict[str, Any]
) -> None:
    spec = GrammarSpec("json_schema", json.dumps(item["schema"]))
    expected = item[backend_name]
    if expected == "ok":
        backends[backend_name].compile(spec)
        return
    with pytest.raises(GrammarError) as caught:
        backends[backend_name].compile(spec)
    assert caught.value.keyword == expected
    assert caught.value.backend == backend_name
    assert repr(expected) in caught.value.message or expected in caught.value.message


@pytest.mark.parametrize(
    ("item", "backend_name"), [c for c in CASES if c.values[0][c.values[1]] == "ok"]
)
def test_outputs_that_terminate_validate_against_the_schema(
    item: dict[str, Any], backend_name: str, backends: dict[str, Any], info: Any, walk: Any
) -> None:
    backend = backends[backend_name]
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(item["schema"])))
    check = validator(item["schema"])
    finished = 0
    for seed in range(WALKS):
        result = walk(backend.matcher(compiled), info, seed, stop_bias=3.0, close_bias=3.0)
        if not result.terminated:
            continue
        finished += 1
        errors = [e.message for e in check.iter_errors(json.loads(result.text))]
        assert not errors, f"{result.text!r}: {errors}"
    assert finished >= 1
