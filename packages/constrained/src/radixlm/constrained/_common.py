"""Helpers the backends share: error text cleanup, literal escaping, structural-tag preparation."""

from __future__ import annotations

import json
import re
from typing import Any

from radixlm.constrained._schema import prepare_json_schema
from radixlm.constrained._schema_support import SchemaSupport
from radixlm.constrained.errors import GrammarError
from radixlm.constrained.options import GrammarOptions
from radixlm.constrained.spec import GrammarSpec

# "[12:45:13] /project/cpp/json_schema_converter.cc:5082: " in front of C++ messages.
_LOG_PREFIX = re.compile(r"^\s*(\[[0-9:]+\]\s*)?(/\S+:\d+:\s*)?")


def backend_message(error: BaseException) -> str:
    """The first meaningful line of a backend's error, without its logging prefix."""
    for line in str(error).splitlines():
        line = _LOG_PREFIX.sub("", line).strip()
        if line and not line.startswith("Stack trace"):
            return line
    return type(error).__name__


def other_backend(name: str) -> str:
    return "outlines" if name == "xgrammar" else "xgrammar"


def unsupported_kind(backend: str, kind: str, supported: frozenset[str]) -> GrammarError:
    return GrammarError(
        f"the {backend} backend does not support {kind} constraints (it supports: "
        f"{', '.join(sorted(supported))}); use the {other_backend(backend)} backend for {kind}",
        kind=kind,
        backend=backend,
    )


def check_size(spec: GrammarSpec, options: GrammarOptions, backend: str) -> None:
    size = len(spec.key[1].encode("utf-8"))
    if size > options.max_source_bytes:
        raise GrammarError(
            f"the {spec.kind} constraint is {size} bytes, above the limit of "
            f"{options.max_source_bytes} bytes; simplify it or raise the limit "
            "(GrammarOptions.max_source_bytes, the server's --max-constraint-bytes)",
            kind=spec.kind,
            backend=backend,
            limit="max_source_bytes",
        )


def schema_source(spec: GrammarSpec) -> str:
    return '{"type":"object"}' if spec.kind == "json_object" else str(spec.source)


def prepare_schema(spec: GrammarSpec, support: SchemaSupport, options: GrammarOptions) -> str:
    try:
        return prepare_json_schema(
            schema_source(spec),
            support,
            max_depth=options.max_schema_depth,
            max_bytes=options.max_source_bytes,
            documents=options.schema_documents,
        )
    except GrammarError as error:
        raise error.with_context(kind=spec.kind, backend=support.backend) from None


def ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal (xgrammar's dialect)."""
    out = []
    for char in text:
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\t":
            out.append("\\t")
        elif char == "\r":
            out.append("\\r")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


_REGEX_META = set("\\.+*?()|[]{}^$#&-~ ")


def regex_literal(text: str) -> str:
    """`text` as a regex matching exactly it (Rust regex syntax, also valid in Python)."""
    out = []
    for char in text:
        if char in _REGEX_META:
            out.append("\\" + char if char != " " else "[ ]")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append(char)
    return "".join(out)


def strip_anchors(regex: str) -> str:
    """A whole-output regex without its `^` / `$` (the output must match it as a whole anyway;
    outlines-core refuses a leading `^`)."""
    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$") and not regex.endswith("\\$"):
        regex = regex[:-1]
    return regex


def structural_tag_json(
    spec: GrammarSpec, support: SchemaSupport, options: GrammarOptions
) -> dict[str, Any]:
    """A structural tag in xgrammar's current form, with every JSON schema in it normalized.

    Accepts SGLang's legacy `{"type": "structural_tag", "structures": [{"begin", "schema",
    "end"}], "triggers": [...]}` as well as `{"type": "structural_tag", "format": {...}}`."""
    try:
        tag = json.loads(str(spec.source))
    except json.JSONDecodeError as error:
        raise GrammarError(
            f"the structural tag is not valid JSON: {error.msg} at line {error.lineno} "
            f"column {error.colno}",
            kind=spec.kind,
        ) from None
    if not isinstance(tag, dict):
        raise GrammarError("the structural tag must be a JSON object", kind=spec.kind)
    if "structures" in tag:
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not isinstance(structures, list) or not isinstance(triggers, list) or not triggers:
            raise GrammarError(
                "a structural tag needs a list of structures ({begin, schema, end}) and a "
                "non-empty list of triggers",
                kind=spec.kind,
            )
        tags = []
        for i, item in enumerate(structures):
            if not isinstance(item, dict) or not {"begin", "end"} <= set(item):
                raise GrammarError(
                    f"structure {i} of the structural tag needs begin, schema and end",
                    kind=spec.kind,
                )
            content = _schema_content(item.get("schema", {}), support, options, spec)
            tags.append(
                {"type": "tag", "begin": item["begin"], "content": content, "end": item["end"]}
            )
        return {
            "type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags},
        }
    if "format" not in tag:
        raise GrammarError(
            "a structural tag needs either 'structures' and 'triggers' or a 'format'",
            kind=spec.kind,
        )
    return {**tag, "format": _normalize_formats(tag["format"], support, options, spec)}


def _schema_content(
    schema: Any, support: SchemaSupport, options: GrammarOptions, spec: GrammarSpec
) -> dict[str, Any]:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        normalized = prepare_schema(GrammarSpec("json_schema", text), support, options)
    except GrammarError as error:
        raise GrammarError(
            f"in a schema of the structural tag: {error.message}",
            kind=spec.kind,
            backend=support.backend,
            keyword=error.keyword,
            path=error.path,
        ) from None
    # xgrammar's tags allow unbounded whitespace in JSON unless bounded, and no bound below 1.
    bound = options.max_whitespace if options.json_whitespace == "flexible" else 1
    return {
        "type": "json_schema",
        "json_schema": json.loads(normalized),
        "max_whitespace_cnt": bound,
    }


def _normalize_formats(
    node: Any, support: SchemaSupport, options: GrammarOptions, spec: GrammarSpec
) -> Any:
    if isinstance(node, list):
        return [_normalize_formats(x, support, options, spec) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json":
        content = _schema_content(node.get("json_schema", {}), support, options, spec)
        return {**node, **content}
    return {k: _normalize_formats(v, support, options, spec) for k, v in node.items()}
