"""The engine's side of structured output: specs from requests, compile futures, bitmasks."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from radixlm.runtime.config import GrammarConfig
from radixlm.runtime.grammar_gate import GatedGrammar
from radixlm.sampling import InvalidRequest, SamplingParams

logger = logging.getLogger("radixlm.runtime.grammar")

# What to change when a constraint hits one of the engine's limits (the constrained package
# words the limit as its own option; a user of the engine or the server sets these).
_SIZE_HINT = "raise max_constraint_bytes (`radixlm serve --max-constraint-bytes N`)"
_TIME_HINT = "raise grammar_compile_timeout (`radixlm serve --grammar-compile-timeout SECONDS`)"
_OPTION_NAMES = {"raise GrammarOptions.max_source_bytes": _SIZE_HINT}


class GrammarService:
    """Builds the grammar backend on first use and compiles constraints off the engine loop.

    `submit(params)` returns None for an unconstrained request, or a Future of the compiled
    grammar (a `GrammarError` inside when it cannot compile); it raises InvalidRequest for a
    constraint this engine cannot take (backend `none`, malformed spec). A request's
    `strict_constraint` (None: `config.strict`) makes the spec strict. Thread-safe.
    """

    def __init__(
        self,
        config: GrammarConfig,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int] = (),
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._described: OrderedDict[Any, None] = OrderedDict()  # specs already logged
        # Documents the schemas may refer to, read once at start (a bad file fails the start).
        self.schema_documents: dict[str, Any] = {}
        if config.schema_dir is not None and self.enabled:
            from radixlm.constrained import load_schema_documents

            self.schema_documents = load_schema_documents(config.schema_dir)

    @property
    def enabled(self) -> bool:
        return self.config.backend != "none"

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                from radixlm.constrained import (
                    GrammarCompiler,
                    GrammarOptions,
                    TokenizerInfo,
                    create_backend,
                )

                info = TokenizerInfo.from_hf(
                    self.tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None,
                )
                options = GrammarOptions(
                    json_whitespace=self.config.json_whitespace,
                    max_source_bytes=self.config.max_constraint_bytes,
                    schema_documents=self.schema_documents,
                )
                backend = create_backend(self.config.backend, info, options)
                self._compiler = GrammarCompiler(
                    backend,
                    max_workers=self.config.compile_workers,
                    time_limit_s=self.config.compile_timeout,
                    cache_size=self.config.cache_size,
                )
            return self._compiler

    def submit(self, params: SamplingParams) -> Future[Any] | None:
        """Start compiling the request's constraint (never blocks on the compilation)."""
        if params.constraint is None:
            return None
        field = params.constraint[0]
        if not self.enabled:
            raise InvalidRequest(
                field,
                "structured output is disabled on this engine (grammar_backend='none'); "
                "remove the constraint or start the engine with a grammar backend",
            )
        from radixlm.constrained import GrammarSpec

        strict = (
            self.config.strict if params.strict_constraint is None else params.strict_constraint
        )
        # Raises GrammarError (an InvalidRequest) for a malformed spec.
        spec = GrammarSpec.from_sampling_params(params, strict=strict)
        assert spec is not None
        future: Future[Any] = self._get_compiler().submit(spec)
        return future

    def matcher(self, compiled: Any) -> Any:
        """A fresh per-sequence grammar for a compiled constraint."""
        return self._get_compiler().backend.matcher(compiled)

    def describe(self, compiled: Any) -> dict[str, Any]:
        """What a request's `meta_info["grammar"]` says about its compiled constraint: the
        backend whose automaton runs, the JSON Schema keywords enforced by validation and
        rollback, the unknown formats treated as annotations. Logs it at INFO the first time
        a spec is seen."""
        info = {
            "backend": getattr(compiled, "served_by", "") or getattr(compiled, "backend", ""),
            "validated": list(getattr(compiled, "validated", ())),
            "annotations": list(getattr(compiled, "annotations", ())),
        }
        key = getattr(getattr(compiled, "spec", None), "key", None)
        with self._lock:
            seen = key in self._described
            if not seen:
                self._described[key] = None
                while len(self._described) > self.config.cache_size:
                    self._described.popitem(last=False)
        if not seen:
            spec = getattr(compiled, "spec", None)
            logger.info(
                "compiled a %s constraint%s: backend %s, validated %s, annotations %s",
                getattr(spec, "kind", "?"),
                " (strict)" if getattr(spec, "strict", False) else "",
                info["backend"],
                ", ".join(info["validated"]) or "none",
                ", ".join(info["annotations"]) or "none",
            )
        return info

    def explain(self, error: BaseException) -> BaseException:
        """A compile error as the user should see it: one that hit the size or the time limit
        also names the engine setting (and server flag) that raises the limit."""
        if not isinstance(error, InvalidRequest):
            return error
        message = error.message
        # A structured `limit` when the constrained package gives one, else its wording.
        limit = getattr(error, "limit", None)
        if limit is None and "above the limit of" in message:
            limit = "max_source_bytes"
        elif limit is None and "took longer than" in message and "to compile" in message:
            limit = "time_limit"
        hint = {"max_source_bytes": _SIZE_HINT, "time_limit": _TIME_HINT}.get(str(limit))
        if hint is None or hint in message:
            return error
        for option, setting in _OPTION_NAMES.items():
            message = message.replace(option, setting)
        if hint not in message:
            joint = " or" if message.endswith("simplify it") else "; or"
            message = f"{message}{joint} {hint}"
        from radixlm.constrained import GrammarError

        if isinstance(error, GrammarError):
            return GrammarError(
                message,
                kind=error.kind,
                backend=error.backend,
                keyword=error.keyword,
                path=error.path,
            )
        return InvalidRequest(error.field, message)

    def settings(self) -> dict[str, Any]:
        """The structured-output settings (for get_server_info)."""
        return {
            "grammar_backend": self.config.backend,
            "strict_constraints": self.config.strict,
            "max_constraint_bytes": self.config.max_constraint_bytes,
            "grammar_compile_timeout": self.config.compile_timeout,
            "json_schema_dir": self.config.schema_dir,
            "json_schema_documents": sorted(self.schema_documents),
        }

    def bitmask(
        self, grammars: Sequence[Any], drafts: Sequence[Sequence[int]] | None = None
    ) -> Any:
        """An int32 bitmask [rows, words]: each grammar's allowed tokens (all for None rows);
        None when no row has a grammar. With `drafts` (speculative decoding), grammar i has
        `len(drafts[i]) + 1` rows: its allowed tokens now and after each of its draft tokens
        (which it must accept; it is left as it was). A grammar gated on a marker not yet
        generated masks nothing: its rows stay all allowed (without drafts it counts as None,
        so a batch of only such rows needs no mask)."""
        grammars = [
            None if _free_for_now(g) and not (drafts and drafts[i]) else g
            for i, g in enumerate(grammars)
        ]
        if all(g is None for g in grammars):
            return None
        from radixlm.constrained import allocate_bitmask

        counts = [1] * len(grammars) if drafts is None else [len(d) + 1 for d in drafts]
        mask = allocate_bitmask(sum(counts), self.vocab_size)
        row = 0
        for index, grammar in enumerate(grammars):
            if grammar is not None:
                grammar.fill_bitmask(mask, row)
                draft = drafts[index] if drafts is not None else ()
                for offset, token in enumerate(draft, start=1):
                    if not grammar.accept_token(token):
                        raise RuntimeError(f"a draft token the grammar refuses: {token}")
                    grammar.fill_bitmask(mask, row + offset)
                if draft:
                    grammar.rollback(len(draft))
            row += counts[index]
        return mask

    def gate(self, matcher: Any, marker: Sequence[int]) -> Any:
        """`matcher` as it applies to a request: from the first output token (no `marker`), or
        from the token after `marker` (the end of a reasoning model's thinking)."""
        return GatedGrammar(matcher, marker) if marker else matcher

    def shutdown(self) -> None:
        with self._lock:
            if self._compiler is not None:
                self._compiler.shutdown()


def _free_for_now(grammar: Any) -> bool:
    """A gated grammar whose marker is still to come: it masks nothing this step."""
    return isinstance(grammar, GatedGrammar) and not grammar.started
