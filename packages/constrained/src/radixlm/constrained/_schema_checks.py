"""What `auto`'s validation checks where: the necessary subschemas of each place in a document
(`SchemaChecks`, `Place`) and the checks themselves (jsonschema-rs when installed, `jsonschema`
for the verdicts that matter and for the finished document); see `_validation.py`."""

from __future__ import annotations

import contextlib
import functools
import json
import re
from dataclasses import dataclass
from typing import Any

Schema = Any
Located = tuple[Schema, ...]

# Keywords through which a subschema applies to the same instance, necessarily.
_SAME_NECESSARY = ("allOf",)
# Subschemas whose values the scanner does not locate: a deferred keyword anywhere under them
# is checked when the value holding them closes.
_BRANCHES = (
    "anyOf",
    "oneOf",
    "if",
    "then",
    "else",
    "not",
    "dependentSchemas",
    "contains",
    "unevaluatedProperties",
    "unevaluatedItems",
    "propertyNames",
    "dependencies",
)
# A place remembers this many of its members or items (arrays may be long); then it forgets
# them all and finds them again (the same subschemas).
_KEEP_CHILDREN = 4096


def compiled_validator_available() -> bool:
    """Whether jsonschema-rs (a compiled validator, the extra `fast-validation`) is installed:
    it then says whether each value is valid (about 0.2 µs where `jsonschema` takes 50), and
    `jsonschema` only explains the values it rejects and judges the finished document."""
    return _compiled_validators() is not None


@functools.cache
def _compiled_validators() -> Any:
    try:
        import jsonschema_rs
    except ImportError:
        return None
    return jsonschema_rs


# The finished document's judge. `jsonschema` is the reference; jsonschema-rs gives the same
# verdict, faster (a few µs where `jsonschema` takes 100 or more), wherever both implement the
# specification alike: the keywords below, regexes of a syntax both read alike, matched
# against printable ASCII (Python's `re` and ECMA-262 differ on `$` before a final newline, on
# `.` and `\d`, `\w`, `\s` beyond ASCII), numbers a float holds exactly, and no `format`
# (the two check formats differently) and no fractional `multipleOf` (float arithmetic).
# Anything else is judged by `jsonschema`.
_AGREED_KEYWORDS = frozenset({
    "type", "enum", "const", "required", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern", "minItems",
    "maxItems", "uniqueItems", "minProperties", "maxProperties", "dependentRequired",
    "minContains", "maxContains", "properties", "patternProperties", "additionalProperties",
    "items", "prefixItems", "additionalItems", "contains", "propertyNames", "allOf", "anyOf",
    "oneOf", "not", "if", "then", "else", "dependentSchemas", "$defs", "definitions", "$ref",
    "$schema", "$comment", "title", "description", "default", "examples", "deprecated",
    "readOnly", "writeOnly",
})  # fmt: skip
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = (
    "additionalProperties", "items", "additionalItems", "contains", "propertyNames", "not",
    "if", "then", "else",
)  # fmt: skip
# Regex syntax read alike by Python's `re` and by ECMA-262 engines: characters, classes,
# groups that capture, quantifiers, alternation, anchors and a few escapes.
_AGREED_REGEX = re.compile(r"(?:[^\\(]|\\[dDwWsS.\\\-/\[\](){}*+?|^$]|\((?!\?))*")
# A document outside the agreed inputs: an escape in a string (so a newline or other control
# character may be in it), a byte outside printable ASCII, an integer a float cannot hold, an
# exponent far from 1.
_UNAGREED_DOCUMENT = re.compile(rb"[\\\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\xff]|\d{16,}|[eE][-+]?\d{3,}")
_LOCAL_DEFINITION_REF = re.compile(r"#/(\$defs|definitions)/[^/]+")


_UNSET = object()


def judges_agree(schema: Schema) -> bool:
    """Whether jsonschema-rs judges documents against `schema` as `jsonschema` does (on the
    documents `document_is_plain` admits): every keyword in `_AGREED_KEYWORDS`, every regex
    in the agreed syntax, references local, no `format`, no fractional `multipleOf`."""
    stack: list[Any] = [schema]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict) or not _AGREED_KEYWORDS.issuperset(node):
            return False
        if id(node) in seen:
            continue
        seen.add(id(node))
        for pattern in [node.get("pattern"), *node.get("patternProperties", {})]:
            if pattern is not None and not (
                isinstance(pattern, str) and _AGREED_REGEX.fullmatch(pattern)
            ):
                return False
        step = node.get("multipleOf")
        if step is not None and not (isinstance(step, int) and not isinstance(step, bool)):
            return False
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and _LOCAL_DEFINITION_REF.fullmatch(ref)):
            return False
        for key in _SCHEMA_MAPS:
            value = node.get(key)
            if value is not None:
                if not isinstance(value, dict):
                    return False
                stack.extend(value.values())
        for key in _SCHEMA_LISTS:
            value = node.get(key)
            if value is not None:
                if not isinstance(value, list):
                    return False
                stack.extend(value)
        for key in _SCHEMA_VALUES:
            if key in node:
                value = node[key]
                stack.extend(value if key == "items" and isinstance(value, list) else [value])
    return True


def document_is_plain(text: bytes) -> bool:
    """Whether a JSON document is one `judges_agree` speaks for: no escapes in its strings, only
    printable ASCII (whitespace between tokens aside), numbers a float holds exactly."""
    return _UNAGREED_DOCUMENT.search(text) is None


# References the compiled validator resolves in a subschema compiled on its own: the root's
# definitions are copied beside it (anything else goes to `jsonschema`, which has the root).
_LOCAL_DEFINITION = re.compile(r'"\$ref":\s*"#/(\$defs|definitions)/')
_ANY_REFERENCE = re.compile(r'"\$(ref|dynamicRef|recursiveRef|id)"|"id":')


class SchemaChecks:
    """The original schema, its validator and what to check where. Immutable once built and
    shared by every matcher of one compiled grammar (caches fill under the GIL).

    `registry`: where references to other documents resolve (`schema_registry`, the
    grammar's); references left in `schema` are local once it is bundled (`_schema_bundle`)."""

    def __init__(
        self,
        schema: Any,
        deferred: frozenset[str],
        *,
        max_retries_per_value: int = 8,
        max_retries: int = 64,
        registry: Any = None,
    ) -> None:
        import jsonschema
        import referencing

        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        # The grammar's registry (`_schema_documents.schema_registry`): the same documents
        # behind the same references. A registry of its own (even an empty one: jsonschema
        # adds the metaschemas) keeps jsonschema from fetching anything.
        self.validator = cls(
            schema,
            format_checker=cls.FORMAT_CHECKER,
            registry=referencing.Registry() if registry is None else registry,
        )
        self.root = schema
        self.deferred = deferred
        self.max_retries_per_value = max_retries_per_value
        self.max_retries = max_retries
        self._validators: dict[int, Any] = {}
        self._expanded: dict[int, list[Schema]] = {}
        self._compiled: dict[int, Any] = {}  # id(schema) -> jsonschema-rs validator or None
        self._final_judge: Any = _UNSET
        # Places by the ids of their subschemas (all parts of `schema`, alive as long as it).
        self._places: dict[tuple[int, ...], Place] = {}
        self.root_place = self.place((schema,))

    def place(self, located: Located) -> Place:
        """The one `Place` of these subschemas."""
        key = tuple(map(id, located))
        found = self._places.get(key)
        if found is None:
            found = self._places[key] = Place(self, located)
        return found

    # -- where a value sits ------------------------------------------------------------------

    def resolve(self, ref: Any) -> Schema:
        """A local `$ref` ("#", "#/..."), or None for references this cannot follow."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def expand(self, schema: Schema) -> list[Schema]:
        """`schema` and what applies to the same value necessarily ($ref, allOf), as dicts."""
        found = self._expanded.get(id(schema))
        if found is not None:
            return found
        out: list[Schema] = []
        stack = [schema]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            out.append(node)
            if "$ref" in node:
                stack.append(self.resolve(node["$ref"]))
            for key in _SAME_NECESSARY:
                if isinstance(node.get(key), list):
                    stack.extend(node[key])
        self._expanded[id(schema)] = out
        return out

    def child(self, located: Located, part: str | int) -> Located:
        """The necessary subschemas of a member (`part` a name) or an item (an index)."""
        out: list[Schema] = []
        for schema in located:
            for node in self.expand(schema):
                out.extend(self._child_of(node, part))
        return tuple(s for s in out if isinstance(s, dict) and s)

    @staticmethod
    def _child_of(node: dict[str, Any], part: str | int) -> list[Schema]:
        import re

        if isinstance(part, str):
            found: list[Schema] = []
            props = node.get("properties")
            if isinstance(props, dict) and part in props:
                found.append(props[part])
            patterns = node.get("patternProperties")
            matched = False
            if isinstance(patterns, dict):
                for pattern, sub in patterns.items():
                    try:
                        if re.search(pattern, part):
                            found.append(sub)
                            matched = True
                    except re.error:
                        continue
            listed = isinstance(props, dict) and part in props
            extra = node.get("additionalProperties")
            if not listed and not matched and isinstance(extra, dict):
                found.append(extra)
            return found
        prefix = node.get("prefixItems")
        items = node.get("items")
        if isinstance(items, list):  # draft 7 tuples
            prefix, items = items, node.get("additionalItems")
        if isinstance(prefix, list) and part < len(prefix):
            return [prefix[part]]
        return [items] if isinstance(items, dict) else []

    def needs_check(self, located: Located) -> bool:
        """Whether a value at this place has a deferred keyword to check when it closes."""
        return any(self._uses_deferred(s, set()) for s in located)

    def _uses_deferred(self, schema: Schema, seen: set[int]) -> bool:
        """A deferred keyword applies to this very value: in the schema, through `$ref` and
        `allOf`, or anywhere under a branch (`anyOf`, `not`, ...) or a subschema whose values
        are not located (`contains`, `unevaluated*`), since those are checked only here."""
        if not isinstance(schema, dict) or id(schema) in seen:
            return False
        seen.add(id(schema))
        if self.deferred & schema.keys():
            return True
        if "$ref" in schema and self._uses_deferred(self.resolve(schema["$ref"]), seen):
            return True
        if any(self._uses_deferred(b, seen) for b in _as_list(schema.get("allOf"))):
            return True
        for key in _BRANCHES:
            if key in schema and self._deep_uses_deferred(schema[key], set()):
                return True
        return False

    def _deep_uses_deferred(self, node: Any, seen: set[int]) -> bool:
        """A deferred keyword anywhere under `node`, `$ref`s followed."""
        stack = [node]
        while stack:
            item = stack.pop()
            if id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, dict):
                if self.deferred & item.keys():
                    return True
                if isinstance(item.get("$ref"), str):
                    stack.append(self.resolve(item["$ref"]))
                stack.extend(v for k, v in item.items() if k not in ("enum", "const"))
            elif isinstance(item, list):
                stack.extend(item)
        return False

    def item_rules(self, located: Located) -> ItemRules | None:
        """What every prefix of an array here must meet (uniqueItems, maxContains), or None."""
        unique = False
        limits: list[tuple[Schema, int]] = []
        for schema in located:
            for node in self.expand(schema):
                unique = unique or node.get("uniqueItems") is True
                limit = node.get("maxContains")
                if "contains" in node and isinstance(limit, int) and not isinstance(limit, bool):
                    limits.append((node["contains"], limit))
        return ItemRules(unique, tuple(limits)) if unique or limits else None

    def name_rules(self, located: Located) -> list[Schema]:
        """The `propertyNames` schemas every member name of an object here must meet."""
        return [
            node["propertyNames"]
            for schema in located
            for node in self.expand(schema)
            if "propertyNames" in node
        ]

    # -- checking ----------------------------------------------------------------------------

    def compiled(self, schema: Schema) -> Any:
        """A jsonschema-rs validator for `schema` (a subschema of the root, which it needs for
        its local `$ref`s), or None where it is not installed or cannot stand in for
        `jsonschema` (references that leave the root's definitions, ids, a schema it
        refuses). It never fetches a document: it is built offline."""
        key = id(schema)
        if key in self._compiled:
            return self._compiled[key]
        found = None
        rs = _compiled_validators()
        if rs is not None and isinstance(schema, dict):
            found = self._build_compiled(rs, schema)
        self._compiled[key] = found
        return found

    def _build_compiled(self, rs: Any, schema: Schema) -> Any:
        text = json.dumps(schema)
        if _ANY_REFERENCE.search(text):
            if schema is self.root or len(_ANY_REFERENCE.findall(text)) != len(
                _LOCAL_DEFINITION.findall(text)
            ):
                return None
            schema = dict(schema)
            for container in ("$defs", "definitions"):
                if container in self.root and container not in schema:
                    schema[container] = self.root[container]
        if isinstance(self.root, dict) and "$schema" in self.root:
            schema = {**schema, "$schema": self.root["$schema"]}
        try:
            return rs.validator_for(schema, validate_formats=True, offline=True)
        except Exception:  # a schema it cannot compile: jsonschema checks it
            return None

    def final_judge(self) -> Any:
        """The jsonschema-rs validator of the whole schema where it judges plain documents as
        `jsonschema` does (`judges_agree`), else None: `jsonschema` judges them all."""
        if self._final_judge is _UNSET:
            self._final_judge = None
            rs = _compiled_validators()
            # judges_agree walks the schema keyword by keyword: its references are local and
            # it has no ids (the text-level test of `compiled` also takes a member named "id"
            # for draft 4's id).
            if rs is not None and judges_agree(self.root):
                # A schema it cannot compile (draft 4 spellings, say): jsonschema judges.
                with contextlib.suppress(Exception):
                    self._final_judge = rs.validator_for(
                        self.root, validate_formats=True, offline=True
                    )
        return self._final_judge

    def first_error(
        self,
        value: Any,
        schemas: Located | list[Schema],
        *,
        final: bool = False,
        text: bytes | None = None,
    ) -> Any:
        """The most relevant `jsonschema` error of `value` against `schemas`, or None. With
        jsonschema-rs installed it says first whether the value is valid; `final` (the
        finished document, `text` its bytes) goes through `jsonschema`, the reference, unless
        the schema and the document are ones jsonschema-rs judges alike (`final_judge`,
        `document_is_plain`)."""
        if final and text is not None:
            judge = self.final_judge()
            if judge is not None and document_is_plain(text):
                try:
                    if judge.is_valid(value):
                        return None
                except (ArithmeticError, ValueError, OverflowError):
                    pass  # jsonschema says why
        for schema in schemas:
            fast = None if final else self.compiled(schema)
            if fast is not None:
                try:
                    if fast.is_valid(value):
                        continue
                except (ArithmeticError, ValueError, OverflowError):
                    pass  # jsonschema says why
            from jsonschema.exceptions import best_match

            validator = self._validators.get(id(schema))
            if validator is None:
                validator = self._validators[id(schema)] = self.validator.evolve(schema=schema)
            try:
                error = best_match(validator.iter_errors(value))
            except (ArithmeticError, ValueError, RecursionError) as caught:
                # e.g. multipleOf of a number that overflowed to infinity: not a valid value.
                return NotJson(f"the value cannot be checked: {caught}")
            if error is not None:
                return error
        return None


class Place:
    """A place in a document, known by its necessary subschemas (`located`; empty where the
    schema says nothing necessary): what a value there needs when it closes, and the places of
    its members and items. One object per set of subschemas (`SchemaChecks.place`), so this is
    worked out once per schema, not per value; immutable but for the cache of children."""

    __slots__ = ("_checks", "children", "item_rules", "located", "name_rules", "needs_check")

    def __init__(self, checks: SchemaChecks, located: Located) -> None:
        self.located = located
        self.needs_check = checks.needs_check(located)
        self.item_rules = checks.item_rules(located)
        self.name_rules = checks.name_rules(located)
        self._checks = checks
        self.children: dict[str | int, Place] = {}  # a cache: see `child`

    def child(self, part: str | int) -> Place:
        """The place of the member named `part` (a str) or of the item at index `part`."""
        found = self.children.get(part)
        if found is None:
            checks = self._checks
            found = checks.place(checks.child(self.located, part))
            if len(self.children) >= _KEEP_CHILDREN:
                self.children.clear()
            self.children[part] = found
        return found


@dataclass(frozen=True, slots=True)
class ItemRules:
    """What an array's items must meet as each closes: all distinct (`uniqueItems`, with
    JSON equality: 1 == 1.0, true != 1), and at most `limit` matching `schema` for each
    (`contains`, `maxContains`). Checked item by item, never by revalidating the prefix."""

    unique: bool
    max_contains: tuple[tuple[Schema, int], ...]


def canonical(value: Any) -> Any:
    """A hashable stand-in for a JSON value; equal exactly when the values are equal in JSON
    Schema's sense (numbers by value, booleans apart from numbers, objects unordered)."""
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int | float):
        return ("n", value)
    if isinstance(value, str):
        return ("s", value)
    if isinstance(value, list):
        return ("a", tuple(canonical(v) for v in value))
    if isinstance(value, dict):
        return ("o", frozenset((k, canonical(v)) for k, v in value.items()))
    return ("z", None)


@dataclass(frozen=True, slots=True)
class NotJson:
    """Stands in for a jsonschema error: bytes that are not JSON at all, or a failed check
    made here rather than by jsonschema (an item's `uniqueItems`, `maxContains`)."""

    message: str
    validator: str = "type"
    absolute_path: tuple[str, ...] = ()


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
