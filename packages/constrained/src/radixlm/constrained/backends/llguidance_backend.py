"""The llguidance backend: every grammar kind as an llguidance grammar (an Earley parser over
lazily built regex lexers), on a tokenizer built from our own token table.

Each constraint is first written as Lark text by `_llguidance_lark`, whose module doc says why
EBNF and tag literals are written one character per lexeme. A JSON schema too large for
llguidance's own JSON compiler is written as Lark rules around small `%json` blocks by
`_llguidance_schema`, and compiled with limits and a thread stack sized for it.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy
import torch
from llguidance import LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper

from radixlm.constrained._common import (
    check_size,
    prepare_schema,
    structural_tag_json,
    unsupported_kind,
)
from radixlm.constrained._jump_forward import plan_jump_forward
from radixlm.constrained._schema_support import LLGUIDANCE_SUPPORT
from radixlm.constrained.backends._llguidance_lark import (
    NAME,
    TagToLark,
    ebnf_to_lark,
    lark_json,
    lark_regex,
    literal,
)
from radixlm.constrained.backends._llguidance_schema import (
    LARGE_NODES,
    LargeSchema,
    count_nodes,
    write_large_schema,
)
from radixlm.constrained.bitmask import bitmask_width
from radixlm.constrained.errors import GrammarError
from radixlm.constrained.interfaces import CompiledGrammar, JumpForward, Violation
from radixlm.constrained.options import GrammarOptions
from radixlm.constrained.spec import GrammarSpec
from radixlm.constrained.tokenizer import TokenizerInfo

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

KINDS = frozenset({"json_schema", "regex", "ebnf", "structural_tag", "choice", "json_object"})
# llguidance's own forcing would narrow a mask to one token where the grammar forces bytes,
# tokenized its way (`"` after `{`, where the tokenizer writes `{"`): masks hold every token the
# grammar allows, and forced text is planned by our jump-forward.
_OPTIONS = '%llguidance {"no_forcing": true}'
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"')
# llguidance compiles a Lark grammar recursively along its rules (about 3 KiB of stack per
# rule; past about 2,500 rules deep a default 8 MiB stack overflows and the process dies), so
# a large schema compiles on a thread with a stack for the depth its rules may reach.
_STACK_BASE = 32 << 20
_STACK_PER_RULE = 6 << 10
_MAX_STACK = 1 << 30
_STACK_LOCK = threading.Lock()
_JSON_COMPILER_SIZE = "json_compiler_size"  # GrammarError.limit: "schema too large"
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")


def parser_limits() -> LLParserLimits:
    """llguidance's defaults, spelled out: lexer fuel bounds the work of building a grammar
    (about 20 ms) and of one step (about 15 ms); past a limit compilation fails, or a step
    does (see `LLGuidanceMatcher.violation`). No grammar or state dumps in error messages."""
    return LLParserLimits(
        max_items_in_row=2000,
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        max_lexer_states=250_000,
        max_grammar_size=500_000,
        verbose_errors=False,
    )


def large_schema_limits(written: LargeSchema) -> LLParserLimits:
    """Limits for a schema written by `write_large_schema`: a parser row holds about four items
    per member or branch that may come next (optional members, `anyOf` branches), so the row
    and step limits grow with the widest such choice; the grammar size and the fuel for
    building it with the subschemas. A step past the defaults costs about 1 ms per 20,000
    items."""
    defaults = parser_limits()
    return LLParserLimits(
        max_items_in_row=max(defaults.max_items_in_row, 6 * written.width),
        initial_lexer_fuel=max(defaults.initial_lexer_fuel, 1_000 * written.nodes),
        step_lexer_fuel=max(defaults.step_lexer_fuel, 100 * written.width),
        step_max_items=max(defaults.step_max_items, 30 * written.width),
        max_lexer_states=defaults.max_lexer_states,
        max_grammar_size=max(defaults.max_grammar_size, 60 * written.nodes),
        verbose_errors=False,
    )


class _Vocabulary:
    """Our token table as llguidance's `TokenizerWrapper` reads it. Special and undefined ids
    and the stop tokens are empty special tokens, which no grammar allows as text."""

    def __init__(self, info: TokenizerInfo) -> None:
        stops = set(info.stop_token_ids)
        self.tokens = [
            b"" if data is None or i in stops else data for i, data in enumerate(info.token_bytes)
        ]
        self.special_token_ids = [i for i, data in enumerate(self.tokens) if not data]
        self.eos_token_id = info.stop_token_ids[0]
        self.bos_token_id = None
        self.greedy: Any = None  # llguidance's greedy tokenizer, where ours is not exact
        self._info = info

    def __call__(self, text: Any) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper probes for bytes: take text only
            raise TypeError("text is encoded as str")
        ids = self._info.encode_exact(text)
        if ids is None and self.greedy is not None:
            ids = self.greedy(text)
        return list(ids or [])


def build_tokenizer(info: TokenizerInfo) -> LLTokenizer:
    """llguidance's tokenizer for `info`, built locally: `vocab_size` ids, every stop token an
    end of sequence, ids the tokenizer lacks (the model's padding) special, so never allowed."""
    vocabulary = _Vocabulary(info)
    tokenizer = LLTokenizer(
        TokenizerWrapper(vocabulary),
        n_vocab=info.vocab_size,
        eos_token=list(info.stop_token_ids),
    )
    vocabulary.greedy = tokenizer.greedy_tokenize
    return tokenizer


class _LLGuidanceGrammar:
    """A compiled grammar: a matcher at the start that is only ever copied (under a lock, so
    that matchers can be made on several threads)."""

    def __init__(self, start: Any) -> None:
        self._start = start
        self._lock = threading.Lock()

    def fresh(self) -> Any:
        with self._lock:
            return self._start.deep_copy()


class LLGuidanceBackend:
    """Compiles every kind with llguidance. Thread-safe; one per tokenizer and option set."""

    name = NAME
    supported_kinds = KINDS

    def __init__(
        self, tokenizer_info: TokenizerInfo, options: GrammarOptions | None = None
    ) -> None:
        self.tokenizer_info = tokenizer_info
        self.options = options or GrammarOptions()
        self._tokenizer = build_tokenizer(tokenizer_info)
        self._limits = parser_limits()

    def json_options(self) -> JsonCompileOptions:
        """llguidance's JSON options (its `x-guidance`) for our whitespace setting."""
        if self.options.json_whitespace == "compact":
            return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        # Matched at most once wherever JSON allows whitespace: runs stay bounded.
        return {"whitespace_pattern": f"[\\x20\\x0A\\x09]{{1,{self.options.max_whitespace}}}"}

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        if spec.kind not in KINDS:
            raise unsupported_kind(NAME, spec.kind, KINDS)
        check_size(spec, self.options, NAME)
        if spec.kind in ("json_schema", "json_object"):
            schema = json.loads(prepare_schema(spec, LLGUIDANCE_SUPPORT, self.options))
            if count_nodes(schema) > LARGE_NODES:
                return self._compile_large(spec, schema)
            lark = f"start: {lark_json(schema, self.json_options())}"
            try:
                return self._compile_lark(spec, lark, self._limits)
            except GrammarError as error:  # llguidance counts its own way: a few smaller
                if error.limit != _JSON_COMPILER_SIZE:  # schemas are too large for it too
                    raise
                return self._compile_large(spec, schema)
        elif spec.kind == "regex":
            lark = f"start: /{lark_regex(str(spec.source))}/"
        elif spec.kind == "choice":
            lark = "start: " + " | ".join(literal(choice) for choice in spec.source)
        elif spec.kind == "ebnf":
            lark = ebnf_to_lark(str(spec.source))
        else:
            lark = self._structural_tag(spec)
        return self._compile_lark(spec, lark, self._limits)

    def _compile_lark(
        self, spec: GrammarSpec, lark: str, limits: LLParserLimits
    ) -> CompiledGrammar:
        grammar = LLMatcher.grammar_from_lark(f"{_OPTIONS}\n{lark}")
        matcher = LLMatcher(self._tokenizer, grammar, log_level=0, limits=limits)
        problem = _problem(matcher)
        if problem is None:  # the first step's mask, which some limits stop only when built
            probe = matcher.deep_copy()
            probe.compute_bitmask()
            problem = _problem(probe)
        if problem is not None:
            raise _grammar_error(spec, problem)
        return CompiledGrammar(spec=spec, backend=NAME, handle=_LLGuidanceGrammar(matcher))

    def _compile_large(self, spec: GrammarSpec, schema: Any) -> CompiledGrammar:
        """A schema too large for llguidance's JSON compiler, as Lark rules around `%json`
        blocks (`_llguidance_schema`), compiled with limits and a stack sized for it."""
        try:
            written = write_large_schema(schema, self.json_options())
        except GrammarError as error:
            raise error.with_context(kind=spec.kind, backend=NAME) from None
        limits = large_schema_limits(written)
        return _on_deep_stack(written.depth, lambda: self._compile_lark(spec, written.text, limits))

    def _structural_tag(self, spec: GrammarSpec) -> str:
        try:
            tag = structural_tag_json(spec, LLGUIDANCE_SUPPORT, self.options)
            return TagToLark(self.json_options()).convert(tag["format"])
        except GrammarError as error:
            raise error.with_context(kind=spec.kind, backend=NAME) from None

    def matcher(self, compiled: CompiledGrammar) -> LLGuidanceMatcher:
        if compiled.backend != NAME:
            raise ValueError(f"a grammar compiled by {compiled.backend} cannot run on {NAME}")
        return LLGuidanceMatcher(compiled.handle.fresh(), self.tokenizer_info, self.options, [])


class LLGuidanceMatcher:
    """One sequence's state over an llguidance grammar (see `Grammar`).

    Stop tokens never reach llguidance: one is accepted where llguidance says the output may
    end and only marks this matcher terminated (so its rollback is ours too). A refused token
    leaves llguidance as it was (`try_consume_tokens`); llguidance breaks down only on its
    resource limits, and then this matcher allows nothing and `violation` says why."""

    def __init__(
        self,
        matcher: Any,
        info: TokenizerInfo,
        options: GrammarOptions,
        history: list[int],
        terminated: bool = False,
    ) -> None:
        self._matcher = matcher
        self._info = info
        self._options = options
        self._history = history
        self._terminated = terminated
        self._scratch: Any = None
        # Bound once: these run for every token of every constrained request.
        self._consume = matcher.try_consume_tokens
        self._accepting = matcher.is_accepting
        self._write = matcher.unsafe_compute_mask_ptr
        self._broken = matcher.is_error
        self._size = info.vocab_size
        self._width = bitmask_width(info.vocab_size)
        self._stops = frozenset(info.stop_token_ids)

    @property
    def history(self) -> list[int]:
        """The accepted tokens, oldest first (read-only view for the jump-forward planner)."""
        return self._history

    def accept_token(self, token_id: int) -> bool:
        if self._terminated or not 0 <= token_id < self._size:
            return False
        if token_id in self._stops:
            if not self._accepting():
                return False
            self._terminated = True
        elif not self._consume([token_id]):
            return False
        self._history.append(token_id)
        return True

    def fill_bitmask(self, bitmask: Any, row: int = 0) -> None:
        if self._terminated:
            bitmask[row] = 0
            return
        if bitmask.shape[1] < self._width:
            raise ValueError(f"bitmask rows hold {bitmask.shape[1]} words, {self._width} needed")
        # The row's address without making a view (this runs for every token); int32 rows.
        if hasattr(bitmask, "data_ptr"):
            pointer = bitmask.data_ptr() + row * bitmask.stride(0) * 4
        else:
            pointer = bitmask.ctypes.data + row * bitmask.strides[0]
        # llguidance writes every word: ids past the tokenizer stay 0, stop bits are set
        # exactly where the output may end.
        self._write(pointer, self._width * 4)
        if self._broken():  # it would allow only the stop tokens, which are refused
            bitmask[row] = 0

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
            self._matcher.rollback(steps)
        del self._history[-num_tokens:]

    def jump_forward(self) -> JumpForward | None:
        # Not llguidance's compute_ff_tokens: it tokenizes the forced bytes on their own, after
        # the output's tokens (`{` then `"`, `name` where the tokenizer writes `{"`, `name`).
        # The planner tokenizes the end of the output together with them, as the tokenizer does.
        if self._terminated:
            return None
        forced = self._matcher.compute_ff_bytes()[: self._options.max_jump_forward_bytes]
        return plan_jump_forward(self, self._info, forced, self._options.jump_forward_window)

    def fork(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(
            self._matcher.deep_copy(),
            self._info,
            self._options,
            list(self._history),
            self._terminated,
        )

    def violation(self) -> Violation | None:
        """None, unless llguidance ran past one of its limits on this output (it then allows no
        token): a fatal violation saying so. Everything else the grammar enforces itself."""
        if not self._broken():
            return None
        reason = _first_line(self._matcher.get_error())
        return Violation(
            keyword="",
            pointer="",
            message=(
                "the constraint grew too complex for the llguidance backend at this point of "
                f"the output ({reason}); simplify it or use the xgrammar backend"
            ),
            rollback=0,
            fatal=True,
        )

    def allows_any(self, token_ids: list[int]) -> bool:
        if self._terminated:
            return False
        if self._scratch is None:
            self._scratch = torch.zeros((1, self._width), dtype=torch.int32)
        self.fill_bitmask(self._scratch, 0)
        words = self._scratch.numpy()[0]
        ids = numpy.asarray(token_ids, dtype=numpy.int64)
        return bool(((words[ids >> 5] >> (ids & 31)) & 1).any())


# -- errors -----------------------------------------------------------------------------------


def _on_deep_stack(depth: int, work: Callable[[], CompiledGrammar]) -> CompiledGrammar:
    """`work()` on a thread whose stack holds llguidance's recursion `depth` rules deep, or
    `GrammarError` when that stack would pass `_MAX_STACK`."""
    size = _STACK_BASE + depth * _STACK_PER_RULE
    if size > _MAX_STACK:
        deepest = (_MAX_STACK - _STACK_BASE) // _STACK_PER_RULE
        raise GrammarError(
            f"the JSON schema's rules nest up to {depth} deep through its references, more "
            f"than the llguidance backend compiles ({deepest}); simplify it (fewer $refs in a "
            "chain or in a cycle)",
            kind="json_schema",
            backend=NAME,
            keyword="$ref",
            limit="rule_depth",
        )
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as error:  # handed to the caller's thread
            outcome.append(error)

    with _STACK_LOCK:
        previous = threading.stack_size(size)
        try:
            thread = threading.Thread(target=run, name="llguidance-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]  # type: ignore[no-any-return]


def _problem(matcher: Any) -> str | None:
    if matcher.is_error():
        return str(matcher.get_error())
    warnings = matcher.get_grammar_warnings()
    # Only lenient modes warn (a keyword ignored, oneOf read as anyOf): never let one through.
    return "; ".join(warnings) if warnings else None


def _first_line(problem: str) -> str:
    """The first line of llguidance's message and, for Rust regex errors, the reason (on a
    line of its own after a picture of the pattern)."""
    lines = [part.strip() for part in problem.splitlines() if part.strip()]
    if not lines:
        return problem
    reasons = [part[len("error:") :].strip() for part in lines[1:] if part.startswith("error:")]
    return "; ".join([lines[0].rstrip(":"), *reasons])


def _grammar_error(spec: GrammarSpec, problem: str) -> GrammarError:
    """llguidance's complaint as a GrammarError that names the keyword where there is one
    (the normalizer refuses what llguidance lacks first; this is the backstop)."""
    line = _first_line(problem)
    keyword = limit = None
    schema = spec.kind in ("json_schema", "json_object")
    found = _UNIMPLEMENTED.search(problem)
    if found:
        keyword = found.group(1)
        message = (
            f"JSON schema: keyword {keyword!r} is not enforced by the llguidance backend, so it "
            "would be silently ignored; remove it or use another backend"
        )
    elif schema and _UNKNOWN_FORMAT.search(problem):
        keyword = "format"
        message = f"JSON schema: {line}; remove the format or use a pattern"
    elif schema and "patternProperty regexes" in problem:
        keyword = "patternProperties"
        message = (
            f"JSON schema: {line}; the llguidance backend needs patternProperties no property "
            "name matches two of; make the patterns disjoint"
        )
    elif schema and "min/maxProperties" in problem:
        keyword = "maxProperties"
        message = (
            f"JSON schema: {line} by the llguidance backend; list every property in required, "
            "or drop maxProperties"
        )
    elif schema and "float range" in problem:
        keyword = "minimum" if "min=Some" in problem else "maximum"
        message = (
            f"JSON schema: the llguidance backend cannot write this {keyword} as a pattern "
            f"({line}); use a bound of a smaller magnitude"
        )
    elif schema and "regex" in problem:
        keyword = "pattern"
        message = f"JSON schema: a pattern does not compile on llguidance: {line}"
    elif "schema too large" in problem:
        limit = _JSON_COMPILER_SIZE
        message = (
            f"the {spec.kind} constraint holds a JSON schema too large for llguidance's JSON "
            f"compiler ({line}); simplify it"
        )
    elif "symbols.len()" in problem:  # a grammar holds at most 65,535 symbols
        limit = "grammar_symbols"
        message = (
            f"the {spec.kind} constraint needs more grammar symbols than llguidance holds "
            "(65,535; a distinct optional property takes about two, repeated parts are shared); "
            "simplify it: fewer distinct properties, more shared $defs"
        )
    elif any(word in problem for word in ("too complex", "fuel", "limit", "too many")):
        message = (
            f"the {spec.kind} constraint is too large or too ambiguous for the llguidance "
            f"backend's limits ({line}); simplify it"
        )
    else:
        message = f"the {spec.kind} constraint does not compile on llguidance: {line}"
    return GrammarError(message, kind=spec.kind, backend=NAME, keyword=keyword, limit=limit)
