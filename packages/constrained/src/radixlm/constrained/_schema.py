"""JSON Schema normalization: hand a backend only what it enforces exactly, or refuse by name.

Backends silently drop keywords they do not implement and loosen some shapes (a root `type`
beside `oneOf`, `allOf` branches, siblings of `$ref`). This module rewrites a schema into a
form both backends enforce faithfully, or raises `GrammarError` naming the keyword:

- `allOf` branches and the siblings of a `$ref` are merged into one schema;
- keywords beside `anyOf` / `oneOf` are pushed into every branch; branches that contradict
  them are dropped; `oneOf` becomes `anyOf` only when its branches are provably disjoint;
- `enum` / `const` beside other keywords keep only the values that meet them;
- integer bounds are rounded inward; a `required` property missing from `properties` is added;
- every validation keyword the backend does not enforce is rejected by name (annotations such
  as `title` and keywords JSON Schema does not define are dropped: validators ignore them too).

With `relax=True` (the `auto` backend, not strict) nothing enforceable by validation is refused:
a keyword the backend cannot enforce is dropped, which leaves a grammar for a superset of the
schema, and recorded in `deferred` (the grammar's owner validates completed values against the
original schema, see `_validation.py`); overlapping `oneOf` becomes `anyOf`; `format` values
nothing checks are dropped and recorded in `annotations`.
"""

from __future__ import annotations

import copy
import json
import math
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixlm.constrained._schema_bundle import bundle_schema
from radixlm.constrained._schema_merge import (
    ALL_TYPES,
    CannotMerge,
    Schema,
    Unsatisfiable,
    merge,
    provably_disjoint,
    type_set,
    value_satisfies,
)
from radixlm.constrained._schema_rewrite import rewrite_for_grammar
from radixlm.constrained._schema_support import (
    DEF_CONTAINERS,
    FORMAT_PATTERNS,
    LAZY_MAX_NODES,
    LLGUIDANCE_SUPPORT,
    OUTLINES_SUPPORT,
    VALIDATION_KEYWORDS,
    XGRAMMAR_SUPPORT,
    SchemaSupport,
    checked_formats,
)
from radixlm.constrained.errors import GrammarError

# GrammarError.limit of a schema too large for the backend at hand but not for llguidance.
BACKEND_NODES_LIMIT = "backend_schema_nodes"
_LONGEST_LENGTH_PATTERN = 256
# Regex features the backends' automata cannot express (look-around, backreferences).
_NON_REGULAR = re.compile(r"\(\?<?[=!]|\\[1-9]|\\k<")
_NUMBERS = ("multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum")
_COUNTS = (
    "maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties",
    "maxContains", "minContains",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class NormalizedSchema:
    """A schema as a backend gets it (`text`), the parsed original, and what was relaxed.

    `validation` is what completed values are validated against, with its references
    resolving in `registry` (the original with the documents it refers to bundled in, see
    `_schema_bundle`): pass both to jsonschema to accept what the grammar accepts."""

    text: str
    original: Any
    deferred: frozenset[str] = frozenset()
    annotations: frozenset[str] = frozenset()
    validation: Any = None
    registry: Any = None


def prepare_json_schema(
    source: str,
    support: SchemaSupport,
    *,
    max_depth: int = 64,
    max_bytes: int = 8 << 20,
    documents: Mapping[str, Any] | None = None,
) -> str:
    """The normalized schema as JSON text, or `GrammarError` saying what to change."""
    return normalize_json_schema(
        source, support, max_depth=max_depth, max_bytes=max_bytes, documents=documents
    ).text


def normalize_json_schema(
    source: str,
    support: SchemaSupport,
    *,
    max_depth: int = 64,
    max_bytes: int = 8 << 20,
    relax: bool = False,
    documents: Mapping[str, Any] | None = None,
) -> NormalizedSchema:
    """The normalized schema with what was deferred to validation (`relax=True` only), or
    `GrammarError` saying what to change. `documents` (URI or name relative to the schema ->
    schema) are what references to other documents may resolve to (`_schema_documents`)."""
    if len(source.encode("utf-8")) > max_bytes:
        raise GrammarError(
            f"the JSON schema is {len(source.encode('utf-8'))} bytes, above the limit of "
            f"{max_bytes} bytes; simplify it or raise the limit (GrammarOptions.max_source_bytes, "
            "the server's --max-constraint-bytes)",
            kind="json_schema",
            limit="max_source_bytes",
        )
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as error:
        raise GrammarError(
            f"the JSON schema is not valid JSON: {error.msg} at line {error.lineno} "
            f"column {error.colno}",
            kind="json_schema",
        ) from None
    except RecursionError:
        raise GrammarError(
            "the JSON schema is nested too deeply to parse", kind="json_schema"
        ) from None
    # The documents it refers to, copied in: every reference left is local.
    bundle = bundle_schema(schema, documents)
    bundled = bundle.schema
    unsatisfiable: frozenset[str] = frozenset()
    while True:
        normalizer = _Normalizer(
            bundled, support, max_depth, relax=relax, unsatisfiable=unsatisfiable
        )
        try:
            normalized = normalizer.run()
            break
        except RecursionError:
            raise GrammarError(
                f"the JSON schema is nested deeper than this server accepts ({max_depth} levels)",
                kind="json_schema",
            ) from None
        except _Restart as restart:
            # A definition no value satisfies: normalize again with its references treated
            # as `false` (branches dropped, optional properties left out).
            if restart.ref in unsatisfiable or len(unsatisfiable) > 64:
                raise normalizer.reject(
                    restart.ref[1:],
                    restart.error.keyword,
                    f"no value satisfies: {restart.error.reason}",
                ) from None
            unsatisfiable |= {restart.ref}
    return NormalizedSchema(
        json.dumps(normalized, separators=(",", ":")),
        schema,
        frozenset(normalizer.deferred),
        frozenset(normalizer.annotations),
        bundle.validation,
        bundle.registry,
    )


class _Restart(Exception):
    """A referenced definition turned out unsatisfiable; normalization starts over."""

    def __init__(self, ref: str, error: Unsatisfiable) -> None:
        super().__init__(ref)
        self.ref = ref
        self.error = error


def _pointer_part(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


class _Normalizer:
    def __init__(
        self,
        root: Any,
        support: SchemaSupport,
        max_depth: int,
        *,
        relax: bool = False,
        unsatisfiable: frozenset[str] = frozenset(),
    ) -> None:
        self.unsatisfiable = unsatisfiable  # local refs whose targets allow no value
        declared = root.get("$schema", "") if isinstance(root, dict) else ""
        # Up to draft 7, keywords beside a $ref are ignored.
        self.ref_hides_siblings = isinstance(declared, str) and bool(
            re.search(r"draft-0[3-7]/", declared)
        )
        self._anchors: dict[str, str] | None = None
        self.root = root
        self.support = support
        self.max_depth = max_depth
        self.relax = relax
        self.deferred: set[str] = set()
        self.annotations: set[str] = set()
        self.nodes = 0
        self.pending: list[str] = []
        self.ref_names: dict[str, tuple[str, str]] = {}
        self.ref_origins: dict[str, str] = {}  # written reference -> the schema's own
        self.defs: dict[str, dict[str, Any]] = {}

    # -- errors -----------------------------------------------------------------------------

    def reject(self, path: str, keyword: str | None, message: str) -> GrammarError:
        where = f" at {path or '/'}" if path or keyword else ""
        return GrammarError(
            f"JSON schema{where}: {message}",
            kind="json_schema",
            backend=self.support.backend,
            keyword=keyword,
            path=path or "/",
        )

    def too_many_nodes(self) -> GrammarError:
        backend, limit = self.support.backend, self.support.max_nodes
        if limit < LAZY_MAX_NODES:
            return GrammarError(
                f"the JSON schema has over {limit} subschemas, too many for the {backend} "
                "backend, which builds its whole grammar when it compiles; use the llguidance "
                f"backend (or auto), which compiles schemas of up to {LAZY_MAX_NODES} "
                "subschemas lazily, or simplify the schema",
                kind="json_schema",
                backend=backend,
                limit=BACKEND_NODES_LIMIT,
            )
        return GrammarError(
            f"the JSON schema has more than {limit} subschemas, above the limit of {limit} "
            "that any backend compiles; simplify it (share repeated parts through $defs and "
            "$ref, or split it into several requests)",
            kind="json_schema",
            backend=backend,
            limit="max_schema_nodes",
        )

    def unsupported(self, path: str, keyword: str, detail: str = "") -> GrammarError:
        hint = "remove it or express it with keywords the backend supports"
        for other in (XGRAMMAR_SUPPORT, LLGUIDANCE_SUPPORT, OUTLINES_SUPPORT):
            if other.backend != self.support.backend and keyword in other.keywords and not detail:
                hint += f", or use the {other.backend} backend, which enforces it"
        return self.reject(
            path,
            keyword,
            f"keyword {keyword!r}{detail} is not enforced by the {self.support.backend} "
            f"backend, so it would be silently ignored; {hint}",
        )

    # -- entry ------------------------------------------------------------------------------

    def run(self) -> Schema:
        if self.root is False:
            raise self.reject("", None, "the schema `false` allows no value")
        try:
            out = self.node(self.root, "", 0)
        except Unsatisfiable as error:
            raise self.reject(
                "", error.keyword, f"no value satisfies the schema: {error.reason}"
            ) from None
        while self.pending:
            ref = self.pending.pop()
            container, name = self.ref_names[ref]
            if name in self.defs.get(container, {}):
                continue
            self.defs.setdefault(container, {})[name] = {}  # placeholder breaks cycles
            try:
                self.defs[container][name] = self.node(self.resolve(ref, ""), ref[1:], 1)
            except Unsatisfiable as error:
                if ref in self.unsatisfiable:  # pragma: no cover - caught at the reference
                    raise
                raise _Restart(ref, error) from None
        self.check_aliases(out)
        if not self.support.recursion:
            self.check_acyclic(out)
        if self.defs:
            out = dict(out)
            out.update({container: dict(defs) for container, defs in self.defs.items()})
        return out

    def check_aliases(self, root: Schema) -> None:
        """A definition that only refers on, in a circle, never reaches a schema: refuse it
        (backends would compile it into a grammar that allows nothing, or loop)."""

        def target(schema: Any) -> Any:
            if isinstance(schema, dict) and set(schema) == {"$ref"}:
                ref = schema["$ref"]
                if ref == "#":
                    return ref, root
                container, _, name = ref[2:].partition("/")
                name = name.replace("~1", "/").replace("~0", "~")
                return ref, self.defs.get(container, {}).get(name)
            return None, None

        starts = [("#", root)] + [
            (f"#/{container}/{_pointer_part(name)}", schema)
            for container, defs in self.defs.items()
            for name, schema in defs.items()
        ]
        for start, schema in starts:
            seen = {start}
            ref, current = target(schema)
            while ref is not None:
                if ref in seen:
                    raise self.reject(
                        ref[1:],
                        "$ref",
                        f"$ref {ref!r} refers to itself without ever reaching a schema; "
                        "give the definition a type or properties",
                    )
                seen.add(ref)
                ref, current = target(current)

    def check_acyclic(self, root: Schema) -> None:
        graph = {"#": _refs_in(root)}
        for container, defs in self.defs.items():
            for name, schema in defs.items():
                graph[f"#/{container}/{_pointer_part(name)}"] = _refs_in(schema)
        state: dict[str, int] = {}  # 1: on the path, 2: done

        def visit(ref: str) -> None:
            state[ref] = 1
            for target in graph.get(ref, ()):
                if state.get(target) == 1:
                    raise self.reject(
                        target[1:],
                        "$ref",
                        f"recursive $ref {target!r} is not supported by the "
                        f"{self.support.backend} backend (it cuts recursion off into invalid "
                        "JSON); use the xgrammar backend",
                    )
                if target not in state:
                    visit(target)
            state[ref] = 2

        visit("#")

    # -- references -------------------------------------------------------------------------

    def local(self, ref: Any, path: str) -> str:
        """`ref` as a local JSON pointer ("#" or "#/..."): references to the schema's own
        `$id` count as local; anything else is refused."""
        base = self.root.get("$id") if isinstance(self.root, dict) else None
        if isinstance(ref, str) and isinstance(base, str) and base and ref.startswith(base):
            rest = ref[len(base) :]
            if rest in ("", "#") or rest.startswith("#/"):
                ref = rest or "#"
        if isinstance(ref, str) and ref.startswith("#") and ref != "#" and not ref.startswith("#/"):
            found = self.anchors().get(ref[1:])
            if found is not None:
                return found
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise self.reject(
                path,
                "$ref",
                f"$ref {ref!r} cannot be followed: references go inside the schema (#, "
                "#/$defs/..., any #/json/pointer, $anchor names) or to documents shipped "
                "beside it (GrammarOptions.schema_documents, the server's --json-schema-dir)",
            )
        return ref

    def anchors(self) -> dict[str, str]:
        """Plain-name fragments (`$anchor`, or a draft-6/7 `$id` of "#name") -> pointers."""
        if self._anchors is None:
            found: dict[str, str] = {}
            stack: list[tuple[Any, str]] = [(self.root, "#")]
            while stack:
                node, pointer = stack.pop()
                if isinstance(node, dict):
                    for key in ("$anchor", "$id"):
                        name = node.get(key)
                        if isinstance(name, str) and (key == "$anchor" or name.startswith("#")):
                            found.setdefault(name.lstrip("#"), pointer)
                    for key, value in node.items():
                        if key not in ("enum", "const", "default", "examples"):
                            stack.append((value, f"{pointer}/{_pointer_part(key)}"))
                elif isinstance(node, list):
                    stack.extend((v, f"{pointer}/{i}") for i, v in enumerate(node))
            self._anchors = found
        return self._anchors

    def resolve(self, ref: Any, path: str) -> Any:
        ref = self.local(self.ref_origins.get(ref, ref), path)
        node = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise self.reject(path, "$ref", f"$ref {ref!r} points to nothing")
        return node

    def note_ref(self, ref: str, path: str) -> str:
        """Queue the target of `ref` for normalization; the reference to write instead: a
        definition of the output's `$defs`/`definitions` (other pointers get one made)."""
        self.resolve(ref, path)
        ref = self.local(ref, path)
        if ref == "#":
            return ref
        if ref not in self.ref_names:
            container, _, rest = ref[2:].partition("/")
            if container in DEF_CONTAINERS and re.fullmatch(r"[A-Za-z0-9_.-]+", rest):
                self.ref_names[ref] = (container, rest)
            else:
                name = f"ref{len(self.ref_names)}_" + re.sub(r"[^A-Za-z0-9_]+", "_", ref[2:])
                self.ref_names[ref] = ("$defs", name[:80])
        self.pending.append(ref)
        container, name = self.ref_names[ref]
        written = f"#/{container}/{_pointer_part(name)}"
        self.ref_origins[written] = ref
        return written

    # -- one schema -------------------------------------------------------------------------

    def clean(self, schema: Any, path: str, depth: int) -> Schema:
        """Validation keywords only, older drafts' spellings translated; allOf/$ref kept."""
        if depth > self.max_depth:
            raise self.reject(
                path, None, f"nested deeper than this server accepts ({self.max_depth} levels)"
            )
        self.nodes += 1
        if self.nodes > self.support.max_nodes:
            raise self.too_many_nodes()
        if schema is True:
            return {}
        if schema is False:
            raise Unsatisfiable("false", "the schema `false` allows no value")
        if not isinstance(schema, dict):
            raise self.reject(
                path, None, f"a schema must be an object or a boolean, got {schema!r}"
            )
        out = {k: v for k, v in schema.items() if k in VALIDATION_KEYWORDS}
        if self.ref_hides_siblings and "$ref" in out:
            out = {"$ref": out["$ref"]}
        self.check_values(out, path)
        for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            # draft 4: a flag on minimum / maximum
            if isinstance(out.get(key), bool) and out.pop(key) and bound in out:
                out[key] = out.pop(bound)
        if isinstance(out.get("items"), list):  # draft 7 tuples
            out["prefixItems"] = out.pop("items")
            if "additionalItems" in out:
                out["items"] = out.pop("additionalItems")
        out.pop("additionalItems", None)
        if out.get("format") in FORMAT_PATTERNS:
            if "pattern" in out:
                if not self.relax:
                    raise self.reject(
                        path, "format", "format beside pattern is not supported; keep one of them"
                    )
                self.deferred.add("format")
                out.pop("format")
            else:
                out["pattern"] = FORMAT_PATTERNS[out.pop("format")]
        if "pattern" in out and self.support.ascii_shorthands:
            out["pattern"] = self.ascii_pattern(out["pattern"], path)
        if out.get("uniqueItems") is False:
            out.pop("uniqueItems")
        return out

    @staticmethod
    def close_unevaluated(schema: Schema) -> Schema:
        """`unevaluatedProperties` / `unevaluatedItems: false`, once `allOf` and `$ref` are
        merged in (and, beside `anyOf`, pushed into each branch), close the object or array:
        what the merged schema does not list is what nothing evaluated."""
        out = schema
        if out.get("unevaluatedProperties") is False:
            out = {k: v for k, v in out.items() if k != "unevaluatedProperties"}
            if out.get("additionalProperties", True) is True:
                out["additionalProperties"] = False
        if out.get("unevaluatedItems") is False:
            out = {k: v for k, v in out.items() if k != "unevaluatedItems"}
            if "items" not in out:
                out["items"] = False
        return out

    def check_values(self, schema: Schema, path: str) -> None:
        """The value of each keyword has the type JSON Schema gives it."""
        for key, value in schema.items():
            problem = None
            if key in _NUMBERS and (isinstance(value, bool) or not isinstance(value, (int, float))):
                if not (key.startswith("exclusive") and isinstance(value, bool)):
                    problem = "a number"
            elif key in _COUNTS and not (
                isinstance(value, int) and not isinstance(value, bool) and value >= 0
            ):
                problem = "a non-negative integer"
            elif key == "multipleOf" and value <= 0:
                problem = "a number above 0"
            elif key == "type":
                names = value if isinstance(value, list) else [value]
                if not names or not all(isinstance(n, str) and n in ALL_TYPES for n in names):
                    problem = f"one of {', '.join(sorted(ALL_TYPES))} (or a list of them)"
            elif key in ("pattern", "format", "$ref") and not isinstance(value, str):
                problem = "a string"
            elif key in ("properties", "patternProperties", "dependentRequired") and not isinstance(
                value, dict
            ):
                problem = "an object"
            elif key in ("enum", "allOf", "anyOf", "oneOf", "prefixItems") and not isinstance(
                value, list
            ):
                problem = "a list"
            elif key == "required" and not (
                isinstance(value, list) and all(isinstance(v, str) for v in value)
            ):
                problem = "a list of property names"
            if problem:
                raise self.reject(path, key, f"{key} must be {problem}, got {value!r}")

    def expand(self, schema: Schema, path: str, depth: int) -> Schema:
        """Merge allOf branches and a $ref with siblings into the schema itself."""
        parts: list[Any] = []
        if "$ref" in schema and len(schema) > 1:
            parts.append(self.resolve(schema["$ref"], path))
            schema = {k: v for k, v in schema.items() if k != "$ref"}
        if "allOf" in schema:
            branches = schema["allOf"]
            if not isinstance(branches, list) or not branches:
                raise self.reject(path, "allOf", "allOf must be a non-empty list of schemas")
            parts.extend(branches)
            schema = {k: v for k, v in schema.items() if k != "allOf"}
        for i, part in enumerate(parts):
            inlined = self.inline(part, f"{path}/allOf/{i}", depth + 1)
            schema = self.intersect(schema, inlined, path, "allOf (or $ref with siblings)")
        return schema

    def intersect(self, schema: Schema, other: Schema, path: str, where: str) -> Schema:
        """`merge(schema, other)`; relaxed, a keyword both give different values that cannot
        be written as one (two `pattern`s) keeps `schema`'s value in the grammar and is
        deferred: validation checks the value against the original schema, both sides."""
        while True:
            try:
                return merge(schema, other)
            except CannotMerge as error:
                if not self.relax or error.keyword not in other:
                    raise self.reject(path, error.keyword, f"{where}: {error.reason}") from None
                self.deferred.add(error.keyword)
                other = {k: v for k, v in other.items() if k != error.keyword}

    def inline(self, schema: Any, path: str, depth: int) -> Schema:
        """A subschema with its own $ref / allOf resolved at the top (not deeper)."""
        cleaned = self.expand(self.clean(schema, path, depth), path, depth)
        if set(cleaned) == {"$ref"}:
            return self.inline(self.resolve(cleaned["$ref"], path), path, depth + 1)
        return cleaned

    def node(self, schema: Any, path: str, depth: int) -> Schema:
        cleaned = self.expand(self.clean(schema, path, depth), path, depth)
        if "$ref" in cleaned:
            if self.local(cleaned["$ref"], path) in self.unsatisfiable:
                target = cleaned["$ref"]
                raise Unsatisfiable("$ref", f"the schema {target!r} points to allows no value")
            return {"$ref": self.note_ref(cleaned["$ref"], path)}
        if "anyOf" not in cleaned and "oneOf" not in cleaned:
            cleaned = self.close_unevaluated(cleaned)
        cleaned = self.check_keywords(cleaned, path)
        if "anyOf" in cleaned or "oneOf" in cleaned:
            return self.combinator(cleaned, path, depth)
        out = self.simplify(cleaned, path, depth)
        if not out and self.support.any_value is not None:
            return copy.deepcopy(self.support.any_value)
        return out

    def ascii_pattern(self, pattern: Any, path: str) -> str:
        """JSON Schema's \\d, \\w (ASCII) spelled out for a regex engine that reads them as
        Unicode classes."""
        if not isinstance(pattern, str):
            raise self.reject(path, "pattern", "pattern must be a string")
        inside = {"d": "0-9", "w": "A-Za-z0-9_"}
        outside = {"d": "[0-9]", "w": "[A-Za-z0-9_]", "D": "[^0-9]", "W": "[^A-Za-z0-9_]"}
        out: list[str] = []
        in_class = False
        i = 0
        while i < len(pattern):
            char = pattern[i]
            if char == "\\" and i + 1 < len(pattern):
                escaped = pattern[i + 1]
                if in_class and escaped in inside:
                    out.append(inside[escaped])
                elif in_class and escaped in ("D", "W"):
                    raise self.reject(
                        path, "pattern", f"\\{escaped} inside a character class is not supported"
                    )
                elif not in_class and escaped in outside:
                    out.append(outside[escaped])
                else:
                    out.append(pattern[i : i + 2])
                i += 2
                continue
            if char == "[" and not in_class:
                in_class = True
            elif char == "]" and in_class:
                in_class = False
            out.append(char)
            i += 1
        return "".join(out)

    def check_keywords(self, schema: Schema, path: str) -> Schema:
        """The schema with only keywords the backend enforces: others are refused by name, or
        (relaxed) dropped and deferred to validation."""
        support = self.support
        out = schema
        if self.relax:
            out = self.rewrite(schema, path)
            if isinstance(out.get("pattern"), str) and _NON_REGULAR.search(out["pattern"]):
                out = self.defer(out, "pattern")
        for key in list(out):
            if key not in support.keywords:
                if not self.relax:
                    raise self.unsupported(path, key)
                out = self.defer(out, key)
        if "format" in out and out["format"] not in support.formats:
            if not self.relax:
                known = ", ".join(sorted(support.formats))
                raise self.reject(
                    path,
                    "format",
                    f"format {out['format']!r} is not enforced by the {support.backend} "
                    f"backend (it enforces: {known}); remove it or use a pattern",
                )
            name = out["format"]
            if isinstance(name, str) and name in checked_formats():
                self.deferred.add("format")
            else:
                self.annotations.add(str(name))
            out = {k: v for k, v in out.items() if k != "format"}
        if "multipleOf" in out:
            step = out["multipleOf"]
            kinds = type_set({"type": out.get("type", "number")})
            if not (isinstance(step, int) and kinds == frozenset({"integer"})):
                if not self.relax:
                    raise self.unsupported(path, "multipleOf", " on non-integer numbers")
                out = self.defer(out, "multipleOf")
        if "pattern" in out or "format" in out:
            for key in ("minLength", "maxLength"):
                if key in out and "enum" not in out and "const" not in out:
                    if not self.relax:
                        raise self.unsupported(
                            path,
                            key,
                            " beside 'pattern' or 'format' (fold the length into the pattern)",
                        )
                    out = self.defer(out, key)
        return out

    def defer(self, schema: Schema, key: str) -> Schema:
        """`schema` without `key` (a superset of it), the keyword left to validation. Without
        its patternProperties, an object's additionalProperties would also govern the names
        the patterns matched, which narrows it: that goes too."""
        self.deferred.add(key)
        drop = {key}
        if key == "patternProperties" and schema.get("additionalProperties", True) is not True:
            drop.add("additionalProperties")
        out = {k: v for k, v in schema.items() if k not in drop}
        listed = schema.get("properties")
        count = len(listed) if isinstance(listed, dict) else 0
        if key == "minProperties" and schema[key] > count and "additionalProperties" not in out:
            out["additionalProperties"] = {}  # backends close objects; these need more members
        return out

    def rewrite(self, schema: Schema, path: str) -> Schema:
        """Forms of keywords the backend lacks that can be compiled exactly (see
        `_schema_rewrite`); the rest is left for `check_keywords`."""
        return rewrite_for_grammar(schema, self.support, path)

    # -- anyOf / oneOf ----------------------------------------------------------------------

    def combinator(self, schema: Schema, path: str, depth: int) -> Schema:
        if "anyOf" in schema and "oneOf" in schema:
            if not self.relax:
                raise self.reject(
                    path, "oneOf", "anyOf beside oneOf is not supported; nest one in the other"
                )
            schema = self.defer(schema, "oneOf")
        key = "anyOf" if "anyOf" in schema else "oneOf"
        branches = schema[key]
        if not isinstance(branches, list) or not branches:
            raise self.reject(path, key, f"{key} must be a non-empty list of schemas")
        siblings = {k: v for k, v in schema.items() if k != key}
        names = ", ".join(sorted(siblings))
        kept: list[Schema] = []
        resolved: list[Schema] = []
        for i, branch in enumerate(branches):
            where = f"{path}/{key}/{i}"
            try:
                if siblings:
                    inlined = self.inline(branch, where, depth + 1)
                    merged = self.intersect(siblings, inlined, where, f"{key} beside {names}")
                    out = self.node(merged, where, depth + 1)
                else:
                    out = self.node(branch, where, depth + 1)
            except Unsatisfiable:
                continue  # the branch contradicts its siblings: no value can take it
            except CannotMerge as error:
                raise self.reject(where, error.keyword, error.reason) from None
            kept.append(out)
            resolved.append(self.inline(out, where, depth + 1) if "$ref" in out else out)
        if not kept:
            raise Unsatisfiable(key, f"no branch of {key} at {path or '/'} can hold")
        if key == "oneOf":
            for i in range(len(resolved)):
                for j in range(i + 1, len(resolved)):
                    if not provably_disjoint(resolved[i], resolved[j], self.resolve_loose):
                        if self.relax:  # anyOf in the grammar; "exactly one" by validation
                            self.deferred.add("oneOf")
                            return {"anyOf": kept}
                        raise self.reject(
                            path,
                            "oneOf",
                            f"oneOf branches {i} and {j} may both match a value, which oneOf "
                            "forbids and the backend cannot enforce; use anyOf, or make the "
                            "branches disjoint (different types, or a required property with "
                            "different const values)",
                        )
        return kept[0] if len(kept) == 1 else {"anyOf": kept}

    def resolve_loose(self, schema: Any) -> Schema:
        if isinstance(schema, dict) and set(schema) == {"$ref"}:
            try:
                target = self.resolve(schema["$ref"], "")
            except GrammarError:
                return {}
            return target if isinstance(target, dict) else {}
        return schema if isinstance(schema, dict) else {}

    # -- plain schemas ----------------------------------------------------------------------

    def simplify(self, schema: Schema, path: str, depth: int) -> Schema:
        out = dict(schema)
        kinds = type_set({"type": out["type"]}) if "type" in out else None
        if kinds == frozenset({"integer"}):
            self.round_integer_bounds(out)
        for low, high in (
            ("minimum", "maximum"),
            ("minLength", "maxLength"),
            ("minItems", "maxItems"),
            ("minProperties", "maxProperties"),
        ):
            if low in out and high in out and out[low] > out[high]:
                raise Unsatisfiable(low, f"{low} {out[low]} is above {high} {out[high]}")
        if "const" in out or "enum" in out:
            return self.filter_values(out, path)
        if kinds is None or "object" in kinds:
            self.object_members(out, path, depth)
            if kinds == frozenset({"object"}) and self.support.any_value is not None:
                self.spell_out_object(out)
        else:
            for key in ("properties", "required", "additionalProperties"):
                out.pop(key, None)
        if kinds is None or "array" in kinds:
            self.array_members(out, path, depth)
        lengths = "minLength" in out or "maxLength" in out
        if self.relax and self.support.length_as_pattern and lengths:
            # A length as a pattern unrolls into as many automaton states: long ones compile
            # for many seconds, so they are checked by validation instead.
            for key in ("minLength", "maxLength"):
                if out.get(key, 0) > _LONGEST_LENGTH_PATTERN:
                    out = self.defer(out, key)
            lengths = "minLength" in out or "maxLength" in out
        if self.support.length_as_pattern and lengths and not {"pattern", "format"} & set(out):
            low, high = out.pop("minLength", 0), out.pop("maxLength", "")
            out["pattern"] = f"^.{{{low},{high}}}$"
        return out

    @staticmethod
    def round_integer_bounds(out: Schema) -> None:
        if "exclusiveMinimum" in out:
            low = math.floor(out.pop("exclusiveMinimum")) + 1
            out["minimum"] = max(low, out.get("minimum", low))
        if "exclusiveMaximum" in out:
            high = math.ceil(out.pop("exclusiveMaximum")) - 1
            out["maximum"] = min(high, out.get("maximum", high))
        if "minimum" in out:
            out["minimum"] = math.ceil(out["minimum"])
        if "maximum" in out:
            out["maximum"] = math.floor(out["maximum"])

    def filter_values(self, schema: Schema, path: str) -> Schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values:
            raise self.reject(path, "enum", "enum must be a non-empty list")
        rest = {k: v for k, v in schema.items() if k not in ("const", "enum")}
        if not rest:
            return {"const": values[0]} if len(values) == 1 else {"enum": values}
        kept = []
        for value in values:
            verdict = value_satisfies(value, rest)
            if verdict is None and self.relax:
                self.deferred.update(rest)
                verdict = True
            if verdict is None:
                names = ", ".join(sorted(rest))
                raise self.reject(
                    path,
                    "enum",
                    f"enum/const beside {names} cannot be checked for value {value!r}; "
                    "list only values that meet those keywords and drop the keywords",
                )
            if verdict:
                kept.append(value)
        if not kept:
            raise Unsatisfiable("enum", "no enum/const value meets the keywords beside it")
        return {"const": kept[0]} if len(kept) == 1 else {"enum": kept}

    def object_members(self, out: Schema, path: str, depth: int) -> None:
        required = out.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise self.reject(path, "required", "required must be a list of property names")
        props = dict(out.get("properties", {}))
        extra = out.get("additionalProperties", True)
        patterns = out.get("patternProperties")
        if isinstance(patterns, dict) and self.relax:
            # Regex dialects differ on which names a pattern matches (\\w on non-ASCII names,
            # for one), and jsonschema's is Python's: the grammar enforces the patterns as it
            # reads them, validation makes sure of the names.
            self.deferred.add("patternProperties")
        if isinstance(patterns, dict):
            out["patternProperties"] = {
                pattern: self.node(
                    sub, f"{path}/patternProperties/{_pointer_part(pattern)}", depth + 1
                )
                for pattern, sub in patterns.items()
            }
        for name in required:
            if name not in props and isinstance(patterns, dict) and _matches_any(name, patterns):
                props[name] = {}  # its patternProperties schemas apply to it as well
            elif name not in props:
                if extra is False:
                    raise Unsatisfiable(
                        "required",
                        f"required property {name!r} is not allowed by additionalProperties: false",
                    )
                props[name] = {} if extra is True else extra
        for name in list(props):
            where = f"{path}/properties/{_pointer_part(name)}"
            try:
                props[name] = self.node(props[name], where, depth + 1)
            except Unsatisfiable as error:
                if name in required:
                    raise Unsatisfiable(
                        error.keyword, f"required property {name!r}: {error.reason}"
                    ) from None
                del props[name]  # the property can never appear
        if props or "properties" in out:
            out["properties"] = props
        if extra is True and out.get("minProperties", 0) > len(props) and not patterns:
            # Backends close objects by default; these need other members to exist.
            extra = out["additionalProperties"] = {}
        if isinstance(extra, dict):
            out["additionalProperties"] = self.node(
                extra, f"{path}/additionalProperties", depth + 1
            )
        if isinstance(out.get("unevaluatedProperties"), dict):
            out["unevaluatedProperties"] = self.node(
                out["unevaluatedProperties"], f"{path}/unevaluatedProperties", depth + 1
            )

    def spell_out_object(self, out: Schema) -> None:
        """For a backend with `any_value`: a free-form object gets values of `any_value` (its
        own free-form objects nest deep and take minutes to build), a closed one lists its
        (possibly no) properties."""
        extra = out.get("additionalProperties", True)
        if extra is False:
            out.pop("additionalProperties")
            out.setdefault("properties", {})
        elif "properties" not in out and (extra is True or extra == {}):
            out["additionalProperties"] = copy.deepcopy(self.support.any_value)

    def array_members(self, out: Schema, path: str, depth: int) -> None:
        if "prefixItems" in out:
            prefix = out["prefixItems"]
            if not isinstance(prefix, list):
                raise self.reject(path, "prefixItems", "prefixItems must be a list of schemas")
            out["prefixItems"] = [
                self.node(item, f"{path}/prefixItems/{i}", depth + 1)
                for i, item in enumerate(prefix)
            ]
        items = out.get("items")
        if items is None and out.get("minItems", 0) > len(out.get("prefixItems", [])):
            items = {}  # backends close arrays without `items`; these need items to exist
        if items is False or items is None:
            return
        try:
            out["items"] = self.node(items, f"{path}/items", depth + 1)
        except Unsatisfiable:
            if out.get("minItems", 0) > len(out.get("prefixItems", [])):
                raise
            out["items"] = False


def _matches_any(name: str, patterns: dict[str, Any]) -> bool:
    for pattern in patterns:
        try:
            if re.search(pattern, name):
                return True
        except re.error:
            return True  # the backend's regex dialect decides; assume it may match
    return False


def _refs_in(node: Any) -> set[str]:
    found: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("$ref"), str):
                found.add(item["$ref"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found
