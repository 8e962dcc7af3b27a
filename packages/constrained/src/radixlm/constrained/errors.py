"""The errors of structured output: a bad constraint (a 400 upstream) and a missing backend."""

from __future__ import annotations

from radixlm.sampling import InvalidRequest

# Where each kind of constraint comes from in a request (SamplingParams field or response_format).
_FIELD_OF_KIND = {
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf": "ebnf",
    "structural_tag": "structural_tag",
    "choice": "choice",
    "json_object": "response_format",
}


class GrammarError(InvalidRequest):
    """A constraint that cannot be compiled or enforced as written.

    The message says what to change. `kind` is the grammar kind, `backend` the backend that
    refused it (None when no backend was involved yet), `keyword` the JSON Schema keyword at
    fault (None for other problems) and `path` a JSON pointer to where it sits in the schema.
    `limit` names the limit a constraint ran into (`"max_source_bytes"`, `"time_limit"`), so a
    server can name its own setting. It is an `InvalidRequest`, so servers answer it with 400.
    """

    def __init__(
        self,
        message: str,
        *,
        kind: str | None = None,
        backend: str | None = None,
        keyword: str | None = None,
        path: str | None = None,
        limit: str | None = None,
    ) -> None:
        self.kind = kind
        self.limit = limit
        self.backend = backend
        self.keyword = keyword
        self.path = path
        field = _FIELD_OF_KIND.get(kind or "", "")
        super().__init__(field, message)

    def with_context(self, *, kind: str | None = None, backend: str | None = None) -> GrammarError:
        """A copy with `kind` / `backend` filled in where they were unknown."""
        return GrammarError(
            self.message,
            kind=self.kind or kind,
            backend=self.backend or backend,
            keyword=self.keyword,
            path=self.path,
            limit=self.limit,
        )

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only arguments do not survive the default exception pickling.
        return (
            _rebuild,
            (self.message, self.kind, self.backend, self.keyword, self.path, self.limit),
        )


def _rebuild(
    message: str,
    kind: str | None,
    backend: str | None,
    keyword: str | None,
    path: str | None,
    limit: str | None = None,
) -> GrammarError:
    return GrammarError(
        message, kind=kind, backend=backend, keyword=keyword, path=path, limit=limit
    )


class BackendUnavailable(ImportError):
    """A grammar backend whose third-party package is not installed; the message says which
    extra to install."""
