"""The outlines backend: json_schema, regex, choice and json_object as outlines-core DFAs."""

from __future__ import annotations

import re
import threading
from typing import Any

import outlines_core

from radixlm.constrained._common import (
    backend_message,
    check_size,
    prepare_schema,
    regex_literal,
    strip_anchors,
    unsupported_kind,
)
from radixlm.constrained._jump_forward import plan_jump_forward
from radixlm.constrained._schema_support import OUTLINES_SUPPORT
from radixlm.constrained.bitmask import bitmask_width, word_bit
from radixlm.constrained.errors import GrammarError
from radixlm.constrained.interfaces import CompiledGrammar, JumpForward
from radixlm.constrained.options import GrammarOptions
from radixlm.constrained.spec import GrammarSpec
from radixlm.constrained.tokenizer import TokenizerInfo

NAME = "outlines"
KINDS = frozenset({"json_schema", "regex", "choice", "json_object"})
_UNLIMITED_ROLLBACK = 1 << 30
# Past this size outlines-core takes tens of seconds to minutes to build the automaton.
_MAX_REGEX_CHARS = 200_000


class _OutlinesGrammar:
    """A compiled DFA index plus what jump-forward learned about its states."""

    def __init__(self, index: Any) -> None:
        self.index = index
        # state -> (bytes every continuation starts with, state after them or None)
        self.forced: dict[int, tuple[bytes, int | None]] = {}


class OutlinesBackend:
    """Compiles with outlines-core (a DFA over tokens). Thread-safe; one per tokenizer."""

    name = NAME
    supported_kinds = KINDS

    def __init__(
        self, tokenizer_info: TokenizerInfo, options: GrammarOptions | None = None
    ) -> None:
        self.tokenizer_info = tokenizer_info
        self.options = options or GrammarOptions()
        self._vocabulary: Any = None
        self._lock = threading.Lock()

    def _vocab(self) -> Any:
        """outlines-core's Vocabulary, built from our decoded tokens (never from a hub)."""
        with self._lock:
            if self._vocabulary is None:
                info = self.tokenizer_info
                stops = set(info.stop_token_ids)
                tokens: dict[bytes, list[int]] = {}
                for token_id, data in enumerate(info.token_bytes):
                    if data is not None and token_id not in stops:
                        tokens.setdefault(data, []).append(token_id)
                self._vocabulary = outlines_core.Vocabulary(info.stop_token_ids[0], tokens)
            return self._vocabulary

    def _whitespace(self) -> str:
        if self.options.json_whitespace == "compact":
            return ""
        return f"[ \\t\\n]{{0,{self.options.max_whitespace}}}"

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        if spec.kind not in KINDS:
            raise unsupported_kind(NAME, spec.kind, KINDS)
        check_size(spec, self.options, NAME)
        if spec.kind == "json_object":
            regex = _json_object_regex(self._whitespace())
        elif spec.kind == "json_schema":
            schema = prepare_schema(spec, OUTLINES_SUPPORT, self.options)
            try:
                regex = outlines_core.json_schema.build_regex_from_schema(
                    schema, self._whitespace()
                )
            except Exception as error:
                raise GrammarError(
                    f"the JSON schema is not supported by outlines: {backend_message(error)}",
                    kind=spec.kind,
                    backend=NAME,
                ) from None
        elif spec.kind == "choice":
            regex = "|".join(f"({regex_literal(choice)})" for choice in spec.source)
        else:
            regex = strip_anchors(str(spec.source))
            self._check_regex(regex, spec)
        if len(regex) > _MAX_REGEX_CHARS:
            raise GrammarError(
                f"the {spec.kind} constraint becomes a regular expression of {len(regex)} "
                f"characters, more than outlines-core builds an automaton for in reasonable "
                f"time ({_MAX_REGEX_CHARS}); use the xgrammar or llguidance backend",
                kind=spec.kind,
                backend=NAME,
                limit="regex_size",
            )
        try:
            # outlines-core builds its automaton with leftmost-first semantics, which drops
            # alternatives that extend an earlier one (`ab|abc` never reaches "abc"); the end
            # anchor makes every alternative a whole-output match again.
            index = outlines_core.Index(f"({regex})$", self._vocab())
        except Exception as error:
            raise GrammarError(
                f"the {spec.kind} constraint does not compile for outlines: "
                f"{backend_message(error)} (outlines uses Rust regex syntax: no look-around, "
                "no backreferences, and every match must be writable with the vocabulary)",
                kind=spec.kind,
                backend=NAME,
            ) from None
        return CompiledGrammar(spec=spec, backend=NAME, handle=_OutlinesGrammar(index))

    @staticmethod
    def _check_regex(regex: str, spec: GrammarSpec) -> None:
        """Python's parser gives the position of plain syntax errors; outlines does not."""
        try:
            re.compile(regex)
        except re.error as error:
            raise GrammarError(
                f"the regex does not compile: {error}", kind=spec.kind, backend=NAME
            ) from None
        except RecursionError:
            raise GrammarError(
                "the regex is nested too deeply", kind=spec.kind, backend=NAME
            ) from None

    def matcher(self, compiled: CompiledGrammar) -> OutlinesMatcher:
        if compiled.backend != NAME:
            raise ValueError(f"a grammar compiled by {compiled.backend} cannot run on {NAME}")
        return OutlinesMatcher(compiled.handle, self.tokenizer_info, self.options)


class OutlinesMatcher:
    """One sequence's state over an outlines-core index (see `Grammar`)."""

    def __init__(
        self, grammar: _OutlinesGrammar, info: TokenizerInfo, options: GrammarOptions
    ) -> None:
        self._grammar = grammar
        self._info = info
        self._options = options
        self._guide = outlines_core.Guide(grammar.index, max_rollback=_UNLIMITED_ROLLBACK)
        self._history: list[int] = []
        self._terminated = False
        self._stops = frozenset(info.stop_token_ids)
        # The vocabulary's EOS bit comes from outlines-core; other stop tokens are added here.
        self._extra_stops = info.stop_token_ids[1:]
        self._size = info.vocab_size
        self._width = bitmask_width(info.vocab_size)
        self._advance = self._guide.advance
        self._write = self._guide.write_mask_into

    @property
    def history(self) -> list[int]:
        return self._history

    def accept_token(self, token_id: int) -> bool:
        if self._terminated or not 0 <= token_id < self._size:
            return False
        if token_id in self._stops:
            if not self._guide.is_finished():
                return False
            self._terminated = True
        else:
            try:
                self._advance(token_id, False)
            except ValueError:
                return False
        self._history.append(token_id)
        return True

    def fill_bitmask(self, bitmask: Any, row: int = 0) -> None:
        if self._terminated:
            bitmask[row] = 0
            return
        # The row's address without making a view (this runs for every token); int32 rows.
        if hasattr(bitmask, "data_ptr"):
            pointer = bitmask.data_ptr() + row * bitmask.stride(0) * 4
        else:
            pointer = bitmask.ctypes.data + row * bitmask.strides[0]
        self._write(pointer, self._width, 4)  # outlines-core writes every word of the row
        if self._extra_stops and self._guide.is_finished():
            target = bitmask[row]
            for stop in self._extra_stops:
                target[stop // 32] |= word_bit(stop % 32)

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0 or num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._history)} tokens")
        if num_tokens == 0:
            return
        steps = num_tokens
        if self._terminated:
            self._terminated = False
            steps -= 1
        if steps:
            self._guide.rollback_state(steps)
        del self._history[-num_tokens:]

    def fork(self) -> OutlinesMatcher:
        twin = OutlinesMatcher(self._grammar, self._info, self._options)
        for token in self._history:
            twin.accept_token(token)
        return twin

    def jump_forward(self) -> JumpForward | None:
        if self._terminated:
            return None
        forced = self._forced_bytes(self._guide.get_state())
        return plan_jump_forward(self, self._info, forced, self._options.jump_forward_window)

    def violation(self) -> None:
        """Never: this grammar enforces all of its constraint itself."""
        return None

    def allows_any(self, token_ids: list[int]) -> bool:
        index, state = self._grammar.index, self._guide.get_state()
        return any(index.get_next_state(state, t) is not None for t in token_ids)

    def _forced_bytes(self, state: int) -> bytes:
        """Bytes every continuation from `state` starts with, following single-path states."""
        out = b""
        limit = self._options.max_jump_forward_bytes
        current: int | None = state
        while current is not None and len(out) < limit:
            step = self._grammar.forced.get(current)
            if step is None:
                step = self._forced_step(current)
                self._grammar.forced[current] = step
            if not step[0]:
                break
            out += step[0]
            current = step[1]
        return out[:limit]

    def _forced_step(self, state: int) -> tuple[bytes, int | None]:
        index = self._grammar.index
        if index.is_final_state(state):
            return b"", None
        table = self._info.token_bytes
        common: bytes | None = None
        exact: int | None = None
        for token in index.get_allowed_tokens(state):
            data = table[token] if 0 <= token < len(table) else None
            if not data:
                return b"", None
            if common is None:
                common = data
            else:
                size = 0
                limit = min(len(common), len(data))
                while size < limit and common[size] == data[size]:
                    size += 1
                common = common[:size]
                if not common:
                    return b"", None
        if not common:
            return b"", None
        for token in index.get_allowed_tokens(state):
            if table[token] == common:
                exact = token
                break
        return common, (index.get_next_state(state, exact) if exact is not None else None)


def _json_object_regex(ws: str) -> str:
    """Any JSON object nested at most two levels deep (outlines' own `{"type": "object"}`
    nests deeper, and its automaton takes minutes to build on a real vocabulary)."""
    js = outlines_core.json_schema
    scalar = f"({js.STRING}|{js.NUMBER}|true|false|null)"

    def obj(value: str) -> str:
        member = f"{js.STRING}{ws}:{ws}{value}"
        return f"\\{{{ws}({member}({ws},{ws}{member})*)?{ws}\\}}"

    def arr(value: str) -> str:
        return f"\\[{ws}({value}({ws},{ws}{value})*)?{ws}\\]"

    return obj(f"({scalar}|{obj(scalar)}|{arr(scalar)})")
