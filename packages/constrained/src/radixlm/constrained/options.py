"""GrammarOptions: how a backend turns constraints into grammars (frozen, passed explicitly)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from radixlm.constrained._schema_documents import SchemaDocuments, check_schema_documents


@dataclass(frozen=True, slots=True)
class GrammarOptions:
    """Backend-wide settings; every compiled grammar of a backend shares them.

    - `json_whitespace`: `"compact"` (default) allows no whitespace outside JSON strings, with
      `,` and `:` as separators. Unbounded whitespace lets a weak model pad forever; compact
      output also costs fewer tokens. `"flexible"` allows up to `max_whitespace` whitespace
      characters (space, tab, newline) wherever JSON allows whitespace.
    - `max_schema_depth`: nesting depth of a JSON Schema (subschema inside subschema) above
      which it is rejected; `max_source_bytes`: size above which any constraint is rejected.
    - `jump_forward_window`: how many of the last generated tokens are retokenized together with
      forced text (see `Grammar.jump_forward`); `max_jump_forward_bytes` caps one jump.
    - `compile_threads`: threads a backend may use inside one compilation (xgrammar).
    - `schema_documents`: JSON schemas a JSON-schema constraint may refer to (`$ref`), keyed
      by URI (`https://example.com/person.json`) or by a name relative to the referring
      schema's base URI (`address.json`, which `{"$ref": "address.json"}` finds); each is also
      found by its own `$id`. Nothing is ever fetched over the network: a reference to any
      other document is refused naming it. `load_schema_documents(directory)` reads a
      directory of `*.json` files into this form. Kept as a read-only copy (its repr lists
      the names only).
    """

    json_whitespace: Literal["compact", "flexible"] = "compact"
    max_whitespace: int = 2
    max_schema_depth: int = 64
    max_source_bytes: int = 8 << 20
    jump_forward_window: int = 4
    max_jump_forward_bytes: int = 1024
    compile_threads: int = 1
    schema_documents: Mapping[str, Any] = field(default_factory=SchemaDocuments, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "schema_documents", check_schema_documents(self.schema_documents))
        if self.json_whitespace not in ("compact", "flexible"):
            raise ValueError(
                f"json_whitespace must be 'compact' or 'flexible', got {self.json_whitespace!r}"
            )
        for name in ("max_whitespace", "max_schema_depth", "max_source_bytes", "compile_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.jump_forward_window < 0 or self.max_jump_forward_bytes < 0:
            raise ValueError("jump_forward_window and max_jump_forward_bytes must be >= 0")
