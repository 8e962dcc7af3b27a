"""Exact rewrites of keywords a backend lacks into ones it has (used when not strict).

Each rewrite gives a schema with the same valid instances, so the grammar enforces it without
validation and rollback:

- `propertyNames` with `enum`/`const`: the listed names become the object's only properties;
  with a `pattern`, `minLength` or `maxLength` (backends with `patternProperties`): one
  pattern property for the allowed names, everything else closed.
- `if`/`then`/`else` whose `if` tests `required` names, or a required property's `const` /
  `enum` when the property's values are a known finite set: an `anyOf` of the two cases.

Anything else is left alone (the normalizer then defers it to validation).
"""

from __future__ import annotations

import re
from typing import Any

from radixlm.constrained._schema_merge import canonical, enum_values
from radixlm.constrained._schema_support import SchemaSupport

Schema = dict[str, Any]


def rewrite_for_grammar(schema: Schema, support: SchemaSupport, path: str) -> Schema:
    """`schema` with the rewritable keywords the backend lacks rewritten (see module doc)."""
    out = schema
    if "propertyNames" in out and "propertyNames" not in support.keywords:
        out = _property_names(out, support)
    if "if" in out and "if" not in support.keywords:
        out = _if_then_else(out)
    return out


# -- propertyNames ------------------------------------------------------------------------


def _property_names(schema: Schema, support: SchemaSupport) -> Schema:
    names = schema["propertyNames"]
    if names is True or names == {}:
        return {k: v for k, v in schema.items() if k != "propertyNames"}
    if not isinstance(names, dict) or "patternProperties" in schema:
        return schema
    rules = {k: v for k, v in names.items() if k != "type" or v == "string"}
    values = enum_values(rules)
    if values is not None and set(rules) <= {"enum", "const"}:
        return _names_from_list(schema, [v for v in values if isinstance(v, str)])
    if "patternProperties" in support.keywords and len(rules) == 1:
        key, value = next(iter(rules.items()))
        if key == "pattern" and isinstance(value, str):
            return _names_from_pattern(schema, value)
        if key in ("minLength", "maxLength") and isinstance(value, int) and value >= 0:
            low, high = (value, "") if key == "minLength" else (0, value)
            return _names_from_pattern(schema, f"^[\\s\\S]{{{low},{high}}}$")
    return schema


def _names_from_list(schema: Schema, names: list[str]) -> Schema:
    props = dict(schema.get("properties", {}))
    extra = schema.get("additionalProperties", True)
    kept: Schema = {}
    for name in names:
        if name in props:
            kept[name] = props[name]
        elif extra is not False:
            kept[name] = {} if extra is True else extra
    out = {k: v for k, v in schema.items() if k not in ("propertyNames", "properties")}
    out["properties"] = kept
    out["additionalProperties"] = False
    return out


def _names_from_pattern(schema: Schema, pattern: str) -> Schema:
    try:
        compiled = re.compile(pattern)
    except re.error:
        return schema
    extra = schema.get("additionalProperties", True)
    props = {n: s for n, s in schema.get("properties", {}).items() if compiled.search(n)}
    out = {k: v for k, v in schema.items() if k not in ("propertyNames", "properties")}
    if props or "properties" in schema:
        out["properties"] = props
    if extra is not False:
        out["patternProperties"] = {pattern: {} if extra is True else extra}
    out["additionalProperties"] = False
    return out


# -- if / then / else ---------------------------------------------------------------------


def _if_then_else(schema: Schema) -> Schema:
    test = schema["if"]
    rest = {k: v for k, v in schema.items() if k not in ("if", "then", "else")}
    if "anyOf" in rest or "oneOf" in rest:
        return schema
    then, otherwise = schema.get("then", True), schema.get("else", True)
    cases = _cases(test, rest)
    if cases is None:
        return schema
    holds, fails = cases
    branches = []
    for case, follow in ((holds, then), (fails, otherwise)):
        if follow is False:
            continue
        for alternative in case:
            parts = [alternative] if follow is True or follow == {} else [alternative, follow]
            branches.append(parts[0] if len(parts) == 1 else {"allOf": parts})
    if not branches:
        return {**rest, "not": {}}  # neither case allowed: keep the contradiction visible
    return {**rest, "anyOf": branches}


def _cases(test: Any, rest: Schema) -> tuple[list[Schema], list[Schema]] | None:
    """The instances where `test` holds and where it fails, each as a list of alternative
    schemas (object instances only; others pass `if` unless it says otherwise)."""
    if test is True or test == {}:
        return [{}], []
    # Non-objects pass `required` and `properties` tests: only objects are rewritten.
    if not isinstance(test, dict) or rest.get("type") != "object":
        return None
    keys = set(test) - {"type"}
    if test.get("type", "object") != "object":
        return None
    required = test.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return None
    if keys == {"required"} and required:
        missing = [{"properties": {name: False}} for name in required]
        return [{"required": required}], missing
    if keys <= {"required", "properties"} and isinstance(test.get("properties"), dict):
        props = test["properties"]
        if len(props) != 1:
            return None
        name, condition = next(iter(props.items()))
        values = enum_values(condition) if isinstance(condition, dict) else None
        if values is None or set(condition) - {"const", "enum", "type"}:
            return None
        domain = _finite_values(rest, name)
        if domain is None:
            return None
        inside = {canonical(v) for v in values}
        others = [v for v in domain if canonical(v) not in inside]
        present: Schema = {"required": [name], "properties": {name: {"enum": values}}}
        absent: Schema = {"properties": {name: False}}
        differ: Schema = {"required": [name], "properties": {name: {"enum": others}}}
        holds = [present] if name in required else [present, absent]
        fails = ([differ] if others else []) + ([absent] if name in required else [])
        if not set(required) <= {name}:
            return None
        return holds, fails
    return None


def _finite_values(rest: Schema, name: str) -> list[Any] | None:
    """The values property `name` can take under `rest`, when that is a finite list."""
    props = rest.get("properties", {})
    sub = props.get(name) if isinstance(props, dict) else None
    if not isinstance(sub, dict):
        return None
    values = enum_values(sub)
    if values is not None:
        return values
    if sub.get("type") == "boolean":
        return [True, False]
    return None
