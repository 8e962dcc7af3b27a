"""The xgrammar backend: every grammar kind, masks from xgrammar's pushdown automaton."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy
import torch
import xgrammar as xgr

from radixlm.constrained._common import (
    backend_message,
    check_size,
    ebnf_literal,
    prepare_schema,
    structural_tag_json,
    unsupported_kind,
)
from radixlm.constrained._jump_forward import plan_jump_forward
from radixlm.constrained._schema_support import XGRAMMAR_SUPPORT
from radixlm.constrained.bitmask import bitmask_width, word_bit
from radixlm.constrained.errors import GrammarError
from radixlm.constrained.interfaces import CompiledGrammar, JumpForward
from radixlm.constrained.options import GrammarOptions
from radixlm.constrained.spec import GrammarSpec
from radixlm.constrained.tokenizer import TokenizerInfo

NAME = "xgrammar"
KINDS = frozenset({"json_schema", "regex", "ebnf", "structural_tag", "choice", "json_object"})


class XGrammarBackend:
    """Compiles every kind with xgrammar. Thread-safe; one per tokenizer and option set."""

    name = NAME
    supported_kinds = KINDS

    def __init__(
        self, tokenizer_info: TokenizerInfo, options: GrammarOptions | None = None
    ) -> None:
        self.tokenizer_info = tokenizer_info
        self.options = options or GrammarOptions()
        # xgrammar's JSON strings (and regex `.`) take UTF-8-encoded surrogates (ED A0..BF ..),
        # which are not UTF-8, so not JSON: tokens holding one are never offered, and a token
        # ending in ED is not followed by one starting with A0..BF (see XGrammarMatcher).
        vocab = [
            b"" if b is None or _SURROGATE.search(b) else b for b in tokenizer_info.token_bytes
        ]
        self._surrogate_guard = _SurrogateGuard(tokenizer_info)
        self._xgr_info = xgr.TokenizerInfo(
            vocab,
            xgr.VocabType.RAW,
            vocab_size=tokenizer_info.vocab_size,
            stop_token_ids=list(tokenizer_info.stop_token_ids),
            add_prefix_space=False,
        )
        # Caching is GrammarCompiler's job; this compiler only compiles.
        self._compiler = xgr.GrammarCompiler(
            self._xgr_info, max_threads=self.options.compile_threads, cache_enabled=False
        )

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        check_size(spec, self.options, NAME)
        if spec.kind in ("json_schema", "json_object"):
            schema = prepare_schema(spec, XGRAMMAR_SUPPORT, self.options)
            handle = self._call(spec, lambda: self._compile_schema(schema))
        elif spec.kind == "regex":
            handle = self._call(spec, lambda: self._compiler.compile_regex(str(spec.source)))
        elif spec.kind == "ebnf":
            handle = self._call(spec, lambda: self._compiler.compile_grammar(str(spec.source)))
        elif spec.kind == "choice":
            rule = " | ".join(ebnf_literal(choice) for choice in spec.source)
            handle = self._call(spec, lambda: self._compiler.compile_grammar(f"root ::= {rule}"))
        elif spec.kind == "structural_tag":
            try:
                tag = structural_tag_json(spec, XGRAMMAR_SUPPORT, self.options)
            except GrammarError as error:
                raise error.with_context(kind=spec.kind, backend=NAME) from None
            text = json.dumps(tag)
            handle = self._call(spec, lambda: self._compiler.compile_structural_tag(text))
        else:
            raise unsupported_kind(NAME, spec.kind, KINDS)
        return CompiledGrammar(spec=spec, backend=NAME, handle=handle)

    def _compile_schema(self, schema: str) -> Any:
        if self.options.json_whitespace == "compact":
            return self._compiler.compile_json_schema(
                schema, any_whitespace=False, separators=(",", ":"), strict_mode=True
            )
        return self._compiler.compile_json_schema(
            schema,
            any_whitespace=True,
            strict_mode=True,
            max_whitespace_cnt=self.options.max_whitespace,
        )

    @staticmethod
    def _call(spec: GrammarSpec, build: Any) -> Any:
        try:
            return build()
        except GrammarError:
            raise
        except Exception as error:  # xgrammar raises RuntimeError / ValueError subclasses
            raise GrammarError(
                f"the {spec.kind} constraint does not compile: {backend_message(error)}",
                kind=spec.kind,
                backend=NAME,
            ) from None

    def matcher(self, compiled: CompiledGrammar) -> XGrammarMatcher:
        if compiled.backend != NAME:
            raise ValueError(f"a grammar compiled by {compiled.backend} cannot run on {NAME}")
        return XGrammarMatcher(
            xgr.GrammarMatcher(compiled.handle),
            self.tokenizer_info,
            self.options,
            [],
            guard=self._surrogate_guard,
        )


class XGrammarMatcher:
    """One sequence's state over an xgrammar compiled grammar (see `Grammar`)."""

    def __init__(
        self,
        matcher: Any,
        info: TokenizerInfo,
        options: GrammarOptions,
        history: list[int],
        terminated: bool = False,
        guard: _SurrogateGuard | None = None,
    ) -> None:
        self._matcher = matcher
        self._guard = guard or _SurrogateGuard(info)
        self._info = info
        self._options = options
        self._history = history
        self._terminated = terminated
        self._scratch: Any = None
        # Bound once: these run for every token of every constrained request.
        self._accept = matcher.accept_token
        self._fill = matcher.fill_next_token_bitmask
        self._size = info.vocab_size
        self._stops = frozenset(info.stop_token_ids)

    @property
    def history(self) -> list[int]:
        """The accepted tokens, oldest first (read-only view for the jump-forward planner)."""
        return self._history

    def accept_token(self, token_id: int) -> bool:
        # xgrammar wraps ids past int32 around, so the range is checked here.
        if not 0 <= token_id < self._size:
            return False
        history = self._history
        if history and history[-1] in self._guard.lead and token_id in self._guard.trail:
            return False
        if not self._accept(token_id):
            return False
        self._history.append(token_id)
        if token_id in self._stops:
            self._terminated = True
        return True

    def fill_bitmask(self, bitmask: Any, row: int = 0) -> None:
        if self._terminated:
            bitmask[row] = 0
            return
        self._fill(bitmask, row)
        history = self._history
        if history and history[-1] in self._guard.lead:
            for token in self._guard.trail:
                bitmask[row, token >> 5] &= ~word_bit(token & 31)

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0 or num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._history)} tokens")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            del self._history[-num_tokens:]
            self._terminated = False

    def jump_forward(self) -> JumpForward | None:
        if self._terminated:
            return None
        forced = self._matcher.find_jump_forward_string().encode("utf-8")
        forced = forced[: self._options.max_jump_forward_bytes]
        return plan_jump_forward(self, self._info, forced, self._options.jump_forward_window)

    def fork(self) -> XGrammarMatcher:
        return XGrammarMatcher(
            self._matcher.fork(),
            self._info,
            self._options,
            list(self._history),
            self._terminated,
            self._guard,
        )

    def violation(self) -> None:
        """Never: this grammar enforces all of its constraint itself."""
        return None

    def allows_any(self, token_ids: list[int]) -> bool:
        if self._scratch is None:
            self._scratch = torch.zeros((1, bitmask_width(self._size)), dtype=torch.int32)
        self._fill(self._scratch, 0)
        words = self._scratch.numpy()[0]
        ids = numpy.asarray(token_ids, dtype=numpy.int64)
        return bool(((words[ids >> 5] >> (ids & 31)) & 1).any())


_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


class _SurrogateGuard:
    """Tokens ending in byte ED (`lead`) and tokens starting with A0..BF (`trail`): one after
    the other they would spell a UTF-16 surrogate, which UTF-8 forbids."""

    def __init__(self, info: TokenizerInfo) -> None:
        table = info.token_bytes
        self.lead = frozenset(i for i, b in enumerate(table) if b and b[-1] == 0xED)
        self.trail = tuple(i for i, b in enumerate(table) if b and 0xA0 <= b[0] <= 0xBF)
