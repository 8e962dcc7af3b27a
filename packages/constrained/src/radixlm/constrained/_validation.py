"""Decode-time enforcement of the JSON Schema keywords no grammar can express.

The `auto` backend compiles such a schema relaxed (a grammar for a superset, see `_schema.py`)
and wraps the matcher in `ValidatingGrammar`. It follows the output byte by byte with a small
JSON scanner, and as soon as a value closes (an array item, an object member's name, an
object, an array, a scalar, the document) it validates what the schema requires of that value
with `jsonschema` (for the schema's draft, with format checks):

- Where a value sits decides the subschemas it must meet: the *necessary* ones, reached from
  the root through `properties`, `patternProperties`, `additionalProperties`, `items`,
  `prefixItems`, `$ref` and `allOf` (never through `anyOf`, `oneOf`, `if`, `not`: what those
  require depends on the branch, and the enclosing value's check covers them). A value is
  checked when one of its subschemas, seen through its applicators, uses a deferred keyword.
- Array items are also checked against the array's `uniqueItems` / `maxContains` as each item
  closes, and member names against `propertyNames` as each name closes: a duplicate is caught
  at the item, not at the end of the array.
- The document is validated against the whole schema when it closes, so nothing that
  terminates is invalid.

On a violation the grammar reports `Violation(rollback=...)` back to the start of the
offending value, and bans writing the same bytes again from there (every token that would
complete them is masked, however the text is split into tokens), so the next attempt differs
(bans that would leave no token at all are lifted). Retries are
bounded per value and per sequence; then the violation is `fatal`.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from radixlm.constrained.bitmask import clear_tokens
from radixlm.constrained.interfaces import Grammar, JumpForward, Violation
from radixlm.constrained.tokenizer import TokenizerInfo

Schema = Any
Located = tuple[Schema, ...]

# Keywords through which a subschema applies to the same instance, necessarily.
_SAME_NECESSARY = ("allOf",)
# Subschemas whose values the scanner does not locate: a deferred keyword anywhere under them
# is checked when the value holding them closes.
_BRANCHES = (
    "anyOf",
    "oneOf",
    "if",
    "then",
    "else",
    "not",
    "dependentSchemas",
    "contains",
    "unevaluatedProperties",
    "unevaluatedItems",
    "propertyNames",
    "dependencies",
)
_WHITESPACE = frozenset(b" \t\n\r")
_NUMBER_BYTES = frozenset(b"0123456789+-.eE")
_LITERALS = {ord("t"): 4, ord("f"): 5, ord("n"): 4}
_KEEP_MASKS = 8  # ban masks cached per sequence


def compiled_validator_available() -> bool:
    """Whether jsonschema-rs (a compiled validator, the extra `fast-validation`) is installed:
    it then says whether each value is valid (about 0.2 µs where `jsonschema` takes 50), and
    `jsonschema` only explains the values it rejects and judges the finished document."""
    return _compiled_validators() is not None


@functools.cache
def _compiled_validators() -> Any:
    try:
        import jsonschema_rs
    except ImportError:
        return None
    return jsonschema_rs


# References the compiled validator resolves in a subschema compiled on its own: the root's
# definitions are copied beside it (anything else goes to `jsonschema`, which has the root).
_LOCAL_DEFINITION = re.compile(r'"\$ref":\s*"#/(\$defs|definitions)/')
_ANY_REFERENCE = re.compile(r'"\$(ref|dynamicRef|recursiveRef|id)"|"id":')


class SchemaChecks:
    """The original schema, its validator and what to check where. Immutable once built and
    shared by every matcher of one compiled grammar (caches fill under the GIL).

    `registry`: where references to other documents resolve (`schema_registry`, the
    grammar's); references left in `schema` are local once it is bundled (`_schema_bundle`)."""

    def __init__(
        self,
        schema: Any,
        deferred: frozenset[str],
        *,
        max_retries_per_value: int = 8,
        max_retries: int = 64,
        registry: Any = None,
    ) -> None:
        import jsonschema
        import referencing

        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        # The grammar's registry (`_schema_documents.schema_registry`): the same documents
        # behind the same references. A registry of its own (even an empty one: jsonschema
        # adds the metaschemas) keeps jsonschema from fetching anything.
        self.validator = cls(
            schema,
            format_checker=cls.FORMAT_CHECKER,
            registry=referencing.Registry() if registry is None else registry,
        )
        self.root = schema
        self.deferred = deferred
        self.max_retries_per_value = max_retries_per_value
        self.max_retries = max_retries
        self._children: dict[tuple[tuple[int, ...], str | int], Located] = {}
        self._validators: dict[int, Any] = {}
        self._item_rules: dict[tuple[int, ...], ItemRules | None] = {}
        self._needs: dict[tuple[int, ...], bool] = {}
        self._expanded: dict[int, list[Schema]] = {}
        self._compiled: dict[int, Any] = {}  # id(schema) -> jsonschema-rs validator or None

    # -- where a value sits ------------------------------------------------------------------

    def resolve(self, ref: Any) -> Schema:
        """A local `$ref` ("#", "#/..."), or None for references this cannot follow."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def expand(self, schema: Schema) -> list[Schema]:
        """`schema` and what applies to the same value necessarily ($ref, allOf), as dicts."""
        found = self._expanded.get(id(schema))
        if found is not None:
            return found
        out: list[Schema] = []
        stack = [schema]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            out.append(node)
            if "$ref" in node:
                stack.append(self.resolve(node["$ref"]))
            for key in _SAME_NECESSARY:
                if isinstance(node.get(key), list):
                    stack.extend(node[key])
        self._expanded[id(schema)] = out
        return out

    def child(self, located: Located, part: str | int) -> Located:
        """The necessary subschemas of a member (`part` a name) or an item (an index)."""
        key = (tuple(map(id, located)), part)
        found = self._children.get(key)
        if found is not None:
            return found
        out: list[Schema] = []
        for schema in located:
            for node in self.expand(schema):
                out.extend(self._child_of(node, part))
        result = tuple(s for s in out if isinstance(s, dict) and s)
        if isinstance(part, int) and len(self._children) > 50_000:
            self._children.clear()
        self._children[key] = result
        return result

    @staticmethod
    def _child_of(node: dict[str, Any], part: str | int) -> list[Schema]:
        import re

        if isinstance(part, str):
            found: list[Schema] = []
            props = node.get("properties")
            if isinstance(props, dict) and part in props:
                found.append(props[part])
            patterns = node.get("patternProperties")
            matched = False
            if isinstance(patterns, dict):
                for pattern, sub in patterns.items():
                    try:
                        if re.search(pattern, part):
                            found.append(sub)
                            matched = True
                    except re.error:
                        continue
            listed = isinstance(props, dict) and part in props
            extra = node.get("additionalProperties")
            if not listed and not matched and isinstance(extra, dict):
                found.append(extra)
            return found
        prefix = node.get("prefixItems")
        items = node.get("items")
        if isinstance(items, list):  # draft 7 tuples
            prefix, items = items, node.get("additionalItems")
        if isinstance(prefix, list) and part < len(prefix):
            return [prefix[part]]
        return [items] if isinstance(items, dict) else []

    def needs_check(self, located: Located) -> bool:
        """Whether a value at this place has a deferred keyword to check when it closes."""
        key = tuple(map(id, located))
        found = self._needs.get(key)
        if found is None:
            found = any(self._uses_deferred(s, set()) for s in located)
            self._needs[key] = found
        return found

    def _uses_deferred(self, schema: Schema, seen: set[int]) -> bool:
        """A deferred keyword applies to this very value: in the schema, through `$ref` and
        `allOf`, or anywhere under a branch (`anyOf`, `not`, ...) or a subschema whose values
        are not located (`contains`, `unevaluated*`), since those are checked only here."""
        if not isinstance(schema, dict) or id(schema) in seen:
            return False
        seen.add(id(schema))
        if self.deferred & schema.keys():
            return True
        if "$ref" in schema and self._uses_deferred(self.resolve(schema["$ref"]), seen):
            return True
        if any(self._uses_deferred(b, seen) for b in _as_list(schema.get("allOf"))):
            return True
        for key in _BRANCHES:
            if key in schema and self._deep_uses_deferred(schema[key], set()):
                return True
        return False

    def _deep_uses_deferred(self, node: Any, seen: set[int]) -> bool:
        """A deferred keyword anywhere under `node`, `$ref`s followed."""
        stack = [node]
        while stack:
            item = stack.pop()
            if id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, dict):
                if self.deferred & item.keys():
                    return True
                if isinstance(item.get("$ref"), str):
                    stack.append(self.resolve(item["$ref"]))
                stack.extend(v for k, v in item.items() if k not in ("enum", "const"))
            elif isinstance(item, list):
                stack.extend(item)
        return False

    def item_rules(self, located: Located) -> ItemRules | None:
        """What every prefix of an array here must meet (uniqueItems, maxContains), or None."""
        key = tuple(map(id, located))
        if key not in self._item_rules:
            self._item_rules[key] = self._make_item_rules(located)
        return self._item_rules[key]

    def _make_item_rules(self, located: Located) -> ItemRules | None:
        unique = False
        limits: list[tuple[Schema, int]] = []
        for schema in located:
            for node in self.expand(schema):
                unique = unique or node.get("uniqueItems") is True
                limit = node.get("maxContains")
                if "contains" in node and isinstance(limit, int) and not isinstance(limit, bool):
                    limits.append((node["contains"], limit))
        return ItemRules(unique, tuple(limits)) if unique or limits else None

    def name_rules(self, located: Located) -> list[Schema]:
        """The `propertyNames` schemas every member name of an object here must meet."""
        return [
            node["propertyNames"]
            for schema in located
            for node in self.expand(schema)
            if "propertyNames" in node
        ]

    # -- checking ----------------------------------------------------------------------------

    def compiled(self, schema: Schema) -> Any:
        """A jsonschema-rs validator for `schema` (a subschema of the root, which it needs for
        its local `$ref`s), or None where it is not installed or cannot stand in for
        `jsonschema` (references that leave the root's definitions, ids, a schema it
        refuses). It never fetches a document: it is built offline."""
        key = id(schema)
        if key in self._compiled:
            return self._compiled[key]
        found = None
        rs = _compiled_validators()
        if rs is not None and isinstance(schema, dict):
            found = self._build_compiled(rs, schema)
        self._compiled[key] = found
        return found

    def _build_compiled(self, rs: Any, schema: Schema) -> Any:
        text = json.dumps(schema)
        if _ANY_REFERENCE.search(text):
            if schema is self.root or len(_ANY_REFERENCE.findall(text)) != len(
                _LOCAL_DEFINITION.findall(text)
            ):
                return None
            schema = dict(schema)
            for container in ("$defs", "definitions"):
                if container in self.root and container not in schema:
                    schema[container] = self.root[container]
        if isinstance(self.root, dict) and "$schema" in self.root:
            schema = {**schema, "$schema": self.root["$schema"]}
        try:
            return rs.validator_for(schema, validate_formats=True, offline=True)
        except Exception:  # a schema it cannot compile: jsonschema checks it
            return None

    def first_error(
        self, value: Any, schemas: Located | list[Schema], *, final: bool = False
    ) -> Any:
        """The most relevant `jsonschema` error of `value` against `schemas`, or None. With
        jsonschema-rs installed it says first whether the value is valid; `final` (the
        finished document) always goes through `jsonschema`, the reference."""
        from jsonschema.exceptions import best_match

        for schema in schemas:
            fast = None if final else self.compiled(schema)
            if fast is not None:
                try:
                    if fast.is_valid(value):
                        continue
                except (ArithmeticError, ValueError, OverflowError):
                    pass  # jsonschema says why
            validator = self._validators.get(id(schema))
            if validator is None:
                validator = self._validators[id(schema)] = self.validator.evolve(schema=schema)
            try:
                error = best_match(validator.iter_errors(value))
            except (ArithmeticError, ValueError, RecursionError) as caught:
                # e.g. multipleOf of a number that overflowed to infinity: not a valid value.
                return _NotJson(f"the value cannot be checked: {caught}")
            if error is not None:
                return error
        return None


@dataclass(frozen=True, slots=True)
class ItemRules:
    """What an array's items must meet as each closes: all distinct (`uniqueItems`, with
    JSON equality: 1 == 1.0, true != 1), and at most `limit` matching `schema` for each
    (`contains`, `maxContains`). Checked item by item, never by revalidating the prefix."""

    unique: bool
    max_contains: tuple[tuple[Schema, int], ...]


def _canonical(value: Any) -> Any:
    """A hashable stand-in for a JSON value; equal exactly when the values are equal in JSON
    Schema's sense (numbers by value, booleans apart from numbers, objects unordered)."""
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int | float):
        return ("n", value)
    if isinstance(value, str):
        return ("s", value)
    if isinstance(value, list):
        return ("a", tuple(_canonical(v) for v in value))
    if isinstance(value, dict):
        return ("o", frozenset((k, _canonical(v)) for k, v in value.items()))
    return ("z", None)


@dataclass(slots=True)
class _Frame:
    """An open object or array."""

    is_object: bool
    located: Located
    pointer: str
    start_byte: int
    start_token: int
    checked: bool
    holds: bool  # a violation found when this value closes may take it back
    item_rules: ItemRules | None = None
    name_rules: list[Schema] = field(default_factory=list)
    index: int = 0  # the next item's index (arrays)
    key: str | None = None  # the member being written (objects)
    expect_key: bool = True  # objects: a name comes next (else a value)
    seen: frozenset[Any] = frozenset()  # uniqueItems: the items so far, canonical
    counts: tuple[int, ...] = ()  # maxContains: items so far matching each `contains`


@dataclass(slots=True)
class _Scalar:
    kind: str  # "s" string, "n" number, "l" literal
    start_byte: int
    start_token: int
    is_key: bool = False
    escaped: bool = False
    left: int = 0  # literal bytes still to come


@dataclass(slots=True)
class _State:
    stack: list[_Frame]
    scalar: _Scalar | None
    done: bool  # the document closed


def _copy(state: _State) -> _State:
    frames = [
        _Frame(
            f.is_object,
            f.located,
            f.pointer,
            f.start_byte,
            f.start_token,
            f.checked,
            f.holds,
            f.item_rules,
            f.name_rules,
            f.index,
            f.key,
            f.expect_key,
            f.seen,
            f.counts,
        )
        for f in state.stack
    ]
    scalar = state.scalar
    if scalar is not None:
        scalar = _Scalar(
            scalar.kind,
            scalar.start_byte,
            scalar.start_token,
            scalar.is_key,
            scalar.escaped,
            scalar.left,
        )
    return _State(frames, scalar, state.done)


@dataclass(frozen=True, slots=True)
class _Ban:
    """While the output from byte `anchor_byte` on is a proper prefix of `rejected`, no token
    may complete `rejected` (dropped when the output is rolled back before token `anchor`)."""

    anchor: int
    anchor_byte: int
    rejected: bytes


class _Failure(Exception):
    def __init__(self, start_token: int, last_byte: int, error: Any, pointer: str) -> None:
        self.start_token = start_token
        self.last_byte = last_byte
        self.error = error
        self.pointer = pointer


def _pointer(base: str, part: str | int) -> str:
    text = str(part).replace("~", "~0").replace("/", "~1")
    return f"{base}/{text}"


class ValidatingGrammar:
    """A matcher for a relaxed schema plus the checks that make it exact (see module doc)."""

    def __init__(self, inner: Grammar, checks: SchemaChecks, info: TokenizerInfo) -> None:
        self._inner = inner
        self._checks = checks
        self._info = info
        self._stops = frozenset(info.stop_token_ids)
        self._history: list[int] = []
        self._buffer = bytearray()
        self._ends: list[int] = []  # buffer length after each token
        self._states: list[_State] = []  # scanner state after each token
        self._state = self._initial()
        self._bans: list[_Ban] = []
        self._retries: dict[tuple[int, str], int] = {}
        self._total_retries = 0
        self._pending: Violation | None = None
        self._last_keyword = self._last_pointer = ""
        self._scratch: Any = None  # a one-row bitmask for _check_dead_end
        self._primed = False  # whether _scratch holds the banned mask of the current state
        self._keep_masks: dict[tuple[bytes, ...], Any] = {}

    def _initial(self) -> _State:
        return _State([], None, False)

    # -- Grammar -----------------------------------------------------------------------------

    @property
    def history(self) -> list[int]:
        return self._history

    @property
    def committed(self) -> int:
        """Output tokens no violation can take back any more: those before the first open
        value whose check may fail (stream no further than this)."""
        state = self._state
        starts = [frame.start_token for frame in state.stack if frame.holds]
        scalar = state.scalar
        if scalar is not None and not scalar.is_key:
            located, _ = self._child_place(state)
            if located and self._checks.needs_check(located):
                starts.append(scalar.start_token)
        if state.stack and state.stack[-1].is_object and state.stack[-1].name_rules:
            starts.append(state.stack[-1].start_token)
        return min(starts, default=len(self._history))

    @property
    def rollbacks(self) -> int:
        return self._total_retries

    def violation(self) -> Violation | None:
        return self._pending

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()

    def accept_token(self, token_id: int) -> bool:
        self._primed = False
        if self._pending is not None or (self._bans and self._banned(token_id)):
            return False
        if not self._inner.accept_token(token_id):
            return False
        position = len(self._history)
        self._history.append(token_id)
        start = len(self._buffer)
        data = self._info.token_bytes[token_id] or b""
        self._buffer += data
        self._ends.append(len(self._buffer))
        if self._leaves_state_alone(data):  # most tokens: inside a string or a number
            self._states.append(self._state)
            if self._bans:
                self._check_dead_end()
            return True
        state = _copy(self._state)
        try:
            for offset, byte in enumerate(data):
                self._feed(state, byte, start + offset, position)
            if token_id in self._stops:
                self._finish(state, len(self._buffer), position)
        except _Failure as failure:
            self._states.append(state)
            self._state = state
            self._report(failure, position)
            return True
        self._states.append(state)
        self._state = state
        if self._bans:
            self._check_dead_end()
        return True

    def _leaves_state_alone(self, data: bytes) -> bool:
        """Whether feeding `data` would change nothing but the buffer: string contents without
        quotes or escapes, or more digits of a number."""
        scalar = self._state.scalar
        if scalar is None or not data or scalar.escaped:
            return False
        if scalar.kind == "s":
            return b'"' not in data and b"\\" not in data
        return scalar.kind == "n" and not data.strip(b"0123456789+-.eE")

    def fill_bitmask(self, bitmask: Any, row: int = 0) -> None:
        if self._pending is not None:
            bitmask[row] = 0
            return
        bans = self._active_bans()
        if bans and self._primed:  # _check_dead_end filled the mask for this very state
            bitmask[row] = self._scratch[0]
            return
        self._inner.fill_bitmask(bitmask, row)
        if not bans:
            return
        bitmask[row] &= self._keep_mask(bans)
        if not bool(bitmask[row].any()):
            # The bans leave nothing: lift them (the value may come out the same again, and
            # the retry limit then ends the request).
            self._bans = [ban for ban in self._bans if ban not in bans]
            self._inner.fill_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0 or num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._history)} tokens")
        self._pending = None
        if not num_tokens:
            return
        self._primed = False
        self._inner.rollback(num_tokens)
        keep = len(self._history) - num_tokens
        del self._history[keep:]
        del self._states[keep:]
        del self._ends[keep:]
        del self._buffer[self._ends[-1] if self._ends else 0 :]
        self._state = self._states[-1] if self._states else self._initial()
        self._bans = [ban for ban in self._bans if ban.anchor <= keep]

    def jump_forward(self) -> JumpForward | None:
        if self._pending is not None or self._active_bans():
            return None
        return self._inner.jump_forward()

    def fork(self) -> ValidatingGrammar:
        twin = ValidatingGrammar(self._inner.fork(), self._checks, self._info)
        twin._history = list(self._history)
        twin._buffer = bytearray(self._buffer)
        twin._ends = list(self._ends)
        twin._states = list(self._states)
        twin._state = self._state
        twin._bans = list(self._bans)
        twin._retries = dict(self._retries)
        twin._total_retries = self._total_retries
        twin._pending = self._pending
        return twin

    def allows_any(self, token_ids: list[int]) -> bool:
        host = getattr(self._inner, "allows_any", None)
        return bool(host(token_ids)) if host is not None else True

    # -- bans --------------------------------------------------------------------------------

    def _active_bans(self) -> list[_Ban]:
        """The bans whose rejected bytes the output is on its way to write again."""
        if not self._bans:
            return []
        buffer = self._buffer
        size = len(buffer)
        return [
            ban
            for ban in self._bans
            if size - ban.anchor_byte < len(ban.rejected)
            and ban.rejected.startswith(bytes(buffer[ban.anchor_byte :]))
        ]

    def _keep_mask(self, bans: list[_Ban]) -> Any:
        """A bitmask row without the tokens that would complete a ban's rejected bytes from
        here (cached by those bytes: the same rests come back on every retry)."""
        size = len(self._buffer)
        rests = tuple(sorted({ban.rejected[size - ban.anchor_byte :] for ban in bans}))
        cache = self._keep_masks
        keep = cache.get(rests)
        if keep is None:
            from radixlm.constrained.bitmask import allocate_bitmask

            ids: set[int] = set()
            for rest in rests:
                ids.update(self._info.tokens_starting_with(rest))
            keep = allocate_bitmask(1, self._info.vocab_size)[0]
            clear_tokens(keep, sorted(ids))
            if len(cache) >= _KEEP_MASKS:
                cache.pop(next(iter(cache)))
            cache[rests] = keep
        return keep

    def _check_dead_end(self) -> None:
        """When the bans leave no token here, what was written since the ban's anchor is
        doomed too: reject it (roll back to the anchor and ban it) as a violation would."""
        bans = self._active_bans()
        if not bans:
            return
        from radixlm.constrained.bitmask import allocate_bitmask

        if self._scratch is None:
            self._scratch = allocate_bitmask(1, self._info.vocab_size)
        self._inner.fill_bitmask(self._scratch, 0)
        row = self._scratch[0]
        row &= self._keep_mask(bans)
        if bool(row.any()):
            self._primed = True
            return
        ban = min(bans, key=lambda b: b.anchor)
        doomed = bytes(self._buffer[ban.anchor_byte :])
        if not doomed:
            return  # nothing to take back: the fill lifts the bans, the retry limit ends it
        self._bans.append(_Ban(ban.anchor, ban.anchor_byte, doomed))
        self._count_retry(ban.anchor, self._last_pointer)
        self._pending = self._violation(
            self._last_keyword,
            self._last_pointer,
            "every continuation repeats a rejected value",
            len(self._history) - ban.anchor,
        )

    def _banned(self, token_id: int) -> bool:
        data = self._info.token_bytes[token_id] or b""
        size = len(self._buffer)
        return any(
            data.startswith(ban.rejected[size - ban.anchor_byte :]) for ban in self._active_bans()
        )

    # -- violations --------------------------------------------------------------------------

    def _report(self, failure: _Failure, position: int) -> None:
        error = failure.error
        keyword = str(getattr(error, "validator", "") or "")
        relative = "".join(_pointer("", p) for p in getattr(error, "absolute_path", ()))
        pointer = (failure.pointer + relative) or "/"
        text = str(getattr(error, "message", error))
        if len(text) > 200:
            text = text[:197] + "..."
        self._last_keyword, self._last_pointer = keyword, pointer
        start = failure.start_token
        self._count_retry(start, failure.pointer)
        anchor_byte = self._ends[start - 1] if start else 0
        self._bans.append(
            _Ban(start, anchor_byte, bytes(self._buffer[anchor_byte : failure.last_byte + 1]))
        )
        self._pending = self._violation(keyword, pointer, text, len(self._history) - start)

    def _count_retry(self, start: int, pointer: str) -> None:
        key = (start, pointer)
        self._retries[key] = self._retries.get(key, 0) + 1
        self._total_retries += 1

    def _violation(self, keyword: str, pointer: str, text: str, rollback: int) -> Violation:
        checks = self._checks
        worst = max(self._retries.values(), default=0)
        if worst > checks.max_retries_per_value or self._total_retries > checks.max_retries:
            return Violation(
                keyword=keyword,
                pointer=pointer,
                rollback=0,
                fatal=True,
                message=(
                    f"the output kept breaking the JSON schema's {keyword!r} keyword at "
                    f"{pointer} ({text}); gave up after {self._total_retries} retries: relax "
                    "that keyword or use a model that follows the schema"
                ),
            )
        return Violation(
            keyword=keyword,
            pointer=pointer,
            rollback=rollback,
            message=f"the value at {pointer} breaks {keyword!r}: {text}",
        )

    # -- the scanner -------------------------------------------------------------------------

    def _feed(self, state: _State, byte: int, at: int, token: int) -> None:
        scalar = state.scalar
        if scalar is not None:
            if scalar.kind == "s":
                if scalar.escaped:
                    scalar.escaped = False
                elif byte == 0x5C:  # backslash
                    scalar.escaped = True
                elif byte == 0x22:  # closing quote
                    state.scalar = None
                    self._close_scalar(state, scalar, at + 1)
                return
            if scalar.kind == "l":
                scalar.left -= 1
                if scalar.left == 0:
                    state.scalar = None
                    self._close_scalar(state, scalar, at + 1)
                return
            if byte in _NUMBER_BYTES:
                return
            state.scalar = None
            self._close_scalar(state, scalar, at)
        if byte in _WHITESPACE:
            return
        frame = state.stack[-1] if state.stack else None
        if byte == 0x3A:  # ":"
            if frame is not None:
                frame.expect_key = False
            return
        if byte == 0x2C:  # ","
            if frame is not None and frame.is_object:
                frame.expect_key = True
            return
        if byte in (0x7D, 0x5D):  # "}" or "]"
            if frame is not None:
                state.stack.pop()
                self._closed(
                    state,
                    frame.start_byte,
                    frame.start_token,
                    at + 1,
                    frame.checked,
                    frame.located,
                    frame.pointer,
                )
            return
        if frame is not None and frame.is_object and frame.expect_key and byte == 0x22:
            state.scalar = _Scalar("s", at, token, is_key=True)
            return
        located, pointer = self._child_place(state)
        holds = self._checks.needs_check(located) if located else False
        # The document is checked when it closes anyway, as a safety net: every deferred
        # keyword is also checked at the value it applies to.
        checked = holds or not state.stack
        if byte in (0x7B, 0x5B):  # "{" or "["
            is_object = byte == 0x7B
            checks = self._checks
            state.stack.append(
                _Frame(
                    is_object,
                    located,
                    pointer,
                    at,
                    token,
                    checked,
                    holds,
                    item_rules=None if is_object else checks.item_rules(located),
                    name_rules=checks.name_rules(located) if is_object else [],
                )
            )
        elif byte == 0x22:
            state.scalar = _Scalar("s", at, token)
        elif byte in _LITERALS:
            state.scalar = _Scalar("l", at, token, left=_LITERALS[byte] - 1)
        else:
            state.scalar = _Scalar("n", at, token)

    def _child_place(self, state: _State) -> tuple[Located, str]:
        if not state.stack:
            return (self._checks.root,), ""
        frame = state.stack[-1]
        part: str | int = frame.key if frame.is_object and frame.key is not None else frame.index
        if not frame.located:
            return (), _pointer(frame.pointer, part)
        return self._checks.child(frame.located, part), _pointer(frame.pointer, part)

    def _close_scalar(self, state: _State, scalar: _Scalar, end: int) -> None:
        if scalar.is_key:
            frame = state.stack[-1]
            name = self._parse(scalar.start_byte, end, scalar.start_token, frame.pointer)
            frame.key = name
            if frame.name_rules:
                error = self._checks.first_error(name, frame.name_rules)
                if error is not None:
                    raise _Failure(
                        scalar.start_token, end - 1, error, _pointer(frame.pointer, name)
                    )
            return
        located, pointer = self._child_place(state)
        checked = (self._checks.needs_check(located) if located else False) or not state.stack
        self._closed(state, scalar.start_byte, scalar.start_token, end, checked, located, pointer)

    def _closed(
        self,
        state: _State,
        start_byte: int,
        start_token: int,
        end: int,
        checked: bool,
        located: Located,
        pointer: str,
    ) -> None:
        """A value spanning buffer[start_byte:end] closed."""
        value: Any = None
        parsed = False
        if checked:
            value = self._parse(start_byte, end, start_token, pointer)
            parsed = True
            schemas = located if state.stack else (self._checks.root,)
            error = self._checks.first_error(value, schemas, final=not state.stack)
            if error is not None:
                raise _Failure(start_token, end - 1, error, pointer)
        if not state.stack:
            state.done = True
            return
        parent = state.stack[-1]
        if parent.is_object:
            parent.key = None
            return
        parent.index += 1
        rules = parent.item_rules
        if rules is not None:
            if not parsed:
                value = self._parse(start_byte, end, start_token, pointer)
            self._check_item(parent, rules, value, start_token, end, pointer)

    def _check_item(
        self, array: _Frame, rules: ItemRules, item: Any, start_token: int, end: int, pointer: str
    ) -> None:
        if rules.unique:
            key = _canonical(item)
            if key in array.seen:
                error = _NotJson("the item repeats an earlier item", "uniqueItems")
                raise _Failure(start_token, end - 1, error, pointer)
            array.seen = array.seen | {key}
        if rules.max_contains:
            counts = list(array.counts or (0,) * len(rules.max_contains))
            for number, (schema, limit) in enumerate(rules.max_contains):
                if self._checks.first_error(item, [schema]) is not None:
                    continue
                counts[number] += 1
                if counts[number] > limit:
                    text = f"more than {limit} items (maxContains) match 'contains'"
                    raise _Failure(start_token, end - 1, _NotJson(text, "maxContains"), pointer)
            array.counts = tuple(counts)

    def _parse(
        self, start: int, end: int, start_token: int, pointer: str, tail: bytes = b""
    ) -> Any:
        """The JSON value in buffer[start:end] (+ tail); output that is not JSON (invalid
        UTF-8 a backend let through) is a violation like any other."""
        try:
            return json.loads(bytes(self._buffer[start:end]) + tail)
        except ValueError as error:
            raise _Failure(start_token, end - 1, _NotJson(str(error)), pointer) from None

    def _finish(self, state: _State, end: int, token: int) -> None:
        """The stop token: a number still open at the end of the document closes."""
        scalar = state.scalar
        if scalar is not None and scalar.kind == "n":
            state.scalar = None
            self._close_scalar(state, scalar, end)


@dataclass(frozen=True, slots=True)
class _NotJson:
    """Stands in for a jsonschema error: bytes that are not JSON at all, or a failed check
    made here rather than by jsonschema (an item's `uniqueItems`, `maxContains`)."""

    message: str
    validator: str = "type"
    absolute_path: tuple[str, ...] = ()


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
