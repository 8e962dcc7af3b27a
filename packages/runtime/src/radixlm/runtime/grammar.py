"""The engine's side of structured output: specs from requests, compile futures, bitmasks."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from radixlm.runtime.engine_config import GrammarConfig
from radixlm.sampling import InvalidRequest, SamplingParams


class GrammarService:
    """Builds the grammar backend on first use and compiles constraints off the engine loop.

    `submit(params)` returns None for an unconstrained request, or a Future of the compiled
    grammar (a `GrammarError` inside when it cannot compile); it raises InvalidRequest for a
    constraint this engine cannot take (backend `none`, malformed spec). Thread-safe.
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
                options = GrammarOptions(json_whitespace=self.config.json_whitespace)  # type: ignore[arg-type]
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

        spec = GrammarSpec.from_sampling_params(params)  # raises GrammarError (InvalidRequest)
        assert spec is not None
        future: Future[Any] = self._get_compiler().submit(spec)
        return future

    def matcher(self, compiled: Any) -> Any:
        """A fresh per-sequence grammar for a compiled constraint."""
        return self._get_compiler().backend.matcher(compiled)

    def bitmask(self, grammars: Sequence[Any]) -> Any:
        """An int32 bitmask [rows, words]: each grammar's allowed tokens (all for None rows);
        None when no row has a grammar."""
        if all(g is None for g in grammars):
            return None
        from radixlm.constrained import allocate_bitmask

        mask = allocate_bitmask(len(grammars), self.vocab_size)
        for row, grammar in enumerate(grammars):
            if grammar is not None:
                grammar.fill_bitmask(mask, row)
        return mask

    def shutdown(self) -> None:
        with self._lock:
            if self._compiler is not None:
                self._compiler.shutdown()
