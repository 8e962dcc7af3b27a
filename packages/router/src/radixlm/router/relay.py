"""Passing a worker's answer through the HTTP router, and the errors the router answers with
itself (needs the `http` extra)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("radixlm.router.proxy")

#: Headers that belong to one connection, not to the message (RFC 9110 7.6.1), and the ones
#: httpx or the server recompute.
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
     "trailers", "transfer-encoding", "upgrade", "host", "content-length"}
)  # fmt: skip


class RouterError(Exception):
    """An error the router answers with itself, shaped as the workers' errors are."""

    def __init__(self, status: int, message: str, code: str, worker: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.worker = status, message, code, worker

    def response(self) -> JSONResponse:
        error: dict[str, Any] = {
            "message": self.message,
            "type": "invalid_request_error" if self.status < 500 else "server_error",
            "param": None,
            "code": self.code,
        }
        if self.worker is not None:
            error["worker"] = self.worker
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse({"error": error}, status_code=self.status, headers=headers)


def worker_failed(role: str, worker: str, error: Exception) -> RouterError:
    """The 502 (504 on a timeout) for a worker the router could not get an answer from."""
    timeout = isinstance(error, httpx.TimeoutException)
    what = "did not answer in time" if timeout else "could not be reached"
    detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return RouterError(
        504 if timeout else 502,
        f"the {role} worker {worker} {what} ({detail})",
        code=f"{role}_worker_failed" if role != "regular" else "worker_failed",
        worker=worker,
    )


class ProxiedStream(StreamingResponse):
    """A worker's answer passed through; `close` runs however the response ends (finished,
    failed, or the client gone before the body started)."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        upstream: httpx.Response,
        close: Callable[[], Awaitable[None]],
    ) -> None:
        super().__init__(body, status_code=upstream.status_code, headers=answer_headers(upstream))
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


async def passthrough(upstream: httpx.Response, worker: str) -> AsyncIterator[bytes]:
    """The worker's body as it arrives; a stream the worker breaks off ends with an error
    event (a plain body just ends)."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as error:
        logger.warning("worker %s broke off its answer: %s", worker, error)
        if is_event_stream(upstream):
            yield error_event(f"the worker {worker} broke off its answer ({error!r})", worker)


def is_event_stream(response: httpx.Response) -> bool:
    return str(response.headers.get("content-type", "")).startswith("text/event-stream")


def error_event(message: str, worker: str | None, status: int = 502) -> bytes:
    """An SSE error event and the end of the stream, as radixlm's servers end a stream that
    fails under way."""
    error: dict[str, Any] = {"message": message, "type": "server_error", "param": None}
    error["code"] = status
    if worker is not None:
        error["worker"] = worker
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()


async def until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`; if the client goes away first, cancel it (closing the connection to the
    worker, which aborts the request there) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()


class ClientGone(Exception):
    """The client closed its connection before the answer began."""


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def request_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}


def answer_headers(answer: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_BY_HOP}
