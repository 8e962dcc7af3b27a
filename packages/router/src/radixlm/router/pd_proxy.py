"""One request over a prefill/decode pair (the HTTP router's PD mode; needs the `http` extra).

The body, with the bootstrap fields (`radixlm.router.bodies.with_bootstrap`), goes to both
workers at once. While the decode worker has not answered, a failed prefill (an error status,
a connection error, an error inside its 200 answer) aborts the decode request and its error
is the client's answer. Once the decode worker answers, its status, headers and body are the
client's, byte for byte; a stream still watches the prefill request, and should that fail
first, the stream ends with the prefill's error event. A decode worker that fails (an error
status, or no answer: a 502 naming it) aborts the prefill request. Aborting a request closes
the connection to the worker (which aborts it there) and posts `/abort_request` with its rid.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from radixlm.router.bodies import answer_error, error_status, request_ids, with_bootstrap
from radixlm.router.keys import BodyKey
from radixlm.router.relay import (
    ClientGone,
    ProxiedStream,
    RouterError,
    answer_headers,
    error_event,
    is_event_stream,
    passthrough,
    wait_for_disconnect,
    worker_failed,
)
from radixlm.router.workers import NoWorkerAvailable

if TYPE_CHECKING:
    from radixlm.router.proxy import HttpRouter

logger = logging.getLogger("radixlm.router.proxy")


@dataclass(frozen=True)
class PrefillFailure:
    """The prefill half failed: what the client gets instead of the decode worker's answer."""

    status: int
    content: bytes
    media_type: str = "application/json"

    def response(self) -> Response:
        return Response(self.content, self.status, media_type=self.media_type)

    @property
    def message(self) -> str:
        error = answer_error(self.content)
        if error is not None and error.get("message"):
            return str(error["message"])
        return self.content.decode("utf-8", errors="replace")[:500] or f"HTTP {self.status}"

    @classmethod
    def of(cls, error: RouterError) -> PrefillFailure:
        return cls(error.status, bytes(error.response().body))


class PDExchange:
    """The two halves of one request, from the choice of the pair to the end of the answer."""

    def __init__(
        self,
        router: HttpRouter,
        route: str,
        body: dict[str, Any],
        key: BodyKey,
        headers: dict[str, str],
    ) -> None:
        self.router = router
        self.route = route
        self.headers = headers
        self.prefill_pool, self.decode_pool = router.pools["prefill"], router.pools["decode"]
        try:
            # The decode side first: its policy keeps no record, the prefill side's may.
            self.decode = self.decode_pool.choose(key.key, key.namespace)
            self.prefill = self.prefill_pool.choose(key.key, key.namespace)
        except NoWorkerAvailable as error:
            raise RouterError(503, str(error), "no_worker") from None
        self.body = with_bootstrap(route, body, self.prefill)
        self.rids = request_ids(self.body)
        self.payload = json.dumps(self.body).encode()
        self.completed = False  # the decode worker's answer reached the client whole
        self._decode_open = False
        self._prefill_task: asyncio.Task[PrefillFailure | None] | None = None

    async def run(self, request: Request) -> Response:
        """Send both halves; the client's response (the decode worker's, or an error)."""
        self.prefill_pool.begin(self.prefill.url)
        self.decode_pool.begin(self.decode.url)
        self._decode_open = True
        self.router.track(self.rids, [self.prefill, self.decode])
        prefill = self._prefill_task = self.router.spawn(self._prefill())
        sent = asyncio.ensure_future(
            self.router.send(self.decode, self.route, self.payload, self.headers)
        )
        watcher = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            while not sent.done():
                waiting = {sent, watcher} | ({prefill} if not prefill.done() else set())
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if sent.done():
                    break
                if watcher.done():
                    raise ClientGone()
                failure = self.prefill_failure()
                if failure is not None:
                    logger.warning(
                        "prefill worker %s failed (%s); aborting the decode request on %s",
                        self.prefill.url, failure.message, self.decode.url,
                    )  # fmt: skip
                    await self._drop_decode(sent)
                    return failure.response()
        except BaseException:
            await self._drop_decode(sent)
            await self._stop_prefill()
            raise
        finally:
            watcher.cancel()
        return await self._answer(sent)

    async def _answer(self, sent: asyncio.Future[httpx.Response]) -> Response:
        """The decode worker's answer (its headers have arrived), or its failure."""
        url = self.decode.url
        try:
            upstream = sent.result()
            if upstream.status_code != 200:
                try:
                    content = await upstream.aread()
                finally:
                    await upstream.aclose()
                logger.warning("decode worker %s answered %d", url, upstream.status_code)
                self._end_decode()
                await self._stop_prefill()
                return Response(content, upstream.status_code, headers=answer_headers(upstream))
        except httpx.HTTPError as error:
            if isinstance(error, httpx.ConnectError):
                self.decode_pool.mark_unreachable(url)
            self._end_decode()
            await self._stop_prefill()
            raise worker_failed("decode", url, error) from None
        except BaseException:
            self._end_decode()
            await self._stop_prefill()
            raise

        async def close() -> None:
            await upstream.aclose()
            self._end_decode()
            if not self.completed:  # the client went away: the prefill half goes too
                await self._stop_prefill()

        return ProxiedStream(self._relay(upstream), upstream, close)

    async def _relay(self, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """The decode worker's body; a stream ends early with the prefill's error event if
        the prefill fails before it ends."""
        chunks = passthrough(upstream, self.decode.url).__aiter__()
        prefill = self._prefill_task
        assert prefill is not None
        watching = is_event_stream(upstream)
        while watching:
            if prefill.done():
                failure = self.prefill_failure()
                if failure is not None:
                    await upstream.aclose()
                    await self.router.abort(self.decode, self.rids)
                    yield error_event(
                        f"the prefill worker {self.prefill.url} failed: {failure.message}",
                        self.prefill.url,
                        failure.status,
                    )
                    return
                break
            step = asyncio.ensure_future(chunks.__anext__())
            try:
                await asyncio.wait({step, prefill}, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:  # the client went away
                step.cancel()
                raise
            if not step.done() and self.prefill_failure() is not None:
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                continue  # reported at the top of the loop
            try:
                chunk = await step
            except StopAsyncIteration:
                self.completed = True
                return
            yield chunk
        async for chunk in chunks:
            yield chunk
        self.completed = True

    async def _prefill(self) -> PrefillFailure | None:
        """Send the prefill half and read its answer to the end: None if it is no error."""
        url = self.prefill.url
        client = self.router.client
        try:
            async with client.stream(
                "POST", url + self.route, content=self.payload, headers=self.headers
            ) as answer:
                content = await answer.aread()
        except httpx.HTTPError as error:
            if isinstance(error, httpx.ConnectError):
                self.prefill_pool.mark_unreachable(url)
            failure = PrefillFailure.of(worker_failed("prefill", url, error))
            logger.warning("prefill worker %s failed: %s", url, failure.message)
            return failure
        finally:
            self.prefill_pool.end(url)
        if answer.status_code != 200:
            media_type = answer.headers.get("content-type", "application/json")
            return PrefillFailure(answer.status_code, content, media_type)
        inside = answer_error(content)
        if inside is not None:
            return PrefillFailure(error_status(inside), json.dumps({"error": inside}).encode())
        return None

    def prefill_failure(self) -> PrefillFailure | None:
        """The prefill half's failure, once it has ended with one."""
        task = self._prefill_task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.result()

    async def _drop_decode(self, sent: asyncio.Future[httpx.Response]) -> None:
        """Abort the decode half: close its connection, post its abort, end it."""
        if not self._decode_open:
            return
        sent.cancel()
        (result,) = await asyncio.gather(sent, return_exceptions=True)
        if isinstance(result, httpx.Response):
            await result.aclose()
        await self.router.abort(self.decode, self.rids)
        self._end_decode()

    async def _stop_prefill(self) -> None:
        """Abort the prefill half if it still runs."""
        task = self._prefill_task
        if task is None or task.done():
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await self.router.abort(self.prefill, self.rids)

    def _end_decode(self) -> None:
        if self._decode_open:
            self._decode_open = False
            self.decode_pool.end(self.decode.url)
            self.router.untrack(self.rids)
