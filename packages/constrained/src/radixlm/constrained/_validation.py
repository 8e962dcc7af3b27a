"""Decode-time enforcement of the JSON Schema keywords no grammar can express.

The `auto` backend compiles such a schema relaxed (a grammar for a superset, see `_schema.py`)
and wraps the matcher in `ValidatingGrammar`. It follows the output token by token with a small
JSON scanner (`_json_scanner.py`), and as soon as a value closes (an array item, an object
member's name, an object, an array, a scalar, the document) it validates what the schema
requires of that value (`_schema_checks.py`: jsonschema-rs when installed, else `jsonschema`
for the schema's draft, with format checks):

- Where a value sits decides the subschemas it must meet: the *necessary* ones, reached from
  the root through `properties`, `patternProperties`, `additionalProperties`, `items`,
  `prefixItems`, `$ref` and `allOf` (never through `anyOf`, `oneOf`, `if`, `not`: what those
  require depends on the branch, and the enclosing value's check covers them). A value is
  checked when one of its subschemas, seen through its applicators, uses a deferred keyword.
- Array items are also checked against the array's `uniqueItems` / `maxContains` as each item
  closes, and member names against `propertyNames` as each name closes: a duplicate is caught
  at the item, not at the end of the array.
- The document is validated against the whole schema with `jsonschema` when it closes, so
  nothing that terminates is invalid.

On a violation the grammar reports `Violation(rollback=...)` back to the start of the
offending value, and bans writing the same bytes again from there (every token that would
complete them is masked, however the text is split into tokens), so the next attempt differs
(bans that would leave no token at all are lifted). Retries are
bounded per value and per sequence; then the violation is `fatal`.

Per token the cost is the scanner's: nothing but bookkeeping for a token inside a string or a
number, a few field updates and one small immutable snapshot (what `rollback` restores) for a
token that opens or closes something; values are parsed and checked only where a check needs
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixlm.constrained._json_scanner import (
    INITIAL,
    Failure,
    JsonScanner,
    Snapshot,
    json_pointer,
)
from radixlm.constrained._schema_checks import SchemaChecks, compiled_validator_available
from radixlm.constrained.bitmask import clear_tokens
from radixlm.constrained.interfaces import Grammar, JumpForward, Violation
from radixlm.constrained.tokenizer import TokenizerInfo

__all__ = ["SchemaChecks", "ValidatingGrammar", "compiled_validator_available"]

_KEEP_MASKS = 8  # ban masks cached per sequence


@dataclass(frozen=True, slots=True)
class _Ban:
    """While the output from byte `anchor_byte` on is a proper prefix of `rejected`, no token
    may complete `rejected` (dropped when the output is rolled back before token `anchor`)."""

    anchor: int
    anchor_byte: int
    rejected: bytes


class ValidatingGrammar:
    """A matcher for a relaxed schema plus the checks that make it exact (see module doc)."""

    def __init__(self, inner: Grammar, checks: SchemaChecks, info: TokenizerInfo) -> None:
        self._inner = inner
        self._checks = checks
        self._info = info
        self._stops = frozenset(info.stop_token_ids)
        self._token_bytes = info.token_bytes
        self._history: list[int] = []
        self._buffer = bytearray()
        self._scanner = JsonScanner(checks, self._buffer)
        self._snapshot = INITIAL  # the scanner's state now
        self._snapshots: list[Snapshot] = []  # the scanner's state after each token
        self._bans: list[_Ban] = []
        self._retries: dict[tuple[int, str], int] = {}
        self._total_retries = 0
        self._pending: Violation | None = None
        self._last_keyword = self._last_pointer = ""
        self._scratch: Any = None  # a one-row bitmask for _check_dead_end
        self._primed = False  # whether _scratch holds the banned mask of the current state
        self._keep_masks: dict[tuple[bytes, ...], Any] = {}
        self._route()

    # -- Grammar -----------------------------------------------------------------------------

    @property
    def history(self) -> list[int]:
        return self._history

    @property
    def committed(self) -> int:
        """Output tokens no violation can take back any more: those before the first open
        value whose check may fail (stream no further than this)."""
        return self._scanner.committed(len(self._history))

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
        data = self._token_bytes[token_id] or b""
        buffer = self._buffer
        start = len(buffer)
        buffer += data
        scanner = self._scanner
        try:
            changed = scanner.feed(data, start, position)
            if token_id in self._stops:
                scanner.finish(len(buffer))
                changed = True
        except Failure as failure:
            self._snapshot = scanner.snapshot()
            self._snapshots.append(self._snapshot)
            self._report(failure, position)
            self._route()
            return True
        if changed:
            self._snapshot = scanner.snapshot()
        self._snapshots.append(self._snapshot)
        if self._bans:
            self._check_dead_end()
        return True

    def _route(self) -> None:
        """With no violation pending and no bans, filling a mask is the inner matcher's alone:
        its bound method, set on this object, shadows `fill_bitmask` (one Python call less per
        token); else the method below decides."""
        if self._pending is None and not self._bans:
            self.fill_bitmask = self._inner.fill_bitmask  # type: ignore[method-assign]
        else:
            self.__dict__.pop("fill_bitmask", None)

    def fill_bitmask(self, bitmask: Any, row: int = 0) -> None:
        if self._pending is not None:
            bitmask[row] = 0
            return
        if not self._bans:
            self._inner.fill_bitmask(bitmask, row)
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
            self._route()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0 or num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._history)} tokens")
        self._pending = None
        if not num_tokens:
            return
        self._primed = False
        self._inner.rollback(num_tokens)
        keep = len(self._history) - num_tokens
        del self._buffer[self._end(keep) :]
        del self._history[keep:]
        del self._snapshots[keep:]
        self._snapshot = self._snapshots[-1] if self._snapshots else INITIAL
        self._scanner.restore(self._snapshot)
        self._bans = [ban for ban in self._bans if ban.anchor <= keep]
        self._route()

    def jump_forward(self) -> JumpForward | None:
        if self._pending is not None or self._active_bans():
            return None
        return self._inner.jump_forward()

    def fork(self) -> ValidatingGrammar:
        twin = ValidatingGrammar(self._inner.fork(), self._checks, self._info)
        twin._history = list(self._history)
        twin._buffer += self._buffer  # the twin's scanner reads this very bytearray
        twin._snapshots = list(self._snapshots)  # immutable, shared
        twin._snapshot = self._snapshot
        twin._scanner.restore(self._snapshot)
        twin._bans = list(self._bans)
        twin._retries = dict(self._retries)
        twin._total_retries = self._total_retries
        twin._pending = self._pending
        twin._route()
        return twin

    def check_invariants(self) -> None:
        """Raise AssertionError where the bookkeeping disagrees: one scanner snapshot per
        accepted token, the buffer the accepted tokens' bytes, the scanner in the state of the
        last snapshot, the mask filled by the inner matcher alone exactly when nothing is
        pending or banned. Changes nothing."""
        count = len(self._history)
        assert len(self._snapshots) == count, "one snapshot per token"
        written = b"".join(self._token_bytes[t] or b"" for t in self._history)
        assert bytes(self._buffer) == written, "buffer and tokens disagree"
        direct = "fill_bitmask" in self.__dict__
        assert direct == (self._pending is None and not self._bans), "stale fill route"
        assert self._snapshot == (self._snapshots[-1] if count else INITIAL), "stale snapshot"
        assert self._scanner.snapshot() == self._snapshot, "scanner and snapshot disagree"

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
        data = self._token_bytes[token_id] or b""
        size = len(self._buffer)
        return any(
            data.startswith(ban.rejected[size - ban.anchor_byte :]) for ban in self._active_bans()
        )

    def _end(self, count: int) -> int:
        """The buffer's length after the first `count` accepted tokens (counted back from the
        end: rollbacks and violations go back a few tokens)."""
        end = len(self._buffer)
        token_bytes = self._token_bytes
        for token_id in self._history[count:]:
            end -= len(token_bytes[token_id] or b"")
        return end

    # -- violations --------------------------------------------------------------------------

    def _report(self, failure: Failure, position: int) -> None:
        error = failure.error
        keyword = str(getattr(error, "validator", "") or "")
        relative = "".join(json_pointer("", p) for p in getattr(error, "absolute_path", ()))
        pointer = (failure.pointer + relative) or "/"
        text = str(getattr(error, "message", error))
        if len(text) > 200:
            text = text[:197] + "..."
        self._last_keyword, self._last_pointer = keyword, pointer
        start = failure.start_token
        self._count_retry(start, failure.pointer)
        anchor_byte = self._end(start)
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
