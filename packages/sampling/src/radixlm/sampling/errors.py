"""The one error type for bad input, and its translation from pydantic's validation errors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

_TYPE_TAGS = {"str", "int", "float", "bool", "bytes", "none", "dict", "list", "is-instance"}


def _is_type_tag(part: object) -> bool:
    """pydantic names union members in error locations (`list[int]`, `function-after[...]`)."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


@dataclass(frozen=True)
class FieldError:
    """One problem with one field: `field` is a dotted path (`sampling_params.top_p`)."""

    field: str
    message: str


class InvalidRequest(ValueError):
    """A request a user sent that cannot be served as is.

    `field` names the (first) offending field and `message` says what to change; `errors` holds
    every problem found. Servers map it to HTTP 400.
    """

    def __init__(self, field: str, message: str, errors: Sequence[FieldError] = ()) -> None:
        self.field = field
        self.message = message
        self.errors: tuple[FieldError, ...] = tuple(errors) or (FieldError(field, message),)
        super().__init__(str(self))

    def __str__(self) -> str:
        return "; ".join(f"{e.field}: {e.message}" if e.field else e.message for e in self.errors)

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised in an engine process and re-raised in the front one: pickle by fields.
        return (type(self), (self.field, self.message, self.errors))

    @classmethod
    def from_validation_error(cls, error: ValidationError, prefix: str = "") -> InvalidRequest:
        """Turn pydantic's error list into an InvalidRequest naming each field."""
        found: list[FieldError] = []
        for item in error.errors(include_url=False):
            where = [prefix] if prefix else []
            where += [str(p) for p in item["loc"] if not _is_type_tag(p)]
            original = item.get("ctx", {}).get("error")
            if isinstance(original, InvalidRequest):
                # Our own checks know which field inside this location to blame.
                problems = [(".".join([*where, e.field]), e.message) for e in original.errors]
            elif item["type"] == "extra_forbidden":
                problems = [
                    (".".join(where), "unknown field; remove it (see the documented fields)")
                ]
            else:
                # Messages raised by our own validators arrive as "Value error, <text>".
                problems = [(".".join(where), str(item["msg"]).removeprefix("Value error, "))]
            for field, message in problems:
                if all(f.field != field for f in found):
                    found.append(FieldError(field, message))
        first = found[0] if found else FieldError(prefix, "invalid value")
        return cls(first.field, first.message, found)


class EngineOverloaded(RuntimeError):
    """An engine refuses new work because its queue is full; servers answer 503.

    Defined here, beside InvalidRequest, so that engines and servers share it without
    depending on each other.
    """


class EngineUnavailable(RuntimeError):
    """The engine stopped serving (its process died, a step failed for good, it shut down):
    the request ended without its output. Servers answer 503; retry once it is healthy."""
