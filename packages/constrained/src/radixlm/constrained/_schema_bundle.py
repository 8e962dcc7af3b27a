"""Bundling: the JSON Schema metaschemas a schema refers to, copied into it as definitions.

Real schemas refer to documents of their own kind (OpenAPI's schema objects reuse draft-04's
`http://json-schema.org/draft-04/schema#/properties/multipleOf`; the 2020-12 metaschema is
`allOf` its vocabularies, `meta/core` and friends). A request cannot carry other documents, but
these ones are well known: jsonschema ships them (`jsonschema-specifications`). Each document
referred to is copied under `$defs` and every reference rewritten to a local pointer, so the
normalizer sees one self-contained schema. Validation keeps using the original schema (the
validator resolves the same documents from the same registry). References to any other
document are left alone (the normalizer refuses them by name).
"""

from __future__ import annotations

import copy
import urllib.parse
from typing import Any

_NOT_SCHEMAS = ("enum", "const", "default", "examples")
# Keywords whose value maps names to schemas (the names may be anything, "enum" included).
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bundle_known_documents(schema: Any) -> Any:
    """`schema` with the known documents it refers to inlined (a copy), or `schema` itself
    when it refers to none."""
    if not isinstance(schema, dict) or not _has_remote_ref(schema):
        return schema
    try:
        from jsonschema_specifications import REGISTRY
    except ImportError:  # pragma: no cover - comes with jsonschema
        return schema
    out = copy.deepcopy(schema)
    root_base = _base(out, "")
    defs = out.setdefault("$defs", {}) if isinstance(out.get("$defs", {}), dict) else None
    if defs is None:
        return schema
    embedded: dict[str, str] = {}  # document URI -> pointer of its copy
    pending: list[tuple[Any, str, str]] = [(out, root_base, "")]

    def local(uri: str, fragment: str) -> str | None:
        if uri in ("", root_base):
            return "#" + fragment
        if uri not in embedded:
            try:
                contents = REGISTRY.contents(uri)
            except Exception:
                return None
            name = f"bundled{len(embedded)}"
            defs[name] = copy.deepcopy(contents)
            embedded[uri] = f"/$defs/{name}"
            pending.append((defs[name], uri, embedded[uri]))
        return "#" + embedded[uri] + fragment

    while pending:
        document, base, prefix = pending.pop()
        stack: list[tuple[Any, str, bool]] = [(document, base, False)]
        while stack:
            node, here, is_map = stack.pop()
            if isinstance(node, list):
                stack.extend((item, here, False) for item in node)
                continue
            if not isinstance(node, dict):
                continue
            if is_map:
                stack.extend((value, here, False) for value in node.values())
                continue
            if node is not document:
                here = _base(node, here)
            ref = node.get("$ref")
            if isinstance(ref, str):
                if ref.startswith("#/") or ref == "#":
                    if prefix:
                        node["$ref"] = "#" + prefix + ref[1:]
                elif not ref.startswith("#"):
                    uri, fragment = urllib.parse.urldefrag(urllib.parse.urljoin(here, ref))
                    rewritten = local(uri, fragment)
                    if rewritten is not None:
                        node["$ref"] = rewritten
            for key, value in node.items():
                if key not in _NOT_SCHEMAS:
                    stack.append((value, here, key in _MAPS))
    return out


def _base(node: dict[str, Any], base: str) -> str:
    """The base URI inside `node`: its `$id` (draft 4: `id`) resolved against `base`."""
    for key in ("$id", "id"):
        value = node.get(key)
        if isinstance(value, str) and value and not value.startswith("#"):
            return urllib.parse.urldefrag(urllib.parse.urljoin(base, value))[0]
    return base


def _has_remote_ref(schema: Any) -> bool:
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, is_map = stack.pop()
        if isinstance(node, dict) and is_map:
            stack.extend((value, False) for value in node.values())
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return True
            stack.extend((v, k in _MAPS) for k, v in node.items() if k not in _NOT_SCHEMAS)
        elif isinstance(node, list):
            stack.extend((item, False) for item in node)
    return False
