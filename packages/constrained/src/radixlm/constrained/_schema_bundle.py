"""Bundling: the documents a schema refers to, copied into it, and every `$ref` made local.

Grammar backends follow only local references (`#/$defs/...`). A schema may refer to other
documents: ones shipped beside it (`GrammarOptions.schema_documents`, see `_schema_documents`),
resources embedded in it with their own `$id` (a compound document), the JSON Schema
metaschemas (OpenAPI's schema objects reuse draft-04's). Inside each of those, `#/...` and
relative references are relative to *its* base URI. Every `$ref` is resolved here with
`referencing`, in the registry validation uses and from the base URI jsonschema would use
there, and rewritten to a pointer into the bundle: a document referred to is copied once under
`$defs` (so a recursive reference across documents becomes a recursive local one), a resource
embedded in the schema is pointed to where it sits. The `$id`s that would move the base URI
are left out of the bundle, so jsonschema reads it as one resource, as the grammar does.

A reference that does not resolve is written as the absolute URI it names; if anything can
reach it (from the root through schema keywords and references; unused definitions do not
count), the schema is refused with a `GrammarError` naming it and saying how to ship the
document. Nothing is ever fetched over the network.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import referencing
import referencing.exceptions

from radixlm.constrained._schema_documents import (
    root_base_uri,
    root_specification,
    schema_registry,
)
from radixlm.constrained.errors import GrammarError

_NOT_SCHEMAS = ("enum", "const", "default", "examples")
# Keywords whose value maps names to schemas (the names may be anything, "enum" included).
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Where an applicator holds subschemas (every draft): a schema, a list of them, or a map.
_SUBSCHEMAS = frozenset(
    {"allOf", "anyOf", "oneOf", "prefixItems", "items", "not", "if", "then", "else",
     "contains", "additionalItems", "additionalProperties", "unevaluatedProperties",
     "unevaluatedItems", "propertyNames", "contentSchema", "extends"}
)  # fmt: skip
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "dependentSchemas", "dependencies"})
# References resolved along the dynamic scope: they need the documents' own boundaries.
_DYNAMIC = frozenset({"$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor"})


@dataclass(frozen=True, slots=True)
class BundledSchema:
    """`schema`: the schema with every `$ref` local (what the normalizer reads);
    `validation`: what completed values are validated against (the bundle, or the original
    where `$dynamicRef`s need the documents' own boundaries); `registry`: where the references
    of `validation` resolve (pass it to jsonschema)."""

    schema: Any
    validation: Any
    registry: Any


def bundle_schema(schema: Any, documents: Mapping[str, Any] | None = None) -> BundledSchema:
    """`schema` bundled with the documents it refers to (see module doc); `schema` itself when
    every reference in it is already local. Raises `GrammarError` for a reference that cannot
    be resolved and that a value could reach."""
    if not isinstance(schema, dict) or not _needs_bundling(schema):
        # jsonschema adds the metaschemas and the schema itself; nothing else is needed, and
        # a registry of its own keeps it from fetching anything.
        return BundledSchema(schema, schema, referencing.Registry())
    registry = schema_registry(schema, documents or {})
    if not isinstance(schema.get("$defs", {}), dict):
        return BundledSchema(schema, schema, registry)  # the normalizer names the problem
    try:
        bundled = _Bundler(schema, registry).run()
    except RecursionError:
        raise GrammarError(
            "the JSON schema is nested too deeply to parse", kind="json_schema"
        ) from None
    validation = schema if _mentions(bundled, _DYNAMIC) else bundled
    return BundledSchema(bundled, validation, registry)


@dataclass
class _Copy:
    """One resource written into the bundle: the schema itself (`name` None) or a document
    (or embedded resource) copied under `$defs/<name>`, walked from base URI `base`."""

    resource: Any
    base: str
    prefix: str
    name: str | None
    rewrites: dict[int, str] = field(default_factory=dict)  # id(node) -> its local $ref
    strip: set[int] = field(default_factory=set)  # id(node) of nodes whose $id is left out


class _Bundler:
    def __init__(self, root: dict[str, Any], registry: Any) -> None:
        self.root = root
        self.registry = registry
        self.base = root_base_uri(root)
        resource = root_specification(root).create_resource(root)
        self.copies = [_Copy(resource, self.base, "", None)]
        # (id(node), base URI there) -> where the node sits in the bundle
        self.placed: dict[tuple[int, str], str] = {(id(root), self.base): ""}
        self.pointers: dict[int, dict[int, str]] = {}
        self.taken = set(root.get("$defs", {}))
        self.unresolved: dict[str, str] = {}  # written reference -> why it does not resolve
        declared = root.get("$schema", "")
        self.ref_hides_siblings = isinstance(declared, str) and bool(
            re.search(r"draft-0[3-7]/", declared)
        )

    def run(self) -> dict[str, Any]:
        index = 0
        while index < len(self.copies):  # references add the documents they find
            self.walk(self.copies[index])
            index += 1
        out: dict[str, Any] = _rebuild(self.root, self.copies[0])
        if len(self.copies) > 1:
            defs = dict(out.get("$defs", {}))
            for copy in self.copies[1:]:
                defs[str(copy.name)] = _rebuild(copy.resource.contents, copy)
            out["$defs"] = defs
        if self.unresolved:
            self.check_reachable(out)
        return out

    def walk(self, copy: _Copy) -> None:
        """Place every subschema of `copy` (first, so references into it find it), then make
        each of its references local."""
        top = copy.resource.contents
        pointers = self.pointers_in(top)
        nodes: list[tuple[dict[str, Any], str]] = []
        stack: list[tuple[Any, str]] = [(copy.resource, copy.base)]
        while stack:
            resource, base = stack.pop()
            node = resource.contents
            if not isinstance(node, dict):
                continue
            nodes.append((node, base))
            self.placed.setdefault((id(node), base), copy.prefix + pointers[id(node)])
            if resource.id() is not None and (node is not top or copy.name is not None):
                copy.strip.add(id(node))
            for sub in resource.subresources():
                own = sub.id()
                stack.append((sub, base if own is None else urllib.parse.urljoin(base, own)))
        for node, base in nodes:
            ref = node.get("$ref")
            if not isinstance(ref, str):
                continue
            if copy.name is None and base == self.base and (ref == "#" or ref.startswith("#/")):
                continue  # a pointer into the schema itself: already local
            copy.rewrites[id(node)] = self.local(ref, base)

    def local(self, ref: str, base: str) -> str:
        """`ref`, met where the base URI is `base`, as a pointer into the bundle (the
        absolute URI it names when it does not resolve)."""
        absolute = urllib.parse.urljoin(base, ref)
        uri, fragment = urllib.parse.urldefrag(absolute)
        try:
            resolved = self.registry.resolver(base).lookup(ref)
            resource = self.registry[uri]
        except (referencing.exceptions.Unresolvable, LookupError, ValueError):
            self.unresolved.setdefault(absolute, self.why(ref, uri))
            return absolute
        prefix = self.place(resource, uri)
        document, target = resource.contents, resolved.contents
        if target is document:
            return "#" + prefix
        inner = self.pointers_in(document).get(id(target)) if isinstance(target, dict) else None
        if inner is None and fragment.startswith("/"):
            inner = fragment  # a boolean schema or an array item: the pointer finds it
        if inner is None:  # pragma: no cover - an anchor always names an object
            self.unresolved.setdefault(absolute, self.why(ref, uri))
            return absolute
        return "#" + prefix + inner

    def place(self, resource: Any, uri: str) -> str:
        """Where the resource at `uri` sits in the bundle (copied there on first use)."""
        key = (id(resource.contents), uri)
        found = self.placed.get(key)
        if found is None:
            name = self.fresh_name(uri)
            found = self.placed[key] = "/$defs/" + _pointer_part(name)
            self.copies.append(_Copy(resource, uri, found, name))
        return found

    def fresh_name(self, uri: str) -> str:
        """A definition name for the copy of `uri`: its last path segment (`address.json`),
        numbered when taken."""
        path = urllib.parse.urlsplit(uri).path.rstrip("/")
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", path.rsplit("/", 1)[-1]).strip("._-")
        stem = stem or "document"
        name, count = stem, 1
        while name in self.taken:
            count += 1
            name = f"{stem}-{count}"
        self.taken.add(name)
        return name

    def pointers_in(self, document: Any) -> dict[int, str]:
        """id(object) -> JSON pointer inside `document`, for each object in it."""
        found = self.pointers.get(id(document))
        if found is None:
            found = self.pointers[id(document)] = {}
            stack: list[tuple[Any, str]] = [(document, "")]
            while stack:
                node, pointer = stack.pop()
                if isinstance(node, dict):
                    found.setdefault(id(node), pointer)
                    stack.extend((v, f"{pointer}/{_pointer_part(k)}") for k, v in node.items())
                elif isinstance(node, list):
                    stack.extend((v, f"{pointer}/{i}") for i, v in enumerate(node))
        return found

    def why(self, ref: str, uri: str) -> str:
        try:
            self.registry[uri]
        except LookupError:
            name = _relative_name(uri, self.base)
            if name is not None:
                where = (
                    f"in GrammarOptions.schema_documents under {name!r} (or its URI), or as "
                    f"{name!r} in the server's --json-schema-dir directory"
                )
            else:
                where = (
                    f"in GrammarOptions.schema_documents under {uri!r}, or as a *.json file "
                    "with that $id in the server's --json-schema-dir directory"
                )
            return (
                f"$ref {ref!r} refers to a document that was not shipped with the schema "
                f"(nothing is fetched over the network); ship it {where}"
            )
        document = "the schema" if uri == self.base else f"the document {uri!r}"
        return f"$ref {ref!r} points to nothing in {document}"

    def check_reachable(self, bundle: dict[str, Any]) -> None:
        """Refuse an unresolved reference that a value could meet (validation would stop
        there): one reached from the root through subschemas and references."""
        seen: set[int] = set()
        stack: list[tuple[Any, str]] = [(bundle, "")]
        while stack:
            node, path = stack.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            ref = node.get("$ref")
            if isinstance(ref, str):
                if ref in self.unresolved:
                    raise GrammarError(
                        f"JSON schema at {path or '/'}: {self.unresolved[ref]}",
                        kind="json_schema",
                        keyword="$ref",
                        path=path or "/",
                    )
                target = _follow(bundle, ref)
                if target is not None:
                    stack.append((target, ref[1:]))
                if self.ref_hides_siblings:
                    continue
            for key, value in node.items():
                where = f"{path}/{_pointer_part(key)}"
                if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
                    stack.extend((v, f"{where}/{_pointer_part(k)}") for k, v in value.items())
                elif key in _SUBSCHEMAS and isinstance(value, list):
                    stack.extend((v, f"{where}/{i}") for i, v in enumerate(value))
                elif key in _SUBSCHEMAS:
                    stack.append((value, where))


def _rebuild(node: Any, copy: _Copy) -> Any:
    """A copy of `node` with `copy`'s references rewritten and its `$id`s left out."""
    if isinstance(node, dict):
        strip = id(node) in copy.strip
        out = {
            k: _rebuild(v, copy)
            for k, v in node.items()
            if not (strip and k in ("$id", "id") and isinstance(v, str))
        }
        ref = copy.rewrites.get(id(node))
        if ref is not None:
            out["$ref"] = ref
        return out
    if isinstance(node, list):
        return [_rebuild(v, copy) for v in node]
    return node


def _follow(document: Any, ref: str) -> Any:
    """The target of a local JSON pointer reference, or None."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node = document
    for part in ref[2:].split("/") if ref != "#" else []:
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _relative_name(uri: str, base: str) -> str | None:
    """`uri` as a name relative to the schema's base URI (`address.json`), or None."""
    if not urllib.parse.urlsplit(uri).scheme:
        return uri
    directory = urllib.parse.urljoin(base, ".") if base else ""
    if directory.endswith("/") and uri.startswith(directory) and len(uri) > len(directory):
        return uri[len(directory) :]
    return None


def _pointer_part(name: str) -> str:
    """`name` as one JSON pointer segment (escaped, and `%` encoded: readers decode it)."""
    return name.replace("~", "~0").replace("/", "~1").replace("%", "%25")


def _needs_bundling(schema: dict[str, Any]) -> bool:
    """Whether a reference may leave the schema's own scope: one that is not a `#` fragment, or
    a subschema with an `$id` of its own (references inside it are relative to that)."""
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, is_map = stack.pop()
        if isinstance(node, list):
            stack.extend((item, False) for item in node)
        elif isinstance(node, dict) and is_map:
            stack.extend((value, False) for value in node.values())
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return True
            if node is not schema:
                for key in ("$id", "id"):
                    value = node.get(key)
                    if isinstance(value, str) and value and not value.startswith("#"):
                        return True
            stack.extend((v, k in _MAPS) for k, v in node.items() if k not in _NOT_SCHEMAS)
    return False


def _mentions(schema: Any, keys: frozenset[str]) -> bool:
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if keys & node.keys():
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False
