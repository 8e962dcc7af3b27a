"""The one error type for bad input, and its translation from pydantic's validation errors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError


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

    @classmethod
    def from_validation_error(cls, error: ValidationError, prefix: str = "") -> InvalidRequest:
        """Turn pydantic's error list into an InvalidRequest naming each field."""
        found: list[FieldError] = []
        for item in error.errors(include_url=False):
            original = item.get("ctx", {}).get("error")
            if isinstance(original, InvalidRequest):
                # Our own cross-field checks know which field to blame.
                found += [
                    FieldError(".".join(p for p in (prefix, e.field) if p), e.message)
                    for e in original.errors
                ]
                continue
            parts = [prefix] if prefix else []
            parts += [str(p) for p in item["loc"]]
            message = str(item["msg"])
            # Messages raised by our own validators arrive as "Value error, <text>".
            message = message.removeprefix("Value error, ")
            if item["type"] == "extra_forbidden":
                message = "unknown field; remove it (check the spelling against the documented fields)"
            found.append(FieldError(".".join(parts), message))
        first = found[0] if found else FieldError(prefix, "invalid value")
        return cls(first.field, first.message, found)
