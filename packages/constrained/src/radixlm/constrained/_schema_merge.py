"""Pieces of JSON Schema algebra the normalizer needs: intersecting two schemas (allOf), checking
a value against simple keywords, and proving two schemas disjoint (oneOf)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

Schema = dict[str, Any]

ALL_TYPES = frozenset({"null", "boolean", "object", "array", "number", "integer", "string"})
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains")
# Subschemas merged lazily: the walker expands the allOf when it reaches them.
_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems")


class Unsatisfiable(Exception):
    """No value satisfies the schema; `keyword` is where the contradiction shows."""

    def __init__(self, keyword: str, reason: str) -> None:
        super().__init__(reason)
        self.keyword = keyword
        self.reason = reason


class CannotMerge(Exception):
    """Two schemas whose intersection this normalizer cannot write as one schema."""

    def __init__(self, keyword: str, reason: str) -> None:
        super().__init__(reason)
        self.keyword = keyword
        self.reason = reason


def canonical(value: Any) -> str:
    """A text that is equal for JSON-equal values (1 == 1.0, key order ignored)."""

    def norm(v: Any) -> Any:
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, (int, float)):
            return int(v) if float(v).is_integer() else float(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v

    return json.dumps(norm(value), sort_keys=True)


def json_type(value: Any) -> str:
    """The JSON Schema type of a value (an integral number is an "integer")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def type_set(schema: Schema) -> frozenset[str] | None:
    """The types a schema admits (None: any type), with "number" including "integer"."""
    found: set[str] | None = None
    if "type" in schema:
        declared = schema["type"]
        found = set(declared if isinstance(declared, list) else [declared])
        if "number" in found:
            found.add("integer")
    for key in ("const", "enum"):
        if key in schema:
            values = [schema[key]] if key == "const" else list(schema[key])
            kinds = {json_type(v) for v in values}
            found = kinds if found is None else found & kinds
    return None if found is None else frozenset(found)


def enum_values(schema: Schema) -> list[Any] | None:
    if "const" in schema:
        return [schema["const"]]
    if "enum" in schema and isinstance(schema["enum"], list):
        return list(schema["enum"])
    return None


def _intersect_types(a: Any, b: Any) -> list[str]:
    left = set(a if isinstance(a, list) else [a])
    right = set(b if isinstance(b, list) else [b])
    both = left & right
    if ("integer" in left and "number" in right) or ("number" in left and "integer" in right):
        both.add("integer")
    if not both:
        raise Unsatisfiable("type", f"type {a!r} and type {b!r} have no value in common")
    return sorted(both)


def merge(a: Schema, b: Schema) -> Schema:
    """The intersection of two schemas (both without allOf or $ref at their top), as one schema.
    Nested subschemas that both constrain are combined with allOf for the caller to expand."""
    out: Schema = dict(a)
    values_a, values_b = enum_values(a), enum_values(b)
    for key, vb in b.items():
        if key in ("const", "enum"):
            continue
        if key not in out:
            out[key] = vb
            continue
        va = out[key]
        if canonical(va) == canonical(vb):
            continue
        if key == "type":
            out[key] = _intersect_types(va, vb)
        elif key in _LOWER:
            out[key] = max(va, vb)
        elif key in _UPPER:
            out[key] = min(va, vb)
        elif key == "required":
            out[key] = list(dict.fromkeys([*va, *vb]))
        elif key == "properties":
            props = dict(va)
            for name, sub in vb.items():
                props[name] = {"allOf": [props[name], sub]} if name in props else sub
            out[key] = props
        elif key in _SUBSCHEMA:
            out[key] = False if va is False or vb is False else {"allOf": [va, vb]}
        elif key == "prefixItems" and len(va) == len(vb):
            out[key] = [{"allOf": [x, y]} for x, y in zip(va, vb, strict=True)]
        elif key == "multipleOf" and all(isinstance(v, int) for v in (va, vb)):
            out[key] = va * vb // math.gcd(va, vb)
        else:
            raise CannotMerge(
                key, f"two different values of {key!r} ({va!r} and {vb!r}) cannot be combined"
            )
    _close_properties(out, a, b)
    if values_a is not None or values_b is not None:
        out.pop("const", None)
        if values_a is not None and values_b is not None:
            right = {canonical(v) for v in values_b}
            values = [v for v in values_a if canonical(v) in right]
            if not values:
                raise Unsatisfiable("enum", "the enum/const values have none in common")
        else:
            values = values_a if values_a is not None else values_b or []
        out["enum"] = values
    return out


def _close_properties(out: Schema, a: Schema, b: Schema) -> None:
    """A side that closes its object (additionalProperties) also governs the other side's
    property names it does not list."""
    props = out.get("properties")
    if not isinstance(props, dict):
        return
    for side in (a, b):
        extra = side.get("additionalProperties", True)
        if extra is True or "patternProperties" in side:
            continue
        listed = side.get("properties", {})
        for name in list(props):
            if name in listed:
                continue
            props[name] = False if extra is False else {"allOf": [props[name], extra]}


def value_satisfies(value: Any, schema: Schema) -> bool | None:
    """Whether `value` meets the keywords of `schema` that apply to it; None when a keyword
    that applies cannot be checked here (applicators, formats)."""
    kind = json_type(value)
    allowed = type_set({k: v for k, v in schema.items() if k == "type"})
    if allowed is not None and kind not in allowed:
        return False
    number = kind in ("integer", "number")
    checks: dict[str, Any] = {
        "minimum": lambda v, x: v >= x,
        "maximum": lambda v, x: v <= x,
        "exclusiveMinimum": lambda v, x: v > x,
        "exclusiveMaximum": lambda v, x: v < x,
        "multipleOf": lambda v, x: math.isclose(v / x, round(v / x), abs_tol=1e-9),
    }
    for key, limit in schema.items():
        if key in checks and number:
            if not checks[key](value, limit):
                return False
        elif key in ("minLength", "maxLength") and kind == "string":
            length = len(value)
            if (length < limit) if key == "minLength" else (length > limit):
                return False
        elif key == "pattern" and kind == "string":
            try:
                if re.search(limit, value) is None:
                    return False
            except re.error:
                return None
        elif key in ("minItems", "maxItems") and kind == "array":
            if (len(value) < limit) if key == "minItems" else (len(value) > limit):
                return False
        elif key in ("minProperties", "maxProperties") and kind == "object":
            if (len(value) < limit) if key == "minProperties" else (len(value) > limit):
                return False
        elif key == "required" and kind == "object":
            if any(name not in value for name in limit):
                return False
        elif (key == "format" and kind == "string") or (
            key in ("properties", "items", "prefixItems", "additionalProperties")
            and (kind in ("object", "array"))
        ):
            return None
    return True


def provably_disjoint(x: Schema, y: Schema, resolve: Any) -> bool:
    """True when no value can satisfy both schemas (checked on types, enum/const values, a
    required property whose const/enum values differ, or a property one requires and the other
    forbids). False means "not proven", not "overlapping"."""
    tx, ty = type_set(x), type_set(y)
    if tx is not None and ty is not None and not tx & ty:
        return True
    vx, vy = enum_values(x), enum_values(y)
    if _disjoint_values(vx, vy):
        return True
    return _objects_disjoint(x, y, resolve) or _objects_disjoint(y, x, resolve)


def _objects_disjoint(x: Schema, y: Schema, resolve: Any) -> bool:
    required_x = set(x.get("required", []))
    props_x, props_y = x.get("properties", {}), y.get("properties", {})
    closed = y.get("additionalProperties", True) is False and "patternProperties" not in y
    if closed and required_x - set(props_y):
        return True
    for name in required_x & set(y.get("required", [])):
        if name not in props_x or name not in props_y:
            continue
        if _disjoint_values(
            enum_values(resolve(props_x[name])), enum_values(resolve(props_y[name]))
        ):
            return True
    return False


def _disjoint_values(vx: list[Any] | None, vy: list[Any] | None) -> bool:
    if vx is None or vy is None:
        return False
    return not {canonical(v) for v in vx} & {canonical(v) for v in vy}
