"""Documents shipped beside a JSON schema, and the registry its `$ref`s resolve in (offline).

A schema may refer to other documents (`{"$ref": "address.json"}`, `https://.../person.json#/$defs/name`).
Nothing is fetched over the network: the documents come with the server
(`GrammarOptions.schema_documents`, `radixlm serve --json-schema-dir DIR`), and the registry
built here — the same one for the grammar (`_schema_bundle`) and for validation — holds them
beside the JSON Schema metaschemas.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


def load_schema_documents(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Every `*.json` file under `directory` (subdirectories included), parsed, keyed by its
    path relative to `directory` with `/` separators (`address.json`, `common/name.json`).

    A relative key names the document beside the schema that refers to it: `{"$ref":
    "address.json"}` finds `address.json` (see `schema_registry`). Raises ValueError naming the
    directory when it is not one, or a file that is not JSON or not a schema."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"the JSON schema directory {str(root)!r} is not a directory")
    documents: dict[str, Any] = {}
    for path in sorted(root.rglob("*.json")):
        if not path.is_file():
            continue
        name = path.relative_to(root).as_posix()
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
            raise ValueError(
                f"the JSON schema document {str(path)!r} cannot be read: {error}"
            ) from None
        documents[name] = document
    return dict(check_schema_documents(documents))


class SchemaDocuments(Mapping[str, Any]):
    """Shipped documents, URI or relative name -> schema: read-only, compared by value,
    picklable; its repr lists the names only."""

    def __init__(self, documents: Mapping[str, Any] | None = None) -> None:
        self._documents = dict(documents or {})

    def __getitem__(self, key: str) -> Any:
        return self._documents[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._documents)

    def __len__(self) -> int:
        return len(self._documents)

    def __repr__(self) -> str:
        return f"SchemaDocuments({sorted(self._documents)!r})"


def check_schema_documents(documents: Mapping[str, Any]) -> SchemaDocuments:
    """`documents` (URI or relative name -> schema) checked and frozen: deep copies, so later
    changes to the caller's objects cannot change compiled grammars. Raises ValueError naming
    the entry at fault."""
    if not isinstance(documents, Mapping):
        raise ValueError(
            "schema_documents must map URIs (or names relative to the schema) to JSON schemas"
        )
    checked: dict[str, Any] = {}
    for uri, document in documents.items():
        if not isinstance(uri, str) or not uri.strip("#"):
            raise ValueError(f"schema_documents: {uri!r} is not a URI or a document name")
        if urllib.parse.urldefrag(uri)[1]:
            raise ValueError(
                f"schema_documents: {uri!r} has a fragment; key each document by its URI alone"
            )
        if not isinstance(document, (dict, bool)):
            raise ValueError(
                f"schema_documents[{uri!r}] must be a JSON schema (an object or a boolean), "
                f"got {type(document).__name__}"
            )
        try:
            checked[urllib.parse.urldefrag(uri)[0]] = json.loads(json.dumps(document))
        except (TypeError, ValueError, RecursionError) as error:
            raise ValueError(f"schema_documents[{uri!r}] is not JSON: {error}") from None
    return SchemaDocuments(checked)


def root_specification(schema: Any) -> Any:
    """The JSON Schema dialect of `schema` (its `$schema`, else 2020-12, as jsonschema picks)."""
    import referencing.jsonschema

    declared = schema.get("$schema") if isinstance(schema, dict) else None
    return referencing.jsonschema.specification_with(
        declared if isinstance(declared, str) else "",
        default=referencing.jsonschema.DRAFT202012,
    )


def root_base_uri(schema: Any) -> str:
    """The base URI of a root schema: its `$id`, else the empty URI (jsonschema's choice, so a
    relative `$ref` such as `address.json` is looked up as `address.json`)."""
    return root_specification(schema).create_resource(schema).id() or ""


def schema_registry(schema: Any, documents: Mapping[str, Any] | None = None) -> Any:
    """The registry the `$ref`s of `schema` resolve in, for the grammar and for validation:

    - the JSON Schema metaschemas (draft 3 to 2020-12, as `jsonschema-specifications` ships);
    - `schema` itself, under its base URI (`root_base_uri`), and every resource embedded in it
      with its own `$id` (a compound document);
    - each of `documents`, under its key resolved against the schema's base URI (a relative
      key such as `address.json` sits beside the schema; an absolute one stays as it is), under
      its own `$id`, and each resource embedded in it under its `$id`.

    Pass it to jsonschema (`Draft202012Validator(schema, registry=...)`) to validate as the
    grammar does. Nothing is retrieved: a URI it does not hold is unresolvable.
    """
    import referencing
    from jsonschema_specifications import REGISTRY as METASCHEMAS

    specification = root_specification(schema)
    base = root_base_uri(schema)
    resources = [
        (
            urllib.parse.urljoin(base, uri),
            referencing.Resource.from_contents(document, default_specification=specification),
        )
        for uri, document in (documents or {}).items()
    ]
    resources.append((base, specification.create_resource(schema)))  # the schema wins its URI
    own = referencing.Registry().with_resources(resources)
    return METASCHEMAS.combine(own).crawl()
