"""GrammarSpec: which constraint a request carries, independent of any backend."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from radixlm.constrained.errors import GrammarError

GrammarKind = Literal["json_schema", "regex", "ebnf", "structural_tag", "choice", "json_object"]
GRAMMAR_KINDS: tuple[str, ...] = get_args(GrammarKind)

# The SamplingParams fields that carry a constraint, in the order SamplingParams lists them.
_PARAM_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag", "choice")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on the output: `kind` and its `source`.

    - `json_schema`: a JSON Schema, JSON-encoded (a dict is accepted and encoded).
    - `regex`: a regular expression the whole output must match.
    - `ebnf`: an EBNF grammar (xgrammar's dialect, start rule `root`).
    - `structural_tag`: a JSON-encoded structural tag (SGLang's `{"structures", "triggers"}`
      form or xgrammar's `{"type": "structural_tag", "format": ...}` form).
    - `choice`: a sequence of strings; the output is exactly one of them.
    - `json_object`: any JSON object (OpenAI's JSON mode); `source` is ignored.

    `strict`: refuse anything the grammar alone does not enforce (no validation and rollback;
    only the `auto` backend ever validates, the named backends are always strict).

    Specs are hashable and compare by value; compiled grammars are cached under `key`.
    """

    kind: GrammarKind
    source: str | tuple[str, ...] = ""
    strict: bool = False

    def __init__(
        self,
        kind: GrammarKind,
        source: str | Sequence[str] | dict[str, Any] = "",
        *,
        strict: bool = False,
    ) -> None:
        if kind not in GRAMMAR_KINDS:
            raise GrammarError(
                f"unknown grammar kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}"
            )
        value: str | tuple[str, ...]
        if kind == "choice":
            if isinstance(source, (str, bytes, dict)) or not isinstance(source, Sequence):
                raise GrammarError("choice needs a list of strings", kind=kind)
            if not source or not all(isinstance(s, str) for s in source):
                raise GrammarError("choice needs a non-empty list of strings", kind=kind)
            value = tuple(source)
        elif kind == "json_object":
            value = ""
        elif isinstance(source, dict) and kind in ("json_schema", "structural_tag"):
            value = json.dumps(source)
        elif isinstance(source, str):
            if not source.strip():
                raise GrammarError(f"the {kind} constraint is empty", kind=kind)
            value = source
        else:
            raise GrammarError(f"the {kind} constraint must be a string", kind=kind)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "source", value)
        object.__setattr__(self, "strict", bool(strict))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, source as text): what a compiled grammar is cached under (a strict spec's
        kind carries a `!strict` mark)."""
        kind = f"{self.kind}!strict" if self.strict else self.kind
        if isinstance(self.source, tuple):
            return (kind, json.dumps(list(self.source)))
        return (kind, self.source)

    @property
    def text(self) -> str:
        """The source as text (a choice list JSON-encoded)."""
        if isinstance(self.source, tuple):
            return json.dumps(list(self.source))
        return self.source

    def with_strict(self, strict: bool) -> GrammarSpec:
        return GrammarSpec(self.kind, self.source, strict=strict)

    @classmethod
    def from_sampling_params(cls, params: Any, *, strict: bool = False) -> GrammarSpec | None:
        """The constraint of a `radixlm.sampling.SamplingParams` (`json_schema`, `regex`, `ebnf`,
        `structural_tag` or `choice`), or None when it has none. `json_object` is not a sampling
        parameter: it comes from an API's `response_format`."""
        given = [(name, getattr(params, name, None)) for name in _PARAM_FIELDS]
        given = [(name, value) for name, value in given if value is not None]
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise GrammarError(f"only one structured-output constraint may be set; got {names}")
        name, value = given[0]
        return cls(name, value, strict=strict)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        text = repr(self.source)
        if len(text) > 80:
            text = text[:77] + "..."
        mark = ", strict=True" if self.strict else ""
        return f"GrammarSpec({self.kind!r}, {text}{mark})"
