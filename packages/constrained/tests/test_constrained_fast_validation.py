"""auto's per-value checks on jsonschema-rs: the same verdicts as jsonschema, offline."""

from __future__ import annotations

from typing import Any

import pytest

from radixlm.constrained._validation import SchemaChecks, compiled_validator_available

pytestmark = pytest.mark.skipif(
    not compiled_validator_available(), reason="jsonschema-rs is not installed"
)

SCHEMA: Any = {
    "$defs": {"tag": {"type": "string", "pattern": "^[a-z]+$"}},
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "uniqueItems": True},
        "home": {"$ref": "https://example.com/remote.json"},
    },
}


def test_a_subschema_with_local_refs_gets_a_compiled_validator_with_jsonschemas_verdicts() -> None:
    checks = SchemaChecks(SCHEMA, frozenset({"uniqueItems"}))
    tags = SCHEMA["properties"]["tags"]
    assert checks.compiled(tags) is not None
    assert checks.first_error(["ab", "cd"], [tags]) is None
    error = checks.first_error(["ab", "ab"], [tags])
    assert error is not None and error.validator == "uniqueItems"
    error = checks.first_error(["ab", "C"], [tags])
    assert error is not None and error.validator == "pattern"


def test_a_reference_to_another_document_stays_with_jsonschema_and_nothing_is_fetched() -> None:
    checks = SchemaChecks(SCHEMA, frozenset({"uniqueItems"}))
    assert checks.compiled(SCHEMA["properties"]["home"]) is None
    assert checks.compiled(SCHEMA) is None
