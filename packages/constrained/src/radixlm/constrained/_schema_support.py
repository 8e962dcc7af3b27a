"""What each backend enforces of JSON Schema, and the formats written out as exact patterns."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

Schema = dict[str, Any]

# Keywords that say something about valid instances (JSON Schema 2020-12 plus older drafts).
VALIDATION_KEYWORDS = frozenset(
    {
        "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
        "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems", "minItems",
        "uniqueItems", "maxContains", "minContains", "maxProperties", "minProperties",
        "required", "dependentRequired", "dependencies", "properties", "patternProperties",
        "additionalProperties", "propertyNames", "items", "prefixItems", "additionalItems",
        "contains", "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
        "not", "if", "then", "else", "dependentSchemas", "$ref", "$dynamicRef",
        "$recursiveRef", "format", "contentEncoding", "contentMediaType", "contentSchema",
    }
)  # fmt: skip
# Handled by the normalizer itself on every backend.
_STRUCTURAL = frozenset(
    {"type", "enum", "const", "required", "properties", "additionalProperties", "items",
     "prefixItems", "allOf", "anyOf", "oneOf", "$ref"}
)  # fmt: skip
DEF_CONTAINERS = ("$defs", "definitions")
# How many subschemas (as the normalizer counts them) a backend compiles. xgrammar and outlines
# build their whole grammar when they compile (xgrammar took 8 s for 1,000 optional properties);
# llguidance builds lexer and parser states as the output needs them, and a schema too large
# for its own JSON compiler is written as Lark by `backends/_llguidance_schema.py`.
EAGER_MAX_NODES = 20_000
LAZY_MAX_NODES = 200_000


@functools.cache
def checked_formats() -> frozenset[str]:
    """The `format` values jsonschema's format checker checks here (some need optional
    packages): formats a grammar does not enforce are validated when they are in this set and
    are annotations otherwise."""
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - a dependency of the package
        return frozenset()
    return frozenset(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)


@dataclass(frozen=True, slots=True)
class SchemaSupport:
    """What a backend enforces exactly (measured against its behaviour, see the tests).

    `formats` are enforced natively; the formats of `FORMAT_PATTERNS` become exact patterns on
    every backend. `ascii_shorthands`: the backend's regex reads \\d and \\w as Unicode classes,
    so patterns get JSON Schema's ASCII meaning spelled out. `recursion`: recursive $ref works.
    `any_value`: what stands in for an unconstrained subschema (None: the backend's own).
    `length_as_pattern`: string lengths must be written as a pattern (xgrammar's own length
    rule lets raw control characters into strings, which is invalid JSON). `max_nodes`: the
    most subschemas it compiles (`EAGER_MAX_NODES`, `LAZY_MAX_NODES`)."""

    backend: str
    keywords: frozenset[str]
    formats: frozenset[str]
    ascii_shorthands: bool = False
    recursion: bool = True
    any_value: Schema | None = None
    length_as_pattern: bool = False
    max_nodes: int = EAGER_MAX_NODES


_YEAR = "([0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    f"({_YEAR}-(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
    f"|{_YEAR}-(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    f"|{_YEAR}-02-(0[1-9]|1[0-9]|2[0-8])"
    f"|{_LEAP_YEAR}-02-29)"
)
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]([.][0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
# Formats written out as exact patterns (calendar dates, RFC 3339 times, dotted quads): the
# backends' own versions are looser (February 30th, leading zeros, Unicode digits).
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "ipv4": f"^({_OCTET}[.]){{3}}{_OCTET}$",
    "uuid": "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
}

XGRAMMAR_SUPPORT = SchemaSupport(
    backend="xgrammar",
    keywords=_STRUCTURAL
    | {
        "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
        "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
        "maxProperties", "unevaluatedProperties",
    },
    formats=frozenset(
        {"email", "duration", "uri", "uri-reference", "hostname", "ipv6", "uri-template",
         "json-pointer", "relative-json-pointer"}
    ),
    length_as_pattern=True,
)  # fmt: skip

_SCALARS = [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]
OUTLINES_SUPPORT = SchemaSupport(
    backend="outlines",
    keywords=_STRUCTURAL | {"maxLength", "minLength", "pattern", "format", "maxItems", "minItems"},
    # Its email pattern lets a raw quote into the string, its uri reads \\d as Unicode digits.
    formats=frozenset(),
    ascii_shorthands=True,
    recursion=False,
    # outlines-core writes `{}` as an ungrouped alternation (any prefix then matches a bare
    # scalar): spell "any value" out, as scalars and arrays of scalars.
    any_value={"anyOf": [*_SCALARS, {"type": "array", "items": {"anyOf": _SCALARS}}]},
)


# Measured against llguidance 1.9 (tests/test_constrained_llguidance.py: edge-case documents fed
# byte by byte and random walks, both checked with jsonschema and RFC references for the
# formats jsonschema does not check here). Each keyword below is enforced exactly or more
# strictly (llguidance writes integers without a fraction or exponent, strings without
# \\uXXXX escapes of printable characters). Left out: minProperties (names matched only by
# additionalProperties or patternProperties may repeat, and a parser keeps one of them, so an
# object can hold fewer properties than were counted), unevaluatedProperties, uniqueItems,
# contains, not, if/then/else, propertyNames, dependentRequired (llguidance refuses them), and
# the formats hostname (no limit on the total length, "--" in third and fourth place allowed),
# uri-reference, uri-template and the JSON pointers (not implemented).
LLGUIDANCE_SUPPORT = SchemaSupport(
    backend="llguidance",
    keywords=_STRUCTURAL
    | {
        "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
        "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
        "maxProperties", "patternProperties",
    },
    formats=frozenset({"email", "duration", "uri", "ipv6"}),
    max_nodes=LAZY_MAX_NODES,
)  # fmt: skip


def support_of(backend: str) -> SchemaSupport:
    """What backend `backend` enforces of JSON Schema."""
    supports = {s.backend: s for s in (XGRAMMAR_SUPPORT, LLGUIDANCE_SUPPORT, OUTLINES_SUPPORT)}
    try:
        return supports[backend]
    except KeyError:
        raise ValueError(f"no JSON Schema support table for backend {backend!r}") from None
