"""The HTTP router: one address in front of radixlm (or SGLang) worker servers.

Needs the `http` extra (`pip install "radixlm-router[http]"`: fastapi, uvicorn, httpx);
`radixlm-router` (`radixlm.router.cli`) serves `create_router_app(config)` with uvicorn.

- Regular mode: each `/generate`, `/v1/completions` and `/v1/chat/completions` request goes to
  one worker picked by the pool's policy (`cache_aware` keys the prompt's text bytes, a chat's
  messages rendered to a stable string: `radixlm.router.keys.body_key`), and the worker's
  answer — streamed or not — comes back byte for byte. A worker that refuses the connection
  is taken out of routing and the request goes to another.
- PD mode (prefill/decode disaggregation, SGLang's contract, see `radixlm.router.bodies`): the
  same body with the bootstrap fields goes to a prefill worker (`prefill_policy`, cache-aware
  by default) and a decode worker (`decode_policy`, fewest in flight by default) at once; the
  client gets the decode worker's answer. The prefill worker's answer is read and dropped
  unless it is an error: then the decode request is aborted and the client gets that error.
  A decode worker that fails gets its own error back to the client (a 502 naming it when it
  cannot be reached), and the prefill request is aborted.
- `/health` (200 while every pool has a worker in routing), `/v1/models` and
  `/get_model_info` (from a worker), `/get_server_info` (the router's state and each worker's
  own), `/list_workers`, `/flush_cache` (every worker), `/abort_request` (where the rid runs).

Workers are health-checked in the background (`radixlm.router.workers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import httpx
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixlm.router._version import __version__
from radixlm.router.bodies import request_ids
from radixlm.router.keys import BodyKey, body_key
from radixlm.router.pd_proxy import PDExchange
from radixlm.router.relay import (
    ClientGone,
    ProxiedStream,
    RouterError,
    passthrough,
    request_headers,
    until_disconnected,
    worker_failed,
)
from radixlm.router.workers import NoWorkerAvailable, RouterConfig, WorkerPool, WorkerSpec

logger = logging.getLogger("radixlm.router.proxy")

#: The routes that generate, proxied to a worker the policy picks (a PD pair in PD mode).
GENERATE_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
#: Seconds an abort or a worker's info may take.
_SIDE_CALL_TIMEOUT_S = 5.0


class HttpRouter:
    """The router's state: the worker pools, the HTTP client to the workers, the requests in
    flight by rid, and the health checks."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pools: dict[str, WorkerPool] = config.pools()
        self._client: httpx.AsyncClient | None = None
        self._running: dict[str, list[WorkerSpec]] = {}  # rid -> workers it runs on
        self._tasks: set[asyncio.Task[Any]] = set()  # work the router outlives the request for
        self._health_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------------ lifecycle

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("the router is not started (serve it with its lifespan)")
        return self._client

    async def start(self) -> None:
        """Open the client, check every worker once (so that those up are routed to from the
        first request), then keep checking in the background."""
        timeout = httpx.Timeout(
            self.config.request_timeout_s, connect=self.config.connect_timeout_s
        )
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        # Bodies pass through undecoded: a worker compresses only for a client that asks.
        headers = {"accept-encoding": "identity"}
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers)
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        tasks = [t for t in (self._health_task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -------------------------------------------------------------------------- health

    async def check_health(self) -> None:
        """Check every worker that is due (`WorkerPool.due`), all at once."""
        due = [(pool, url) for pool in self.pools.values() for url in pool.due()]
        await asyncio.gather(*(self._check(pool, url) for pool, url in due))

    async def _check(self, pool: WorkerPool, url: str) -> None:
        health = self.config.health
        try:
            answer = await self.client.get(url + health.endpoint, timeout=health.timeout_s)
            ok = answer.status_code == 200
        except httpx.HTTPError:
            ok = False
        was = pool.healthy(url)
        first = pool.never_checked(url)
        pool.record_check(url, ok)
        if first:
            logger.info("%s worker %s: %s", pool.role, url, "serving" if ok else "not serving yet")
        elif pool.healthy(url) != was:
            state = "back in routing" if not was else "out of routing (failed health checks)"
            logger.warning("%s worker %s is %s", pool.role, url, state)

    async def _health_loop(self) -> None:
        tick = min(self.config.health.interval_s, 1.0)
        while True:
            await asyncio.sleep(tick)
            try:
                await self.check_health()
            except Exception:  # keep checking whatever one round hit
                logger.exception("health check round failed")

    @property
    def serving(self) -> bool:
        """Every pool has a worker in routing."""
        return all(pool.serving for pool in self.pools.values())

    # ------------------------------------------------------------------- bookkeeping

    def track(self, rids: Iterable[str], workers: list[WorkerSpec]) -> None:
        for rid in rids:
            self._running[rid] = workers

    def untrack(self, rids: Iterable[str]) -> None:
        for rid in rids:
            self._running.pop(rid, None)

    def _end(self, pool: WorkerPool, worker: WorkerSpec, rids: Iterable[str]) -> None:
        pool.end(worker.url)
        self.untrack(rids)

    def spawn(self, work: Awaitable[Any]) -> asyncio.Task[Any]:
        """A task the router keeps a reference to until it ends (cancelled on shutdown)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def abort(self, worker: WorkerSpec, rids: Iterable[str]) -> None:
        """`POST /abort_request` for each rid on the worker (failures logged, not raised)."""
        for rid in rids:
            try:
                await self.client.post(
                    worker.url + "/abort_request", json={"rid": rid}, timeout=_SIDE_CALL_TIMEOUT_S
                )
            except httpx.HTTPError as error:
                logger.warning("could not abort %s on %s: %s", rid, worker.url, error)

    # ---------------------------------------------------------------------- requests

    async def generate(self, request: Request, route: str) -> Response:
        """One request on a generating route, proxied (regular mode) or split over a PD pair."""
        raw = await request.body()
        body = json_body(raw)
        if not isinstance(body, dict):
            raise RouterError(400, "the request body must be a JSON object", "invalid_request")
        key = body_key(route, body)
        headers = request_headers(request)
        if self.config.disaggregated:
            return await PDExchange(self, route, body, key, headers).run(request)
        return await self._proxy(request, route, raw, key, headers, request_ids(body))

    async def _proxy(
        self,
        request: Request,
        route: str,
        raw: bytes,
        key: BodyKey,
        headers: dict[str, str],
        rids: list[str],
    ) -> Response:
        """Regular mode: the body, unchanged, to the worker the policy picks (another one if
        it refuses the connection); its answer passed through."""
        pool = self.pools["regular"]
        while True:
            try:
                worker = pool.choose(key.key, key.namespace)
            except NoWorkerAvailable as error:
                raise RouterError(503, str(error), "no_worker") from None
            pool.begin(worker.url)
            self.track(rids, [worker])
            try:
                upstream = await until_disconnected(request, self.send(worker, route, raw, headers))
                break
            except httpx.ConnectError as error:
                self._end(pool, worker, rids)
                pool.mark_unreachable(worker.url)
                if not pool.serving:
                    raise worker_failed("regular", worker.url, error) from None
                logger.warning(
                    "worker %s refused a request (%s); trying another", worker.url, error
                )
            except httpx.HTTPError as error:
                self._end(pool, worker, rids)
                raise worker_failed("regular", worker.url, error) from None
            except BaseException:
                self._end(pool, worker, rids)
                raise
        ended = False

        async def close() -> None:
            nonlocal ended
            if not ended:
                ended = True
                await upstream.aclose()
                self._end(pool, worker, rids)

        return ProxiedStream(passthrough(upstream, worker.url), upstream, close)

    async def send(
        self, worker: WorkerSpec, route: str, content: bytes, headers: dict[str, str]
    ) -> httpx.Response:
        """POST `content` to the worker's `route`; the answer with its body still to read."""
        outgoing = self.client.build_request(
            "POST", worker.url + route, content=content, headers=headers
        )
        return await self.client.send(outgoing, stream=True)

    async def get_from_worker(self, path: str, request: Request) -> Response:
        """A GET answered by the first worker in routing (decode workers first in PD mode)."""
        order = ("regular", "decode", "prefill")
        workers = [
            w
            for role in order
            if role in self.pools
            for w in self.pools[role].workers.values()
            if self.pools[role].healthy(w.url)
        ]
        if not workers:
            raise RouterError(503, "no worker is serving; retry shortly", "no_worker")
        last: Exception | None = None
        for worker in workers:
            try:
                answer = await self.client.get(
                    worker.url + path,
                    headers=request_headers(request),
                    timeout=_SIDE_CALL_TIMEOUT_S,
                )
            except httpx.HTTPError as error:
                last = error
                continue
            media_type = answer.headers.get("content-type")
            return Response(answer.content, answer.status_code, media_type=media_type)
        assert last is not None
        raise worker_failed(workers[-1].role, workers[-1].url, last)

    async def server_info(self) -> dict[str, Any]:
        """The router's own state, and each worker's `/get_server_info` (or why it has
        none)."""
        workers = [entry for pool in self.pools.values() for entry in pool.snapshot()]

        async def info(entry: dict[str, Any]) -> None:
            try:
                answer = await self.client.get(
                    entry["url"] + "/get_server_info", timeout=_SIDE_CALL_TIMEOUT_S
                )
                entry["server_info"] = answer.json() if answer.status_code == 200 else None
                if answer.status_code != 200:
                    entry["error"] = f"HTTP {answer.status_code}"
            except (httpx.HTTPError, ValueError) as error:
                entry["server_info"], entry["error"] = None, f"{type(error).__name__}: {error}"

        await asyncio.gather(*(info(entry) for entry in workers))
        return {
            "router": {
                "version": __version__,
                "mode": "pd" if self.config.disaggregated else "regular",
                "policies": {role: pool.policy for role, pool in self.pools.items()},
                "serving": self.serving,
            },
            "workers": workers,
        }

    async def to_workers(
        self, path: str, payload: Any, serving_only: bool = True
    ) -> list[dict[str, Any]]:
        """`POST path` with the JSON `payload` to every worker (in routing, unless not
        `serving_only`); each one's URL, status and answer."""

        async def call(worker: WorkerSpec) -> dict[str, Any]:
            try:
                answer = await self.client.post(
                    worker.url + path, json=payload, timeout=_SIDE_CALL_TIMEOUT_S
                )
                return {"url": worker.url, "status": answer.status_code, "body": _json(answer)}
            except httpx.HTTPError as error:
                return {
                    "url": worker.url,
                    "status": 502,
                    "body": f"{type(error).__name__}: {error}",
                }

        workers = [
            w
            for pool in self.pools.values()
            for w in pool.workers.values()
            if pool.healthy(w.url) or not serving_only
        ]
        return list(await asyncio.gather(*(call(w) for w in workers)))

    async def abort_request(self, body: Any) -> dict[str, Any]:
        """`{"rid": ...}`: abort it on the workers it runs on; `{"abort_all": true}`: on
        every worker."""
        if not isinstance(body, dict):
            raise RouterError(400, 'send {"rid": ...} or {"abort_all": true}', "invalid_request")
        if body.get("abort_all"):
            results = await self.to_workers("/abort_request", {"abort_all": True}, False)
            return {"success": all(r["status"] == 200 for r in results), "workers": results}
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise RouterError(400, "give the request id to abort as rid", "invalid_request")
        workers = self._running.get(rid, [])
        await asyncio.gather(*(self.abort(w, [rid]) for w in workers))
        return {"success": bool(workers), "workers": [w.url for w in workers]}


def create_router_app(config: RouterConfig) -> FastAPI:
    """The router's FastAPI app; its lifespan starts the client and the health checks."""
    router = HttpRouter(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="radixlm-router", version=__version__, lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(RouterError)
    async def router_error(request: Request, error: RouterError) -> JSONResponse:
        return error.response()

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, error: ClientGone) -> Response:
        return Response(status_code=499)

    for route in GENERATE_ROUTES:
        app.add_api_route(route, _generate_route(router, route), methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        """200 while the router can route (every pool has a worker in routing), else 503."""
        if router.serving:
            return Response(status_code=200)
        down = [role for role, pool in router.pools.items() if not pool.serving]
        message = f"no {' and no '.join(down)} worker is serving; retry shortly"
        return RouterError(503, message, "no_worker").response()

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.get_from_worker("/v1/models", request)

    @app.get("/get_model_info")
    async def model_info(request: Request) -> Response:
        return await router.get_from_worker("/get_model_info", request)

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return await router.server_info()

    @app.get("/list_workers")
    async def list_workers() -> dict[str, Any]:
        """Each worker: URL, role, in routing or not, requests in flight."""
        return {"workers": [e for pool in router.pools.values() for e in pool.snapshot()]}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> JSONResponse:
        """Flush every worker's cache; the cache-aware trees of those that did are dropped."""
        results = await router.to_workers("/flush_cache", None)
        for result in results:
            if result["status"] == 200:
                for pool in router.pools.values():
                    if result["url"] in pool.workers:
                        pool.router.forget(result["url"])
        ok = all(r["status"] == 200 for r in results)
        return JSONResponse({"success": ok, "workers": results}, status_code=200 if ok else 400)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        return await router.abort_request(json_body(await request.body()))

    return app


def _generate_route(router: HttpRouter, route: str) -> Callable[[Request], Awaitable[Response]]:
    async def generate(request: Request) -> Response:
        return await router.generate(request, route)

    generate.__name__ = "proxy_" + route.strip("/").replace("/", "_")
    generate.__doc__ = f"`POST {route}`, proxied to a worker (a prefill/decode pair in PD mode)."
    return generate


def json_body(raw: bytes) -> Any:
    """A request body's JSON; a 400 when it is none."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RouterError(
            400, f"the request body is not valid JSON: {error}", "invalid_json"
        ) from None


def _json(answer: httpx.Response) -> Any:
    try:
        return answer.json()
    except ValueError:
        return answer.text
