"""Running engine iterators for one HTTP request: several at once, merged; closed whatever happens
(client gone, error, cancellation); SSE framing and a response that notices a disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from radixlm.sampling import GenerateChunk

T = TypeVar("T")
_END = object()

DONE_EVENT = "data: [DONE]\n\n"


# A logprob of -inf (a token the grammar or a bias rules out) is sent as this, as vLLM does:
# JSON has no infinities.
LOGPROB_FLOOR = -9999.0


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (LOGPROB_FLOOR if value < 0 else -LOGPROB_FLOOR)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def to_json(payload: Any) -> str:
    """Compact, strict JSON: non-finite floats become LOGPROB_FLOOR (or null for NaN)."""
    try:
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(_finite(payload), ensure_ascii=False, separators=(",", ":"))


class EngineJSONResponse(JSONResponse):
    """JSONResponse that survives the infinities engines put in logprobs."""

    def render(self, content: Any) -> bytes:
        return to_json(content).encode("utf-8")


def sse(payload: Any) -> str:
    """One server-sent event carrying `payload` as compact JSON."""
    return f"data: {to_json(payload)}\n\n"


async def close_iterator(iterator: object) -> None:
    """`aclose()` an async iterator if it has one (async generators do)."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        # RuntimeError: "aclose(): asynchronous generator is already running"; its task unwinds it.
        with contextlib.suppress(RuntimeError):
            await aclose()


class EngineStreams:
    """Consumes several engine iterators concurrently; yields `(stream index, chunk)`.

    `start()` waits until every stream has produced its first chunk (or ended) and re-raises the
    first error any of them raised before that, so a route can still answer 400/503 before it
    commits to a 200. Errors after the start are raised from iteration. `aclose()` cancels
    every stream still running, which closes its engine iterator (the engine aborts the
    request); it is idempotent and safe to call from a cancelled task.
    """

    def __init__(self, factories: Iterable[Callable[[], AsyncIterator[GenerateChunk]]]) -> None:
        self._factories = list(factories)
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._started = [asyncio.Event() for _ in self._factories]
        self._start_errors: list[BaseException | None] = [None] * len(self._factories)
        self._tasks: list[asyncio.Task[None]] = []
        self._open = len(self._factories)
        self._closed = False

    async def _pump(self, index: int) -> None:
        iterator: AsyncIterator[GenerateChunk] | None = None
        started = self._started[index]
        try:
            iterator = self._factories[index]()
            async for chunk in iterator:
                started.set()
                self._queue.put_nowait((index, chunk))
            started.set()
            self._queue.put_nowait((index, _END))
        except Exception as error:
            if started.is_set():
                self._queue.put_nowait((index, error))
            else:
                self._start_errors[index] = error
                started.set()
        finally:
            if iterator is not None:
                with anyio.CancelScope(shield=True):
                    await close_iterator(iterator)

    async def start(self) -> None:
        """Start every stream; wait for each one's first chunk. Raises the first early error."""
        self._tasks = [asyncio.ensure_future(self._pump(i)) for i in range(len(self._factories))]
        try:
            for index, event in enumerate(self._started):
                await event.wait()
                error = self._start_errors[index]
                if error is not None:
                    raise error
        except BaseException:
            await self.aclose()
            raise

    def __aiter__(self) -> EngineStreams:
        return self

    async def __anext__(self) -> tuple[int, GenerateChunk]:
        while self._open > 0:
            index, item = await self._queue.get()
            if item is _END:
                self._open -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, GenerateChunk)
            return index, item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*self._tasks, return_exceptions=True)


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` that stops (and closes its body iterator, hence the engine request)
    as soon as the client disconnects, whatever the ASGI server's spec version."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], status_code: int = 200) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, status_code=status_code, headers=headers)
        self._content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await close_iterator(self._content)


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientDisconnected) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
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
    with anyio.CancelScope(shield=True):
        await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()
