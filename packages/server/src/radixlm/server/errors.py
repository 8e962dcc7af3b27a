"""OpenAI-shaped errors: one exception type for the routes and handlers that map every failure
to `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixlm.sampling import EngineOverloaded, EngineUnavailable, InvalidRequest

logger = logging.getLogger("radixlm.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error a route answers with: HTTP status, message, and the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "api_error")

    @classmethod
    def from_invalid(cls, error: InvalidRequest, param_prefix: str = "") -> APIError:
        """A 400 naming the offending field (prefixed, e.g. `sampling_params.`)."""
        param = (
            f"{param_prefix}{error.field}" if error.field else (param_prefix.rstrip(".") or None)
        )
        return cls(400, str(error), param=param or None, code="invalid_request")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def response(self) -> JSONResponse:
        headers = None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        elif self.status == 503:
            # Overloaded, or the engine (or a replica) is down or restarting: retryable.
            headers = {"Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


#: Seconds a client is told to wait (`Retry-After`) before retrying a 503.
RETRY_AFTER_S = 1


def body_too_large(limit: int) -> APIError:
    """The 413 for a request body over the server's `--max-request-bytes`."""
    return APIError(
        413,
        f"the request body is larger than this server's limit of {limit:,} bytes; send a "
        "smaller one, or start the server with a larger --max-request-bytes",
        code="request_too_large",
    )


class BodyTooLarge(StarletteHTTPException):
    """Raised while a body is read, once more than `limit` bytes of it have arrived; answered
    with `body_too_large(limit)`. An HTTPException, so that FastAPI's own body parsing (routes
    with a body parameter) lets it through unchanged."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, body_too_large(limit).message)
        self.limit = limit


def overloaded(error: EngineOverloaded) -> APIError:
    message = str(error) or "the server is overloaded; retry later"
    return APIError(503, message, code="overloaded")


def unavailable(error: EngineUnavailable) -> APIError:
    """The 503 for an engine that stopped serving (its process died, it shut down)."""
    message = str(error) or "the engine is not serving; retry once /health answers 200"
    return APIError(503, message, code="engine_unavailable", type="server_error")


def invalid_json(error: json.JSONDecodeError | UnicodeDecodeError) -> APIError:
    return APIError(400, f"the request body is not valid JSON: {error}", code="invalid_json")


def as_api_error(error: BaseException) -> APIError | None:
    """The APIError for an exception a user can cause, or None for a genuine server fault."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequest):
        return APIError.from_invalid(error)
    if isinstance(error, ValidationError):
        return APIError.from_invalid(InvalidRequest.from_validation_error(error))
    if isinstance(error, EngineOverloaded):
        return overloaded(error)
    if isinstance(error, EngineUnavailable):
        return unavailable(error)
    return None


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    parts: list[str] = []
    first: str | None = None
    for item in error.errors():
        where = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
        first = first or where or None
        message = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts) or "invalid request", first


def _counted(request: Request, response: JSONResponse) -> JSONResponse:
    """Count an error answer in the app's metrics, when it has them."""
    state = getattr(request.app.state, "radixlm", None)
    metrics = getattr(state, "metrics", None)
    if metrics is not None:
        metrics.errors.labels(status=str(response.status_code)).inc()
    return response


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception to an OpenAI error object; nothing a client sends becomes a 500."""

    async def on_api_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, APIError)
        return _counted(request, error.response())

    async def on_invalid(request: Request, error: Exception) -> JSONResponse:
        mapped = as_api_error(error)
        assert mapped is not None
        return _counted(request, mapped.response())

    async def on_request_validation(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        message, param = _validation_message(error)
        response = APIError(400, message, param=param, code="invalid_request").response()
        return _counted(request, response)

    async def on_too_large(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, BodyTooLarge)
        return _counted(request, body_too_large(error.limit).response())

    async def on_http(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, StarletteHTTPException)
        status = error.status_code
        if status == 404:
            message = f"no route {request.method} {request.url.path}; see /docs for the API"
        else:
            message = str(error.detail) or HTTPStatus(status).phrase
        response = APIError(status, message).response()
        if error.headers:
            response.headers.update(error.headers)
        return _counted(request, response)

    async def on_unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        message = f"internal server error: {type(error).__name__}: {error}"
        return _counted(request, APIError(500, message).response())

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(InvalidRequest, on_invalid)
    app.add_exception_handler(EngineOverloaded, on_invalid)
    app.add_exception_handler(EngineUnavailable, on_invalid)
    app.add_exception_handler(ValidationError, on_invalid)
    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(BodyTooLarge, on_too_large)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
