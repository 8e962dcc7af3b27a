"""The `auto` backend: for each constraint, the backend that enforces all of it.

Compilation tries the installed backends in `AUTO_ORDER` (xgrammar, llguidance, outlines),
each as strictly as when it is chosen by name; the first that compiles serves the constraint.
When every one refuses a JSON schema for a keyword it cannot enforce (and the spec is not
`strict`), the schema is compiled relaxed — the unenforceable keywords dropped, giving a
grammar for a superset — on the first backend that takes that, and the matcher validates each
completed value against the original schema (`_validation.ValidatingGrammar`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from radixlm.constrained._common import unsupported_kind
from radixlm.constrained._schema import BACKEND_NODES_LIMIT, normalize_json_schema
from radixlm.constrained._schema_support import support_of
from radixlm.constrained._validation import SchemaChecks, ValidatingGrammar
from radixlm.constrained.errors import GrammarError
from radixlm.constrained.interfaces import CompiledGrammar, Grammar, GrammarBackend
from radixlm.constrained.options import GrammarOptions
from radixlm.constrained.spec import GRAMMAR_KINDS, GrammarSpec
from radixlm.constrained.tokenizer import TokenizerInfo

NAME = "auto"
logger = logging.getLogger("radixlm.constrained")


@dataclass(frozen=True, slots=True)
class _Choice:
    backend: str
    compiled: CompiledGrammar
    checks: SchemaChecks | None


class AutoBackend:
    """Chooses a backend per constraint (see module doc). Thread-safe."""

    name = NAME

    def __init__(
        self, tokenizer_info: TokenizerInfo, options: GrammarOptions | None = None
    ) -> None:
        from radixlm.constrained.registry import AUTO_ORDER, available_backends

        self.tokenizer_info = tokenizer_info
        self.options = options or GrammarOptions()
        installed = set(available_backends())
        self.order = tuple(name for name in AUTO_ORDER if name in installed)
        if not self.order:
            raise GrammarError(
                "the auto grammar backend needs one of xgrammar, llguidance or outlines-core: "
                "pip install 'radixlm-constrained[xgrammar]'"
            )
        self._backends: dict[str, GrammarBackend] = {}
        self._lock = threading.Lock()
        # Backends are built on first use; every kind has at least xgrammar or llguidance.
        self.supported_kinds = frozenset(GRAMMAR_KINDS)

    def backend(self, name: str) -> GrammarBackend:
        """The backend `name` over the same tokenizer and options, built on first use."""
        with self._lock:
            found = self._backends.get(name)
            if found is None:
                from radixlm.constrained.registry import create_backend

                found = self._backends[name] = create_backend(
                    name, self.tokenizer_info, self.options
                )
            return found

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        errors: list[GrammarError] = []
        for name in self.usable():
            backend = self.backend(name)
            if spec.kind not in backend.supported_kinds:
                errors.append(unsupported_kind(name, spec.kind, backend.supported_kinds))
                continue
            try:
                compiled = backend.compile(spec)
            except GrammarError as error:
                errors.append(error.with_context(kind=spec.kind, backend=name))
                if not _another_may_take_it(error):
                    break
                continue
            return self._chosen(spec, _Choice(name, compiled, None), compiled)
        if (
            spec.kind == "json_schema"
            and not spec.strict
            and all(map(_another_may_take_it, errors))
        ):
            return self._relaxed(spec, errors)
        raise _best(errors, spec)

    def usable(self) -> list[str]:
        """The backends of `order` that load (a broken install is skipped, not fatal)."""
        names = []
        for name in self.order:
            try:
                self.backend(name)
            except ImportError:
                continue
            names.append(name)
        return names

    def _relaxed(self, spec: GrammarSpec, strict_errors: list[GrammarError]) -> CompiledGrammar:
        # What stopped the relaxed schema is what the user must change.
        errors: list[GrammarError] = []
        candidates = []
        for rank, name in enumerate(self.usable()):
            try:
                normalized = normalize_json_schema(
                    spec.text,
                    support_of(name),
                    max_depth=self.options.max_schema_depth,
                    max_bytes=self.options.max_source_bytes,
                    relax=True,
                    documents=self.options.schema_documents,
                )
            except GrammarError as error:
                errors.append(error.with_context(kind=spec.kind, backend=name))
                continue
            # outlines builds its automaton slowly for large schemas: it comes last.
            candidates.append(
                (name == "outlines", len(normalized.deferred), rank, name, normalized)
            )
        # The backend whose grammar leaves the least to validation (fewest rollbacks) first.
        for *_, name, normalized in sorted(candidates, key=lambda c: c[:3]):
            try:
                compiled = self.backend(name).compile(GrammarSpec("json_schema", normalized.text))
            except GrammarError as error:
                errors.append(error.with_context(kind=spec.kind, backend=name))
                continue
            checks = (
                SchemaChecks(
                    normalized.validation, normalized.deferred, registry=normalized.registry
                )
                if normalized.deferred
                else None
            )
            result = CompiledGrammar(
                spec=spec,
                backend=NAME,
                handle=_Choice(name, compiled, checks),
                served_by=name,
                validated=tuple(sorted(normalized.deferred)),
                annotations=tuple(sorted(normalized.annotations)),
            )
            logger.debug(
                "grammar %r served by %s; validated by rollback: %s; annotations: %s",
                spec,
                name,
                ", ".join(result.validated) or "none",
                ", ".join(result.annotations) or "none",
            )
            return result
        raise _best(errors, spec)

    def _chosen(
        self, spec: GrammarSpec, choice: _Choice, compiled: CompiledGrammar
    ) -> CompiledGrammar:
        result = CompiledGrammar(spec=spec, backend=NAME, handle=choice, served_by=choice.backend)
        logger.debug("grammar %r served by %s", spec, choice.backend)
        return result

    def matcher(self, compiled: CompiledGrammar) -> Grammar:
        if compiled.backend != NAME:
            raise ValueError(f"a grammar compiled by {compiled.backend} cannot run on {NAME}")
        choice: _Choice = compiled.handle
        inner = self.backend(choice.backend).matcher(choice.compiled)
        if choice.checks is None:
            return inner
        return ValidatingGrammar(inner, choice.checks, self.tokenizer_info)


def _another_may_take_it(error: GrammarError) -> bool:
    """Whether another backend could compile what this one refused: a keyword or form it does
    not enforce, or a schema too large for it alone; not a constraint that is invalid or over
    a limit everywhere."""
    if error.limit is not None:  # only a schema too large for one backend goes elsewhere
        return error.limit == BACKEND_NODES_LIMIT
    text = error.message
    invalid = (
        "not valid JSON",
        "is not valid",
        "above the limit",
        "nested deeper",
        "nested too deeply",
        "more than",
        "points to nothing",
        "was not shipped",
        "no value satisfies",
        "allows no value",
        "must be",
    )
    return not any(marker in text for marker in invalid)


def _best(errors: list[GrammarError], spec: GrammarSpec) -> GrammarError:
    """The error to report when no backend takes the constraint: the first one naming a
    keyword (the preferred backend's), with the others' verdicts summed up."""
    if not errors:
        return GrammarError(
            f"no installed grammar backend supports {spec.kind} constraints", kind=spec.kind
        )
    # "Too large for this backend, use llguidance" is beside the point once llguidance spoke.
    telling = [e for e in errors if e.limit != BACKEND_NODES_LIMIT] or errors
    first = next((e for e in telling if e.keyword), telling[0])
    others = sorted({e.backend for e in errors if e.backend and e is not first})
    message = first.message
    if others and _another_may_take_it(first):
        message += f" (also refused by: {', '.join(others)})"
    if spec.strict and spec.kind == "json_schema" and first.keyword and _another_may_take_it(first):
        message += (
            "; without strict_constraint, keywords no grammar enforces are enforced by "
            "validating each value and rolling back"
        )
    return GrammarError(
        message,
        kind=spec.kind,
        backend=NAME,
        keyword=first.keyword,
        path=first.path,
        limit=first.limit,
    )
