"""The errors a program or a backend raises, each naming what failed and what to change."""

from __future__ import annotations


class BackendError(RuntimeError):
    """A backend could not serve a call: the server answered with an error, or timed out.

    `status` is the HTTP status when there was one.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        self.status = status
        super().__init__(message)


class BackendUnavailable(BackendError, ConnectionError):
    """The backend cannot be reached at all (nothing listening, DNS, refused connection)."""


class UnsupportedFeature(BackendError):
    """The backend cannot do what the program asked (a regex on an API chat model, ...)."""


class ProgramError(RuntimeError):
    """A primitive of an LM program failed.

    `primitive` names it as written in the program (`gen('answer')`, `select('related')`);
    `text` is the program's text up to the failure; the original exception is `__cause__`.
    """

    def __init__(self, primitive: str, cause: BaseException, text: str = "") -> None:
        self.primitive = primitive
        self.cause = cause
        self.text = text
        detail = str(cause) or type(cause).__name__
        super().__init__(f"{primitive} failed: {detail}")
        self.__cause__ = cause
