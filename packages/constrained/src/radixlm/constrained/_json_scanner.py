"""The incremental JSON scanner behind `auto`'s validation: it follows the output token by
token and checks each value as it closes (see `_validation.py`).

Its state is a few fields for the innermost open object or array, the scalar being written,
and a persistent stack: each enclosing object or array is an immutable tuple, saved when its
child opened (a parent cannot change while a child is open). So `snapshot()` is one small
tuple, the same object for every token that changed nothing, and `restore()` makes a rollback
exact without copying the stack at every token. Inside a string a token is skipped with
`bytes.find` for the next quote or backslash, not byte by byte; member names and string values
without escapes are decoded without `json.loads`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from radixlm.constrained._schema_checks import ItemRules, NotJson, Place, SchemaChecks, canonical

_WHITESPACE = frozenset(b" \t\n\r")
_NUMBER_TEXT = b"0123456789+-.eE"
_NUMBER_BYTES = frozenset(_NUMBER_TEXT)
_LITERALS = {ord("t"): 4, ord("f"): 5, ord("n"): 4}
# What json.loads refuses unescaped inside a string.
_CONTROL = re.compile("[\x00-\x1f]")
# What is being written outside objects and arrays (`JsonScanner.scalar`): None, or
# (kind, first byte, first token) with kind one of these.
_KEY, _STRING, _NUMBER, _LITERAL = "key", "string", "number", "literal"
Scalar = tuple[str, int, int]

# The scanner's state, as `JsonScanner.snapshot` gives it: top, key, index, expect_key, seen,
# counts, below, scalar, skip, done. `below` is (top, key, index, expect_key, seen, counts,
# below) of the enclosing object or array, or None.
Snapshot = tuple[Any, ...]
INITIAL: Snapshot = (None, None, 0, True, frozenset(), (), None, None, 0, False)


class Failure(Exception):
    """A value broke its checks: the token it starts in, its last byte, the error (jsonschema's
    or a `NotJson`) and its JSON pointer."""

    def __init__(self, start_token: int, last_byte: int, error: Any, pointer: str) -> None:
        self.start_token = start_token
        self.last_byte = last_byte
        self.error = error
        self.pointer = pointer


class Open:
    """An open object or array: what stays the same while it is open. Immutable."""

    __slots__ = (
        "checked",
        "holds",
        "is_object",
        "item_rules",
        "name_rules",
        "place",
        "pointer",
        "start_byte",
        "start_token",
    )

    def __init__(
        self,
        is_object: bool,
        place: Place,
        pointer: str,
        start_byte: int,
        start_token: int,
        checked: bool,
        holds: bool,
    ) -> None:
        self.is_object = is_object
        self.place = place
        self.pointer = pointer
        self.start_byte = start_byte
        self.start_token = start_token
        self.checked = checked  # validated when it closes
        self.holds = holds  # a violation found when it closes may take it back
        self.item_rules: ItemRules | None = None if is_object else place.item_rules
        self.name_rules: list[Any] = place.name_rules if is_object else []


def json_pointer(base: str, part: str | int) -> str:
    text = str(part).replace("~", "~0").replace("/", "~1")
    return f"{base}/{text}"


class JsonScanner:
    """Follows one JSON document in `buffer` (the output's bytes, which its owner extends) and
    checks each value as it closes against `checks`. `feed` raises `Failure`; the state is
    then as far as the scan got (its owner rolls it back)."""

    __slots__ = (
        "below",
        "buffer",
        "checks",
        "counts",
        "done",
        "expect_key",
        "index",
        "key",
        "scalar",
        "seen",
        "skip",
        "top",
    )

    def __init__(self, checks: SchemaChecks, buffer: bytearray) -> None:
        self.checks = checks
        self.buffer = buffer
        self.top: Open | None = None  # the innermost open object or array
        self.key: str | None = None  # objects: the member being written
        self.index = 0  # arrays: the next item's index
        self.expect_key = True  # objects: a name comes next (else a value)
        self.seen: frozenset[Any] = frozenset()  # uniqueItems: the items so far, canonical
        self.counts: tuple[int, ...] = ()  # maxContains: items so far matching each `contains`
        self.below: Snapshot | None = None  # the enclosing objects and arrays, saved
        self.scalar: Scalar | None = None  # the scalar (or member name) being written
        # Bytes of the scalar to pass over unread: 1 after a backslash in a string, the rest
        # of a literal (true, false, null).
        self.skip = 0
        self.done = False  # the document closed

    # -- state -------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The state, immutable: `restore` brings it back however far the scan went on."""
        return (
            self.top,
            self.key,
            self.index,
            self.expect_key,
            self.seen,
            self.counts,
            self.below,
            self.scalar,
            self.skip,
            self.done,
        )

    def restore(self, snapshot: Snapshot) -> None:
        (
            self.top,
            self.key,
            self.index,
            self.expect_key,
            self.seen,
            self.counts,
            self.below,
            self.scalar,
            self.skip,
            self.done,
        ) = snapshot

    def committed(self, length: int) -> int:
        """The first token of an open value whose check may still fail (`length` if none)."""
        starts = []
        top = self.top
        saved = self.below
        frame = top
        while frame is not None:
            if frame.holds:
                starts.append(frame.start_token)
            frame, saved = (saved[0], saved[6]) if saved is not None else (None, None)
        scalar = self.scalar
        if scalar is not None and scalar[0] != _KEY and self._place_here().needs_check:
            starts.append(scalar[2])
        if top is not None and top.is_object and top.name_rules:
            starts.append(top.start_token)
        return min(starts, default=length)

    # -- scanning ----------------------------------------------------------------------------

    def feed(self, data: bytes, start: int, token: int) -> bool:
        """Follow `data`, the bytes of output token `token`, written at buffer offset `start`;
        False when that changed nothing (most tokens: string contents without a quote or a
        backslash, more bytes of a number), so the last snapshot still holds."""
        scalar = self.scalar
        if scalar is not None and data and not self.skip:
            if scalar[0] == _NUMBER:
                if not data.strip(_NUMBER_TEXT):
                    return False
            elif 0x22 not in data and 0x5C not in data:  # (ints: far faster than b'"' here)
                return False
        at = 0
        size = len(data)
        while at < size:
            if scalar is not None:
                kind = scalar[0]
                skip = self.skip
                if skip:
                    taken = min(skip, size - at)
                    at += taken
                    self.skip = skip = skip - taken
                    if skip or kind != _LITERAL:
                        continue
                elif kind == _NUMBER:
                    while data[at] in _NUMBER_BYTES:  # a number ends at the first other byte
                        at += 1
                        if at == size:
                            return True
                else:  # a string or a member name: on to its next quote or backslash
                    quote = data.find(0x22, at)
                    slash = -1
                    if 0x5C in data:  # (rare: an escape)
                        slash = data.find(0x5C, at, size if quote < 0 else quote)
                    if slash >= 0:
                        self.skip = 1
                        at = slash + 1
                        continue
                    if quote < 0:
                        return True
                    at = quote + 1
                self.scalar = None
                if kind == _KEY:
                    self._name_closed(scalar, start + at)
                else:
                    self._value_closed(scalar, start + at)
                scalar = None
                if kind != _NUMBER:
                    continue
            byte = data[at]
            at += 1
            if byte == 0x22:  # '"'
                top = self.top
                if top is not None and top.is_object and self.expect_key:
                    scalar = (_KEY, start + at - 1, token)
                else:
                    scalar = (_STRING, start + at - 1, token)
                self.scalar = scalar
            elif byte == 0x3A:  # ":"
                if self.top is not None:
                    self.expect_key = False
            elif byte == 0x2C:  # ","
                top = self.top
                if top is not None and top.is_object:
                    self.expect_key = True
            elif byte in _WHITESPACE:
                pass
            elif byte == 0x7B or byte == 0x5B:  # "{" or "["
                self._push(byte == 0x7B, start + at - 1, token)
            elif byte == 0x7D or byte == 0x5D:  # "}" or "]"
                if self.top is not None:
                    self._pop(start + at)
            elif byte in _LITERALS:
                self.scalar = scalar = (_LITERAL, start + at - 1, token)
                self.skip = _LITERALS[byte] - 1
            else:
                self.scalar = scalar = (_NUMBER, start + at - 1, token)
        return True

    def finish(self, end: int) -> None:
        """The stop token: a number still open at the end of the document closes."""
        scalar = self.scalar
        if scalar is not None and scalar[0] == _NUMBER:
            self.scalar = None
            self._value_closed(scalar, end)

    def _place_here(self) -> Place:
        """The place of the value being written."""
        top = self.top
        if top is None:
            return self.checks.root_place
        key = self.key
        return top.place.child(key if top.is_object and key is not None else self.index)

    def _push(self, is_object: bool, start_byte: int, token: int) -> None:
        top = self.top
        if top is None:
            place, pointer = self.checks.root_place, ""
        else:
            key = self.key
            part = key if top.is_object and key is not None else self.index
            place, pointer = top.place.child(part), json_pointer(top.pointer, part)
        # The document is checked when it closes anyway, as a safety net: every deferred
        # keyword is also checked at the value it applies to.
        holds = place.needs_check
        opened = Open(is_object, place, pointer, start_byte, token, holds or top is None, holds)
        self.below = (
            top,
            self.key,
            self.index,
            self.expect_key,
            self.seen,
            self.counts,
            self.below,
        )
        self.top = opened
        self.key = None
        self.index = 0
        self.expect_key = True
        self.seen = frozenset()
        self.counts = ()

    def _pop(self, end: int) -> None:
        closed = self.top
        assert closed is not None and self.below is not None
        (
            self.top,
            self.key,
            self.index,
            self.expect_key,
            self.seen,
            self.counts,
            self.below,
        ) = self.below
        self._closed(
            closed.start_byte, closed.start_token, end, closed.checked, closed.place, closed.pointer
        )

    def _name_closed(self, scalar: Scalar, end: int) -> None:
        top = self.top
        assert top is not None
        name = self._plain_string(scalar[1], end)
        if name is None:
            name = self._parse(scalar[1], end, scalar[2], top.pointer)
        self.key = name
        if top.name_rules:
            error = self.checks.first_error(name, top.name_rules)
            if error is not None:
                raise Failure(scalar[2], end - 1, error, json_pointer(top.pointer, name))

    def _value_closed(self, scalar: Scalar, end: int) -> None:
        top = self.top
        if top is None:  # the document is a scalar
            self._closed(scalar[1], scalar[2], end, True, self.checks.root_place, "")
            return
        key = self.key
        part = key if top.is_object and key is not None else self.index
        place = top.place.children.get(part) or top.place.child(part)
        if place.needs_check or top.item_rules is not None:
            pointer = json_pointer(top.pointer, part)
            self._closed(scalar[1], scalar[2], end, place.needs_check, place, pointer)
        elif top.is_object:  # what `_closed` does for a value that needs nothing
            self.key = None
        else:
            self.index += 1

    def _closed(
        self, start_byte: int, start_token: int, end: int, checked: bool, place: Place, pointer: str
    ) -> None:
        """A value spanning buffer[start_byte:end], at `place`, closed."""
        value: Any = None
        parsed = False
        top = self.top
        if checked:
            value = self._parse(start_byte, end, start_token, pointer)
            parsed = True
            if top is None:
                error = self.checks.first_error(
                    value,
                    self.checks.root_place.located,
                    final=True,
                    text=bytes(self.buffer[start_byte:end]),
                )
            else:
                error = self.checks.first_error(value, place.located)
            if error is not None:
                raise Failure(start_token, end - 1, error, pointer)
        if top is None:
            self.done = True
            return
        if top.is_object:
            self.key = None
            return
        self.index += 1
        rules = top.item_rules
        if rules is not None:
            if not parsed:
                value = self._parse(start_byte, end, start_token, pointer)
            self._check_item(rules, value, start_token, end, pointer)

    def _check_item(
        self, rules: ItemRules, item: Any, start_token: int, end: int, pointer: str
    ) -> None:
        if rules.unique:
            key = canonical(item)
            if key in self.seen:
                error = NotJson("the item repeats an earlier item", "uniqueItems")
                raise Failure(start_token, end - 1, error, pointer)
            self.seen = self.seen | {key}
        if rules.max_contains:
            counts = list(self.counts or (0,) * len(rules.max_contains))
            for number, (schema, limit) in enumerate(rules.max_contains):
                if self.checks.first_error(item, [schema]) is not None:
                    continue
                counts[number] += 1
                if counts[number] > limit:
                    text = f"more than {limit} items (maxContains) match 'contains'"
                    raise Failure(start_token, end - 1, NotJson(text, "maxContains"), pointer)
            self.counts = tuple(counts)

    def _parse(self, start: int, end: int, start_token: int, pointer: str) -> Any:
        """The JSON value in buffer[start:end]; output that is not JSON (invalid UTF-8 a
        backend let through) is a violation like any other. A string without escapes or
        control characters is decoded directly, as json.loads would."""
        buffer = self.buffer
        if buffer[start] == 0x22:
            text = self._plain_string(start, end)
            if text is not None:
                return text
        try:
            return json.loads(bytes(buffer[start:end]))
        except ValueError as error:
            raise Failure(start_token, end - 1, NotJson(str(error)), pointer) from None

    def _plain_string(self, start: int, end: int) -> str | None:
        """The string in buffer[start:end] (quotes included) when it has no escape and json.loads
        would take it (no control character, valid UTF-8): what json.loads would return, for a
        fraction of the time; else None."""
        raw = self.buffer[start + 1 : end - 1]
        if 0x5C in raw:
            return None
        try:
            text = raw.decode("utf-8", "surrogatepass")  # as json.loads decodes bytes
        except UnicodeDecodeError:
            return None
        if text.isprintable() or _CONTROL.search(text) is None:
            return text
        return None
